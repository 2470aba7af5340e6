"""A rung dropped on both of selection's passes keeps both reasons; one kept on the second pass
leaves the first pass's reason in the stage log (``backend.selection.dropped_reason``, used
by ``stages.backend.task_select``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pytest_opprof.backend.selection import dropped_reason, worth_a_second_pass
from pytest_opprof.pipeline import STOCK_FILE
from pytest_opprof.schema import (
    BackendSelection,
    Optimizations,
    StockBaseline,
    read_artifact,
    write_artifact,
)

NO_GAIN = "made nothing faster: 1.000x (95% CI 0.990–1.010) against the plan without it"


def test_a_first_pass_reason_is_the_reason() -> None:
    assert dropped_reason(None, NO_GAIN, second_pass=False) == NO_GAIN
    # the first pass never meets an earlier record, but would not fold one in
    assert dropped_reason("not tried: x", NO_GAIN, second_pass=False) == NO_GAIN


def test_a_second_pass_reason_follows_the_first() -> None:
    nowhere = "applied nowhere: bn_fold-1: no conv/linear followed by a constant per-channel affine"
    reason = dropped_reason(NO_GAIN, nowhere, second_pass=True)
    assert reason == f"first pass: {NO_GAIN}; second pass: {nowhere}"
    # the record is read for a second pass before it is written: its first words decide
    assert worth_a_second_pass([NO_GAIN], revived=False)


# ------------------------------------------------------------------ through task_select


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Variant:
    """A built rung: computes what the model does; ``faster`` says how its timing goes, or
    ``time``, its call's time as a share of the plan's below it."""

    def __init__(self, model: torch.nn.Module, faster: bool, time: float | None = None) -> None:
        self.model, self.faster = model, faster
        self.time = time if time is not None else 0.8 if faster else 1.0

    def __call__(self, *args: Any) -> Any:
        return self.model(*args)


def _timings(calls: dict[str, Any], template: Any, **kw: Any) -> Any:
    """Interleaved rounds: a candidate runs in its ``Variant.time`` (80% of the time of the
    plan below it where ``faster``, else as fast), with a little spread so that the statistics
    have some."""
    from pytest_opprof.capture.timing import RoundSamples

    rounds = int(kw["rounds"])
    spread = [1.0 + 0.001 * ((i * 7) % 5 - 2) for i in range(rounds)]
    samples = {}
    for name, fn in calls.items():
        base = fn.time if isinstance(fn, Variant) and name == "candidate" else 1.0
        samples[name] = [base * s for s in spread]
    out = RoundSamples(samples, {name: 10 for name in calls})
    out.host_us = [1.0] * rounds
    return out


def _proposals(make_proposal: Any) -> list[Any]:
    return [
        make_proposal("bn_fold-1", "bn_fold", "aten"),
        make_proposal("memory_layout-1", "memory_layout", "non_graph"),
        make_proposal("pretranspose_weights-1", "pretranspose_weights", "inductor_config"),
    ]


def _workload(
    tmp_path: Path, proposals: list[Any], recipe: str | None = None
) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model and its input, and in ``tmp_path`` what ``task_select`` reads: the
    proposals, and with ``recipe`` the stock recipe the stock task kept (at bf16)."""
    torch.manual_seed(0)
    write_artifact(
        tmp_path / "optimizations.json",
        Optimizations(workload="w", device_type="cpu", proposals=proposals),
    )
    if recipe is not None:
        write_artifact(tmp_path / STOCK_FILE, StockBaseline(recipe=recipe, dtype="bfloat16"))
    return Model().eval(), torch.randn(2, 4)


def _select_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    model: torch.nn.Module,
    x: torch.Tensor,
    build: Any,
    **options: str,
) -> Any:
    """``task_select``'s spec for ``model`` on ``x`` in ``tmp_path``, its builds by ``build``
    and its timings by :func:`_timings` (the stages' torch set-up, loading and compiling the
    baseline stood in for)."""
    from pytest_opprof.backend import build as build_module
    from pytest_opprof.capture import timing
    from pytest_opprof.options import OpprofOptions
    from pytest_opprof.schema import ChildSpec
    from pytest_opprof.stages import common

    monkeypatch.setattr(build_module, "build", build)
    monkeypatch.setattr(timing, "time_interleaved", _timings)
    monkeypatch.setattr(common, "setup_torch", lambda: None)
    monkeypatch.setattr(
        common, "load_baseline", lambda spec, device: SimpleNamespace(model=model, inputs=(x,))
    )
    monkeypatch.setattr(common, "compile_timed", lambda m, backend, inputs, device: (m, 0.0))
    values = {"out": str(tmp_path), "device": "cpu", **options}
    return ChildSpec(
        task="backend",
        workload=str(tmp_path / "w.py"),
        out_dir=str(tmp_path),
        options=OpprofOptions.from_values(values).to_child(),
    )


def test_task_select_keeps_each_dropped_rungs_history(
    make_proposal: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The ladder on the CPU: bn_fold, memory_layout, pretranspose_weights. On the first pass
    bn_fold and memory_layout make nothing faster and frozen weights are kept; on the second,
    on top of them, bn_fold applies nowhere (as it did before its passes ran ahead of
    freezing) and memory_layout is faster."""
    from pytest_opprof.backend import build as build_module
    from pytest_opprof.passes.base import PassResult, applied
    from pytest_opprof.stages import backend

    model, x = _workload(tmp_path, _proposals(make_proposal))
    tried: list[tuple[str, ...]] = []

    def build(fresh: torch.nn.Module, inputs: Any, plan: Any) -> Any:
        tried.append(tuple(plan.proposals))
        frozen = bool(plan.config_patches.get("freezing"))
        results = []
        if "bn_fold" in plan.aten:
            said = "no conv/linear followed by ..."
            results.append(
                PassResult("bn_fold", "NOT_APPLIED", said) if frozen else applied("bn_fold", "", 1)
            )
        faster = (plan.channels_last and frozen) or plan.proposals == ["pretranspose_weights-1"]
        return build_module.BuiltVariant(fn=Variant(fresh, faster), model=fresh, results=results)

    spec = _select_on_cpu(monkeypatch, tmp_path, model, x, build)

    backend.task_select(spec)

    selection = read_artifact(
        tmp_path / "profiler_output" / "backend_selection.json", BackendSelection
    )
    assert tried == [
        ("bn_fold-1",),
        ("memory_layout-1",),
        ("pretranspose_weights-1",),
        ("pretranspose_weights-1", "bn_fold-1"),
        ("pretranspose_weights-1", "memory_layout-1"),
    ]
    assert selection.plan.proposals == ["pretranspose_weights-1", "memory_layout-1"]
    (dropped,) = selection.dropped
    assert dropped.id == "bn_fold-1"
    first, second = dropped.reason.split("; second pass: ")
    assert first.startswith("first pass: made nothing faster: ")
    assert second == "applied nowhere: bn_fold-1: no conv/linear followed by ..."
    assert "[second pass]" in selection.waterfall[-1].step
    log = capsys.readouterr().out
    assert "kept memory_layout-1 on the second pass; first pass: made nothing faster: " in log
    json.loads((tmp_path / "profiler_output" / "backend_selection.json").read_text())


def test_selection_asks_the_warmers_for_both_outcomes_on_both_passes(
    make_proposal: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ladder of the test above. At each rung it builds on the plan so far, selection
    names the plan with it and the plan below it, and the rungs it may build after it: on the
    first pass the rest of the ladder, on the second the dropped rungs still to be tried
    again. The next plan it builds on the same pass is one of the first two the warmers are
    asked for, whether the rung was kept or not (the second pass's first build, which the
    first pass's outcome decides, is not guessed)."""
    from pytest_opprof.backend import build as build_module
    from pytest_opprof.stages import backend, rung_warmer

    model, x = _workload(tmp_path, _proposals(make_proposal))
    asked: list[tuple[tuple[str, ...], list[str], tuple[str, ...] | None]] = []
    tried: list[tuple[str, ...]] = []

    asked_for: list[list[tuple[str, ...]]] = []

    def want(self: Any, plan: Any, rungs: Any, below: Any = None) -> None:
        names = [r.name for r in rungs]
        asked.append((tuple(plan.proposals), names, below and tuple(below.proposals)))
        guess = rung_warmer.plans_after(plan, rungs, 2, below)
        asked_for.append([tuple(p.proposals) for p in guess])

    monkeypatch.setattr(rung_warmer.Ahead, "want", want)

    def build(fresh: torch.nn.Module, inputs: Any, plan: Any) -> Any:
        tried.append(tuple(plan.proposals))
        frozen = bool(plan.config_patches.get("freezing"))
        faster = (plan.channels_last and frozen) or plan.proposals == ["pretranspose_weights-1"]
        return build_module.BuiltVariant(fn=Variant(fresh, faster), model=fresh, results=[])

    backend.task_select(_select_on_cpu(monkeypatch, tmp_path, model, x, build))

    frozen = "pretranspose_weights-1"
    assert asked == [
        (("bn_fold-1",), ["memory_layout", "pretranspose_weights"], ()),
        (("memory_layout-1",), ["pretranspose_weights"], ()),
        ((frozen,), [], ()),
        ((frozen, "bn_fold-1"), ["memory_layout"], (frozen,)),
        ((frozen, "memory_layout-1"), [], (frozen,)),
    ]
    for at in (0, 1, 3):  # the first pass's first two rungs, the second pass's first
        assert tried[at + 1] in asked_for[at], (tried[at + 1], asked_for[at])


def test_a_cast_past_the_tolerance_is_kept_under_autocast_and_a_faster_stock_recipe_ships(
    make_proposal: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bf16 by casting the model changes the output past the calibrated limit; the same rung
    under autocast computes what eager under autocast does and is kept. With the stock
    baseline measured, the recipe the stock task kept is then built in place of the ladder's
    plan and, measured faster, is what ships; the ladder's proposal is recorded as replaced."""
    from pytest_opprof.backend import build as build_module
    from pytest_opprof.stages import backend

    proposals = [make_proposal("dtype_promotion-1", "dtype_promotion", "non_graph")]
    model, x = _workload(tmp_path, proposals, recipe="autocast")
    tried: list[tuple[tuple[str, ...], bool]] = []

    class Computes(torch.nn.Module):
        def __init__(self, autocast: bool) -> None:
            super().__init__()
            self.autocast = autocast

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            if self.autocast:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return model(t).float()
            return model(t) * 1.1  # a cast's error, well past bf16's own

    def build(fresh: torch.nn.Module, inputs: Any, plan: Any) -> Any:
        tried.append((tuple(plan.proposals), plan.autocast))
        recipe = plan.stock_recipe == "autocast"
        fn = Variant(Computes(plan.autocast or recipe), plan.autocast or recipe)
        return build_module.BuiltVariant(fn=fn, model=fresh, results=[])

    spec = _select_on_cpu(monkeypatch, tmp_path, model, x, build, stock="true")

    backend.task_select(spec)

    selection = read_artifact(
        tmp_path / "profiler_output" / "backend_selection.json", BackendSelection
    )
    assert tried == [
        (("dtype_promotion-1",), False),
        (("dtype_promotion-1",), True),
        (("stock-recipe",), False),
    ]
    failed = [v for v in selection.variants if v.error == "numerics out of tolerance"]
    assert len(failed) == 1 and not failed[0].plan.autocast
    assert "the cast changed the output; trying it under autocast" in capsys.readouterr().out
    assert selection.plan.stock_recipe == "autocast" and selection.chosen == "stock-recipe"
    (replaced,) = selection.dropped
    assert replaced.id == "dtype_promotion-1" and replaced.reason.startswith("replaced")


class Died(BaseException):
    """A selection process dying (a CUDA error): nothing in it catches this."""


def test_selection_resumed_at_the_stock_rung_times_the_recipe_against_the_ladder_s_plan(
    make_proposal: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A selection process that dies on the stock rung leaves the ladder's selection and the
    pending marker; a fresh one resumed there (``stock_rung_only``) builds the ladder's plan
    again, climbs no rung, and times the recipe against that plan: measured faster, it ships,
    with the ladder's records kept."""
    from pytest_opprof.backend import build as build_module
    from pytest_opprof.stages import backend

    model, x = _workload(tmp_path, _proposals(make_proposal), recipe="cast")
    tried: list[tuple[str, ...]] = []
    dies = [True]

    def build(fresh: torch.nn.Module, inputs: Any, plan: Any) -> Any:
        tried.append(tuple(plan.proposals))
        if plan.stock_recipe and dies[0]:
            raise Died
        faster = plan.proposals == ["pretranspose_weights-1"] or bool(plan.stock_recipe)
        return build_module.BuiltVariant(fn=Variant(fresh, faster), model=fresh, results=[])

    spec = _select_on_cpu(monkeypatch, tmp_path, model, x, build, stock="true")
    with pytest.raises(Died):
        backend.task_select(spec)
    assert (tmp_path / backend.STOCK_RUNG_PENDING).exists()
    path = tmp_path / backend.SELECTION_FILE
    ladder = read_artifact(path, BackendSelection)
    assert ladder.plan.proposals == ["pretranspose_weights-1"]
    assert [d.id for d in ladder.dropped] == ["bn_fold-1", "memory_layout-1"]
    climbed = len(tried)

    dies[0] = False
    backend.task_select(spec.model_copy(update={"stock_rung_only": True}))

    assert tried[climbed:] == [("pretranspose_weights-1",), ("stock-recipe",)]
    selection = read_artifact(path, BackendSelection)
    assert selection.chosen == "stock-recipe" and selection.plan.stock_recipe == "cast"
    assert selection.variants[: len(ladder.variants)] == ladder.variants
    assert selection.waterfall[: len(ladder.waterfall)] == ladder.waterfall
    replaced = {d.id: d.reason for d in selection.dropped}
    assert replaced["pretranspose_weights-1"].startswith("replaced: the stock recipe")
    assert replaced["bn_fold-1"] == next(d.reason for d in ladder.dropped if d.id == "bn_fold-1")
    assert not (tmp_path / backend.STOCK_RUNG_PENDING).exists()
    assert "built pretranspose_weights-1 again" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("stock_time", "ships"),
    [(1.0, True), (1.25, False)],
    ids=["level-with-the-plan", "slower-than-the-plan"],
)
def test_the_stock_recipe_ships_unless_the_ladder_s_plan_beats_it(
    make_proposal: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stock_time: float,
    ships: bool,
) -> None:
    """The stock rung turns selection's bar round: the ladder's plan must be measured faster
    than the recipe to ship. Level within the noise, the recipe ships (never slower than the
    stock line); slower, it is dropped, saying the plan was faster."""
    from pytest_opprof.backend import build as build_module
    from pytest_opprof.backend.selection import PLAN_FASTER
    from pytest_opprof.stages import backend

    model, x = _workload(tmp_path, _proposals(make_proposal), recipe="cast")

    def build(fresh: torch.nn.Module, inputs: Any, plan: Any) -> Any:
        time = stock_time if plan.stock_recipe else None
        faster = plan.proposals == ["pretranspose_weights-1"]
        return build_module.BuiltVariant(fn=Variant(fresh, faster, time), model=fresh, results=[])

    spec = _select_on_cpu(monkeypatch, tmp_path, model, x, build, stock="true")
    backend.task_select(spec)

    selection = read_artifact(tmp_path / backend.SELECTION_FILE, BackendSelection)
    why = {d.id: d.reason for d in selection.dropped}
    if ships:
        assert selection.chosen == "stock-recipe" and selection.plan.stock_recipe == "cast"
        assert why["pretranspose_weights-1"].startswith("replaced: the stock recipe")
    else:
        assert selection.chosen == "pretranspose_weights-1"
        assert selection.plan.stock_recipe is None
        assert why["stock-recipe"].startswith(f"{PLAN_FASTER}: 0.800x (95% CI ")
        assert why["stock-recipe"].endswith("against the ladder's plan")


def test_selection_starts_from_the_capture_s_timing_of_eager_and_torch_compile(
    make_proposal: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Selection's reference and the plan its first rung is timed against come from the
    capture's interleaved timing (profile.json): the two are not timed again."""
    from pytest_opprof.schema import Profile
    from pytest_opprof.stages import backend

    h200 = read_artifact(
        Path(__file__).parents[1] / "data/h200/conv_block/profile.json.gz", Profile
    )
    write_artifact(tmp_path / "profile.json", h200)
    model, x = _workload(tmp_path, [make_proposal("bn_fold-1", "bn_fold", "aten")])

    def build(model: Any, inputs: Any, plan: Any) -> Any:
        return SimpleNamespace(fn=Variant(model, faster=True), results=[])

    spec = _select_on_cpu(monkeypatch, tmp_path, model, x, build)
    timed: list[set[str]] = []
    from pytest_opprof.capture import timing

    def recorded(calls: dict[str, Any], template: Any, **kw: Any) -> Any:
        timed.append(set(calls))
        return _timings(calls, template, **kw)

    monkeypatch.setattr(timing, "time_interleaved", recorded)
    backend.task_select(spec)
    chosen = read_artifact(tmp_path / "profiler_output/backend_selection.json", BackendSelection)
    captured = h200.timing.variants
    base = {v.name: v.latency for v in chosen.variants if v.name in ("eager", "compile")}
    assert base == {k: captured[k] for k in ("eager", "compile")}
    faster = min(("eager", "compile"), key=lambda k: captured[k].median_ms)
    assert chosen.reference == faster
    assert chosen.reference_ms == captured[faster].median_ms
    assert timed == [{"current", "candidate"}]  # the one rung, and nothing else
