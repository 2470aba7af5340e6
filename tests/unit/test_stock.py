"""The stock baseline (``backend.stock``): its recipes as a user writes them, and the choice of
the faster one whose outputs pass the validator's checks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pytest_opprof.backend import stock
from pytest_opprof.numerics import anti_cheat_checks
from pytest_opprof.schema import Numerics
from pytest_opprof.tolerances import tolerance_for


def _tiny() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    ).eval()
    return model, torch.randn(2, 3, 8, 8)


def _call(x: torch.Tensor) -> Callable[[Callable[..., Any]], None]:
    def first(fn: Callable[..., Any]) -> None:
        with torch.no_grad():
            fn(x)

    return first


def test_both_recipes_compile_and_compute_the_model_in_its_output_dtype() -> None:
    model, x = _tiny()
    for recipe in stock.RECIPES:
        built = stock.build(recipe, model, (x,), "bfloat16", first_call=_call(x))
        with torch.no_grad():
            got = built.fn(x)
        assert got.dtype == torch.float32 and built.compile_s > 0
        rtol, atol = tolerance_for("bfloat16")
        numerics, checks = anti_cheat_checks(
            model, built.fn, (x,), dtype="bfloat16", rtol=rtol, atol=atol
        )
        assert numerics.ok, numerics
        assert all(c.status == "pass" for c in checks.values()), checks


def test_the_cast_recipe_casts_weights_and_goes_channels_last_on_image_batches() -> None:
    model, x = _tiny()
    cast = stock.Cast(model, torch.bfloat16, torch.float32, stock.channels_last_input((x,)))
    assert isinstance(cast.model, nn.Sequential)
    conv = cast.model[0]
    assert isinstance(conv, nn.Conv2d)
    assert conv.weight.dtype == torch.bfloat16
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    first = model[0]
    assert isinstance(first, nn.Conv2d)
    assert first.weight.dtype == torch.float32  # the workload's model is left alone
    assert not stock.channels_last_input((torch.randn(2, 5),))
    assert "channels-last" in stock.describe("cast", "bfloat16", (x,))
    assert "channels-last" not in stock.describe("autocast", "bfloat16", (x,))


def _numerics(ok: bool) -> Numerics:
    return Numerics(max_abs_err=0.0, rel_err=0.0, rtol=1e-2, atol=1e-3, dtype="bfloat16", ok=ok)


class _Recipes:
    """``stock.build`` replaced: each recipe at each dtype builds (or raises), and the checks
    and the brief timing answer from tables."""

    def __init__(
        self,
        fails: dict[tuple[str, str], str],
        raises: set[tuple[str, str]] = frozenset(),  # type: ignore[assignment]
        ms: dict[str, float] | None = None,
    ) -> None:
        self.fails, self.raises, self.ms = fails, raises, ms or {}
        self.timed: list[list[str]] = []

    def build(
        self, recipe: str, model: Any, inputs: Any, dtype: str, *, first_call: Any
    ) -> stock.StockRecipe:
        if (recipe, dtype) in self.raises:
            raise RuntimeError("Inductor failed\nmore lines")
        fn: Callable[..., Any] = lambda *a: (recipe, dtype)  # noqa: E731
        return stock.StockRecipe(recipe, dtype, fn, 1.0)

    def check(self, fn: Callable[..., Any], dtype: str) -> tuple[Numerics, list[str]]:
        key = fn()
        failed = self.fails.get(key)
        return _numerics(failed is None), [failed] if failed else []

    def time_brief(self, calls: dict[str, Callable[..., Any]]) -> dict[str, float]:
        self.timed.append(sorted(calls))
        return {r: self.ms[r] for r in calls}


def _choose(
    monkeypatch: pytest.MonkeyPatch, fake: _Recipes, plan_dtype: str | None = "bfloat16"
) -> Any:
    monkeypatch.setattr(stock, "build", fake.build)
    model, x = _tiny()
    return stock.choose(
        model,
        (x,),
        plan_dtype,
        check=fake.check,
        first_call=_call(x),
        time_brief=fake.time_brief,
    )


def test_the_faster_passing_recipe_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Recipes({}, ms={"autocast": 0.30, "cast": 0.20})
    chosen = _choose(monkeypatch, fake)
    assert (chosen.recipe, chosen.dtype) == ("cast", "bfloat16")
    assert fake.timed == [["autocast", "cast"]]
    assert [t.median_ms for t in chosen.trials] == [0.30, 0.20]
    assert "faster than autocast 0.3000 ms" in chosen.message


def test_a_recipe_that_fails_the_checks_is_never_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Recipes({("cast", "bfloat16"): "equivalent: rel err 3e-2 > 1e-2"})
    chosen = _choose(monkeypatch, fake)
    assert chosen.recipe == "autocast"
    assert fake.timed == []  # one passed: nothing to time against
    cast = next(t for t in chosen.trials if t.recipe == "cast")
    assert cast.error and "rel err" in cast.error


def test_bf16_failing_falls_back_to_the_backends_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    fails = {(r, "bfloat16"): "equivalent: too far" for r in stock.RECIPES}
    fake = _Recipes(fails, raises={("autocast", "float32")})
    chosen = _choose(monkeypatch, fake, plan_dtype=None)
    assert (chosen.recipe, chosen.dtype) == ("cast", "float32")
    errors = {(t.recipe, t.dtype): t.error for t in chosen.trials}
    assert errors[("autocast", "float32")] == "failed to build: RuntimeError: Inductor failed"


def test_none_passing_is_no_bar_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    fails = {(r, "bfloat16"): f"{r} wrong" for r in stock.RECIPES}
    chosen = _choose(monkeypatch, _Recipes(fails))
    assert chosen.recipe is None and chosen.dtype is None
    assert chosen.message.startswith("no stock recipe passed")
    assert "autocast at bfloat16: autocast wrong" in chosen.message


def test_before_build_is_called_before_each_build_in_their_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hook a caller waits in (the stock task, for the warmer's end): once before each
    build, the fallback round's included, with the recipe and dtype about to be built."""
    fails = {(r, "bfloat16"): "equivalent: too far" for r in stock.RECIPES}
    fake = _Recipes(fails, raises={("autocast", "float32")}, ms={"cast": 1.0})
    calls: list[tuple[str, str, str]] = []

    def build(recipe: str, model: Any, inputs: Any, dtype: str, *, first_call: Any) -> Any:
        calls.append(("build", recipe, dtype))
        return fake.build(recipe, model, inputs, dtype, first_call=first_call)

    monkeypatch.setattr(stock, "build", build)
    model, x = _tiny()
    chosen = stock.choose(
        model,
        (x,),
        None,
        check=fake.check,
        first_call=_call(x),
        time_brief=fake.time_brief,
        before_build=lambda recipe, dtype: calls.append(("before", recipe, dtype)),
    )
    assert (chosen.recipe, chosen.dtype) == ("cast", "float32")
    assert calls == [
        (step, recipe, dtype)
        for dtype in ("bfloat16", "float32")
        for recipe in stock.RECIPES
        for step in ("before", "build")
    ]


def test_what_before_build_raises_ends_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a recipe's failure (a trial's error): the caller's own, raised as it was."""
    fake = _Recipes({}, ms={"autocast": 1.0, "cast": 2.0})
    built: list[str] = []

    def build(recipe: str, model: Any, inputs: Any, dtype: str, *, first_call: Any) -> Any:
        built.append(recipe)
        return fake.build(recipe, model, inputs, dtype, first_call=first_call)

    def before_build(recipe: str, dtype: str) -> None:
        if recipe == "cast":
            raise RuntimeError("the stage that started this process has ended")

    monkeypatch.setattr(stock, "build", build)
    model, x = _tiny()
    with pytest.raises(RuntimeError, match="has ended"):
        stock.choose(
            model,
            (x,),
            None,
            check=fake.check,
            first_call=_call(x),
            time_brief=fake.time_brief,
            before_build=before_build,
        )
    assert built == ["autocast"]


def test_the_warmer_compiles_the_stock_task_s_last_build_of_its_first_round() -> None:
    """The stock warmer (``stages.backend``) compiles what the stock task would compile last
    in its first round, so the stock task's own compile of its first recipe overlaps it."""
    from pytest_opprof.stages import backend

    last, first_dtype = list(stock.RECIPES)[-1], stock.dtypes_to_try(None)[0]
    assert (last, first_dtype) == backend.WARMED


def test_dtypes_tried() -> None:
    assert stock.dtypes_to_try("bfloat16") == ["bfloat16"]
    assert stock.dtypes_to_try(None) == ["bfloat16", "float32"]
    assert stock.dtypes_to_try("float16") == ["bfloat16", "float16"]


def test_the_stock_rung_is_the_kept_recipe_and_builds_it_as_a_user_writes_it(
    tmp_path: Path,
) -> None:
    """Selection's stock rung (``selection.stock_rung``) is one ``stock_recipe`` proposal; on an
    empty plan it makes a plan that is the recipe, which ``build`` compiles with
    ``torch.compile(mode="max-autotune")`` and no pass of this package, and a generated file
    ships uncompiled (it is compiled already)."""
    from pytest_opprof.backend.build import build
    from pytest_opprof.backend.codegen import render_optimized
    from pytest_opprof.backend.plan import add_proposal
    from pytest_opprof.backend.selection import stock_rung
    from pytest_opprof.schema import (
        BackendPlan,
        BackendSelection,
        StockBaseline,
        write_artifact,
    )

    path = tmp_path / "stock_baseline.json"
    assert stock_rung(path) is None
    write_artifact(path, StockBaseline(message="no stock recipe passed"))
    assert stock_rung(path) is None
    write_artifact(path, StockBaseline(recipe="cast", dtype="bfloat16", message="cast"))
    rung = stock_rung(path)
    assert rung is not None and [p.id for p in rung.proposals] == ["stock-recipe"]
    plan = add_proposal(BackendPlan(), rung.proposals[0])
    assert (plan.stock_recipe, plan.dtype, plan.proposals) == ("cast", "bfloat16", ["stock-recipe"])
    model, x = _tiny()
    built = build(model, (x,), plan)
    assert isinstance(built.fn, stock.Compiled) and built.results == []
    with torch.no_grad():
        got, want = built.fn(x), model(x)
    assert got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) < 2e-2
    selection = BackendSelection(
        workload="w",
        reference="compile",
        reference_ms=1.0,
        variants=[],
        chosen="stock-recipe",
        plan=plan,
    )
    text = render_optimized(
        stem="w",
        workload=tmp_path / "w.py",
        out_file=tmp_path / "out" / "w_optimized.py",
        selection=selection,
        proposals=list(rung.proposals),
        rtol=1.6e-2,
        atol=1e-3,
    )
    assert "model = runtime.stock_recipe(model, x, 'cast', 'bfloat16')" in text
    assert "COMPILE = False" in text and "CUDA_GRAPH = False" in text


def test_a_cast_that_changed_the_output_is_tried_again_under_autocast(
    make_proposal: Any,
) -> None:
    """Selection's fallback (``selection.autocast_instead``): the rung's dtype_promotion with
    mode autocast, the other proposals as they were; the plan keeps the weights' dtype."""
    from pytest_opprof.backend.plan import Rung, add_proposal
    from pytest_opprof.backend.selection import autocast_instead
    from pytest_opprof.schema import BackendPlan

    cast = make_proposal("dtype_promotion-1", "dtype_promotion", "non_graph")
    other = make_proposal("pretranspose_weights-1", "pretranspose_weights", "inductor_config")
    again = autocast_instead(Rung("dtype_promotion", (cast, other)))
    assert again is not None
    assert [p.params.get("mode") for p in again.proposals] == ["autocast", None]
    assert [p.id for p in again.proposals] == [cast.id, other.id]
    assert autocast_instead(again) is None  # tried once
    assert autocast_instead(Rung("pretranspose_weights", (other,))) is None
    plan = add_proposal(BackendPlan(), again.proposals[0])
    assert plan.dtype == "bfloat16" and plan.autocast
    assert not plan.without_dtype().autocast
    assert not add_proposal(BackendPlan(), cast).autocast
