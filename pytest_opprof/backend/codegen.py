"""Stage 2's writer: ``<stem>_optimized.py``, ``test_<stem>_optimized.py`` and the
implementation notes, from the selected plan. Pure Python: the files are text."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pytest_opprof import __version__
from pytest_opprof.backend.plan import ExtraPass
from pytest_opprof.schema import BackendPlan, BackendSelection, Proposal
from pytest_opprof.workload import GENERATED_MARKER


def backend_name(stem: str) -> str:
    return f"opprof_{stem}"


def _relative(target: Path, start: Path) -> str:
    return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()


def _why(p: Proposal) -> str:
    first = p.evidence[0] if p.evidence else None
    shown = f"{first.metric}={first.value}{first.unit}" if first else "no evidence"
    return f"{p.id} ({p.type}, {p.ir_level}, {p.confidence} confidence): {shown}"


def render_optimized(
    *,
    stem: str,
    workload: Path,
    out_file: Path,
    selection: BackendSelection,
    proposals: Sequence[Proposal],
    rtol: float,
    atol: float,
    extra_passes: Sequence[ExtraPass] = (),
) -> str:
    """The text of ``<stem>_optimized.py``. ``extra_passes``: the user passes the plan uses
    (``plan.extra_passes``), which the file imports from their own modules and registers."""
    plan = selection.plan
    kept = [p for p in proposals if p.id in plan.proposals]
    dropped = {d.id: d.reason for d in selection.dropped}
    kept_lines = "\n".join(f"- {_why(p)}" for p in kept) or "- none: the baseline is kept"
    dropped_lines = "\n".join(f"- {pid}: {reason}" for pid, reason in dropped.items()) or "- none"
    rel = _relative(workload, out_file.parent)
    name = backend_name(stem)

    def listing(values: Sequence[str]) -> str:
        return "[" + ", ".join(repr(v) for v in values) + "]"

    patches = "{" + ", ".join(f"{k!r}: {v!r}" for k, v in plan.config_patches.items()) + "}"
    changes = []
    if plan.dtype:
        changes.append(f"dtype={plan.dtype!r}")
    if plan.dtype and plan.autocast:
        changes.append("autocast=True")
    if plan.channels_last:
        changes.append("channels_last=True")
    if plan.pad_batch_to:
        changes.append(f"pad_batch_to={plan.pad_batch_to}")
    body = (
        f"    model = runtime.apply_non_graph(model, x, {', '.join(changes)}, "
        "results=PASS_RESULTS)\n"
        if changes
        else ""
    )
    if plan.stock_recipe is not None:
        body = (
            f"    model = runtime.stock_recipe(model, x, {plan.stock_recipe!r}, "
            f"{plan.dtype or 'float32'!r})\n"
        )
        registration = (
            "# Measured selection found the stock recipe faster than its own plan: the model is\n"
            "# that recipe, compiled as torch.compile(mode='max-autotune') on its first call\n"
            "# (COMPILE = False: compiling it again would wrap a compiled model).\n"
            "COMPILE = False\n"
            "runtime.register_backend(BACKEND, passthrough=True, results=PASS_RESULTS)"
        )
    elif selection.chosen == "eager" and plan == BackendPlan():
        registration = (
            "# Measured selection found nothing faster than eager: the backend runs the captured\n"
            "# graph as it is, and the pipeline times the model uncompiled (COMPILE = False),\n"
            "# since Dynamo's guard checks alone would make it slower than the baseline.\n"
            "COMPILE = False\n"
            "runtime.register_backend(BACKEND, passthrough=True, results=PASS_RESULTS)"
        )
    else:
        registration = (
            "COMPILE = True\n"
            f"runtime.register_backend(\n    BACKEND,\n    functional={listing(plan.functional)},\n"
            f"    aten={listing(plan.aten)},\n    config_patches={patches},\n"
            "    results=PASS_RESULTS,\n)"
        )
    if plan.cuda_graph_model:
        registration += (
            "\n# Each call replays one CUDA graph of the whole compiled call, which measured\n"
            "# faster than without: backend.model_graph. Its outputs are the graph's memory,\n"
            "# overwritten by the next call: .clone() one you keep.\nCUDA_GRAPH = True"
        )
    else:
        registration += "\nCUDA_GRAPH = False"
    passes_import, user_passes = _user_passes(extra_passes, out_file)
    return f'''{GENERATED_MARKER} {__version__}; `opprof validate` re-checks it after edits.
"""Optimized backend for ``{stem}``: compile with ``backend="{name}"``.

Proposals applied (kept by measured selection against {selection.reference}):
{kept_lines}

Proposals dropped:
{dropped_lines}

Use it::

    model, x = get_model_and_input()
    out = optimize(model)(x)  # torch.compile(model, backend="{name}"), as selected
"""

from __future__ import annotations

from typing import Any

import torch

{passes_import}from pytest_opprof.backend import runtime
from pytest_opprof.passes.base import PassResult

baseline = runtime.import_baseline(__file__, {rel!r}, {stem!r})
{user_passes}
BACKEND = {name!r}
RTOL, ATOL = {rtol!r}, {atol!r}
PASS_RESULTS: list[PassResult] = []

{registration}


def get_model_and_input() -> tuple[torch.nn.Module, torch.Tensor]:
    """The baseline's model and input; the model carries the non-graph changes and still takes
    the baseline's input."""
    model, x = baseline.get_model_and_input()
{body}    return model, x


def optimize(model: torch.nn.Module) -> Any:
    """``model`` as selection measured it: compiled with this backend where ``COMPILE``, then
    recorded as one CUDA graph where ``CUDA_GRAPH``."""
    return runtime.optimize(model, BACKEND, compile=COMPILE, cuda_graph=CUDA_GRAPH)
'''


def _user_passes(extra: Sequence[ExtraPass], out_file: Path) -> tuple[str, str]:
    """The import line and the block that imports and registers each user pass."""
    if not extra:
        return "", ""
    lines = [
        "",
        "# Passes a conftest registered (pytest_opprof_register_passes), imported from their own",
        "# modules so that this file works outside pytest too.",
    ]
    for folder in dict.fromkeys(str(e.path) for e in extra if e.path is not None):
        lines.append(
            f"runtime.add_import_path(__file__, {_relative(Path(folder), out_file.parent)!r})"
        )
    specs = []
    for e in extra:
        top, _, rest = e.qualname.partition(".")
        alias = "" if top == e.name else f" as {e.name}"
        lines.append(f"from {e.module} import {top}{alias}  # noqa: E402")
        apply = f"{e.name}.{rest}" if rest else e.name
        specs.append(
            f"passes.register(\n    passes.PassSpec(\n        name={e.name!r},\n"
            f"        level={e.level!r},\n        apply={apply},\n"
            f"        description={e.description!r},\n    )\n)"
        )
    return "from pytest_opprof import passes\n", "\n".join([*lines, "", *specs, ""]) + "\n"


def render_test(*, stem: str, seeds: Sequence[int] = (0, 1, 2)) -> str:
    name = backend_name(stem)
    return f'''{GENERATED_MARKER} {__version__}; the checks `opprof validate` runs as step 4.
"""Tests of ``{stem}_optimized.py``: import, registration, contract, numerical equivalence."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from pytest_opprof.backend import runtime
from pytest_opprof.workload import check_contract, flatten_tensors, fresh_inputs

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


optimized = _load("{stem}_optimized", HERE / "{stem}_optimized.py")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_backend_is_registered():
    assert {name!r} in torch._dynamo.list_backends(exclude_tags=())


def test_contract():
    result = optimized.get_model_and_input()
    check_contract(Path("{stem}_optimized.py"), result, DEVICE)


@pytest.fixture(scope="module")
def pair():
    """The baseline model and the optimized one compiled once for all seeds."""
    base_model, x = optimized.baseline.get_model_and_input()
    model, _ = optimized.get_model_and_input()
    template = x if isinstance(x, tuple) else (x,)
    return base_model, runtime.optimized_callable(optimized, model), template


@pytest.mark.parametrize("seed", {list(seeds)!r})
def test_numerically_equivalent_to_baseline(pair, seed):
    base_model, compiled, template = pair
    inputs = fresh_inputs(template, seed)
    with torch.no_grad():
        want = flatten_tensors(base_model(*inputs))
        got = [t.clone() for t in flatten_tensors(compiled(*inputs))]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        err = float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
        assert err <= optimized.RTOL, f"relative error {{err:.3e}} > {{optimized.RTOL:.1e}}"
'''


def render_notes(selection: BackendSelection, proposals: Sequence[Proposal]) -> str:
    by_id = {p.id: p for p in proposals}
    lines = [
        f"# Implementation notes: {selection.workload}",
        "",
        f"Reference for selection: `{selection.reference}` at {selection.reference_ms:.4f} ms.",
        f"Chosen variant: `{selection.chosen}`.",
        "",
        "## Variants measured",
        "",
        "Median ms: measured, eager and compile in the capture's interleaved run, each rung "
        "paired with the plan below it; that plan's median in the same rounds over the rung's "
        "is the paired ratio. A rung's speedup vs reference is chained from the paired ratios: "
        "an estimate.",
        "",
        "| variant | median ms | paired ratio vs plan below (95% CI) | plan below, same rounds "
        "| speedup vs reference | numerics | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in selection.variants:
        ms = f"{v.latency.median_ms:.4f}" if v.latency else "—"
        g = v.paired
        pair = f"{g.ratio:.3f}x ({g.ci_low:.3f}–{g.ci_high:.3f})" if g else "—"
        below = (
            f"{g.baseline} {v.paired_baseline_ms:.4f}"
            if g and v.paired_baseline_ms is not None
            else "—"
        )
        sp = "—" if v.speedup is None else f"{v.speedup:.3f}x"
        if v.speedup is not None and v.name not in ("eager", "compile"):
            sp += " (chained, estimate)"
        num = (
            f"rel {v.numerics.rel_err:.2e} ({'ok' if v.numerics.ok else 'FAIL'})"
            if v.numerics
            else "—"
        )
        lines.append(f"| {v.name} | {ms} | {pair} | {below} | {sp} | {num} | {v.error or ''} |")
    lines += ["", "## Proposals kept", ""]
    for pid in selection.plan.proposals:
        p = by_id.get(pid)
        lines.append(f"- `{pid}`" + (f": {p.rationale or p.type}" if p else ""))
    lines += ["", "## Proposals dropped (never ship slower)", ""]
    lines += [f"- `{d.id}` ({d.type}): {d.reason}" for d in selection.dropped] or ["- none"]
    lines += [
        "",
        "## Waterfall",
        "",
        "Each step's ms is measured in its run paired with the step above (whose ms in the same "
        "rounds is shown); the cumulative speedup is chained from the paired ratios, an "
        "estimate. The recapture times the chosen plan again: its figure is the gate's.",
        "",
        "| step | ms (measured) | step above, same rounds (ms) | added (paired, 95% CI) "
        "| cumulative (chained, estimate) |",
        "|---|---|---|---|---|",
    ]
    for w in selection.waterfall:
        above = "—" if w.paired_baseline_ms is None else f"{w.paired_baseline_ms:.4f}"
        added = f"{w.speedup_added:.3f}x" + (
            f" ({w.paired.ci_low:.3f}–{w.paired.ci_high:.3f})" if w.paired else ""
        )
        step_ms = w.latency_ms if w.measured_ms is None else w.measured_ms
        lines.append(
            f"| {w.step} | {step_ms:.4f} | {above} | {added} | {w.speedup_cumulative:.3f}x |"
        )
    return "\n".join(lines) + "\n"
