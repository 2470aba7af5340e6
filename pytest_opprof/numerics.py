"""The numerical check every candidate meets, wherever it runs: measured selection's rungs,
the validate stage's step 6 (``stages.validate``), LLM-written passes (``check_llm_pass``) and
``opprof validate``.

:func:`check_numerics` holds an output to the fp32 eager reference with both an L2 and an
elementwise bound, calibrated by eager at the compute dtype; :func:`judge` adds the
anti-cheating checks (finite, not constant, depends on the input, stateless) over several
seeds, on outputs that may come from another process (:class:`CandidateOutputs`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytest_opprof.schema import Numerics, PassStatus, StepResult
from pytest_opprof.tolerances import TOLERANCES
from pytest_opprof.workload import flatten_tensors, fresh_inputs

SEEDS: tuple[int, ...] = (0, 1, 2)


REFERENCE_MULTIPLE = 2.0
"""How much more error than eager at the same compute dtype a backend may show, against the
fp32 eager reference: PyTorch's own accuracy check holds a low-precision result to the same
default multiple of the low-precision eager's error (``torch._dynamo.utils.same``,
``multiplier=2.0``). Inductor's fused kernels keep intermediates in fp32, so an honest backend
usually shows about eager's own error (benchmarks/validator_margins.py measures the margin)."""

FP32_FLOOR = TOLERANCES["float32"][0]
"""A calibrated limit is never tighter than fp32's own allowance (Inductor reassociates)."""

ELEMENT_SPREAD = 10.0
"""Where no same-precision reference calibrates the elementwise bound, an element may be off by
this many times the relative limit of its tensor's RMS (beside ``atol + limit * |ref|``): the
largest of a million Gaussian errors lies about five standard deviations out."""

LOW_PRECISION = ("bfloat16", "float16")


def calibrated(overrides: Mapping[str, Any] | None) -> bool:
    """Whether eager at the compute dtype narrows the tolerance: yes, unless the workload set
    its own ``OPPROF['rtol']``, which is then the limit as written."""
    return "rtol" not in (overrides or {})


def check_numerics(
    want: Any,
    got: Any,
    *,
    dtype: str | None,
    rtol: float,
    atol: float,
    reference: Any = None,
) -> Numerics:
    """``got`` against the fp32 eager output ``want``: the same structure, dtypes and devices,
    finite, and within both bounds at once (never one or the other):

    - relative L2 error over all outputs <= limit, and
    - elementwise ``|got - want| <= atol + spread + limit * |want|`` (allclose-style).

    ``reference`` is eager's own output at the compute dtype (:func:`same_precision`), where
    the plan lowers precision: the limit is then ``REFERENCE_MULTIPLE`` times its relative error
    (never above ``rtol``, never under ``FP32_FLOOR``) and the spread that multiple of its
    largest elementwise error, so a bf16 backend is held to bf16's real error on this model.
    Without it the limit is ``rtol`` and the spread ``ELEMENT_SPREAD * limit * rms(want)``."""
    w_list, g_list = flatten_tensors(want), flatten_tensors(got)
    label = dtype or "float32"

    def verdict(failed: str | None, **figures: Any) -> Numerics:
        values = {"max_abs_err": float("inf"), "rel_err": float("inf"), **figures}
        return Numerics(
            rtol=rtol, atol=atol, dtype=label, ok=failed is None, failed=failed, **values
        )

    if len(w_list) != len(g_list):
        return verdict(
            f"structure: {len(g_list)} output tensors where the baseline has {len(w_list)}"
        )
    for i, (w, g) in enumerate(zip(w_list, g_list, strict=True)):
        what = f"output {i}" if len(w_list) > 1 else "the output"
        if w.shape != g.shape:
            return verdict(f"shape: {what} is {tuple(g.shape)}, the baseline's {tuple(w.shape)}")
        if w.dtype != g.dtype:
            return verdict(f"dtype: {what} is {g.dtype}, the baseline's {w.dtype}")
        if w.device.type != g.device.type:
            return verdict(f"device: {what} is on {g.device}, the baseline's on {w.device}")
    r_list = flatten_tensors(reference) if reference is not None else []
    calibrated = len(r_list) == len(w_list) and all(
        r.shape == w.shape for r, w in zip(r_list, w_list, strict=True)
    )
    wd = [w.detach().double() for w in w_list]
    diffs = [g.detach().double() - w for g, w in zip(g_list, wd, strict=True)]
    ref_rel = None
    limit = rtol
    if calibrated:
        r_diffs = [r.detach().double().to(w.device) - w for r, w in zip(r_list, wd, strict=True)]
        ref_rel = _rel(r_diffs, wd)
        limit = min(rtol, max(REFERENCE_MULTIPLE * ref_rel, FP32_FLOOR))
    rel = _rel(diffs, wd)
    max_abs = max((float(d.abs().max()) for d in diffs if d.numel()), default=0.0)
    figures: dict[str, Any] = {
        "max_abs_err": max_abs,
        "rel_err": rel,
        "rel_limit": limit,
        "reference_rel_err": ref_rel,
    }
    if rel != rel or max_abs != max_abs or rel == float("inf"):
        return verdict("finite: the output holds NaN or Inf", **figures)
    over, worst = 0, None
    for i, (d, w) in enumerate(zip(diffs, wd, strict=True)):
        if not d.numel():
            continue
        rms = float(w.pow(2).mean().sqrt())
        if calibrated:
            r_max = float(r_diffs[i].abs().max())
            spread = max(REFERENCE_MULTIPLE * r_max, ELEMENT_SPREAD * FP32_FLOOR * rms)
        else:
            spread = ELEMENT_SPREAD * limit * rms
        bound = atol + spread + limit * w.abs()
        excess = d.abs() / bound
        n = int((excess > 1).sum())
        if n:
            over += n
            j = int(excess.argmax())
            if worst is None or float(excess.flatten()[j]) > worst[0]:
                worst = (
                    float(excess.flatten()[j]),
                    i,
                    j,
                    float(d.flatten()[j]),
                    float(bound.flatten()[j]),
                )
    figures["elements_over"] = over
    if rel > limit:
        how = (
            f" ({REFERENCE_MULTIPLE:g}x eager's own {label} error {ref_rel:.2e}, capped at rtol "
            f"{rtol:.1e})"
            if ref_rel is not None
            else f" (rtol for {label})"
        )
        return verdict(f"relative error {rel:.2e} > limit {limit:.2e}{how}", **figures)
    if worst is not None:
        _, at, j, off, allowed = worst
        total = sum(w.numel() for w in w_list)
        return verdict(
            f"elementwise: {over} of {total} elements past atol + limit*|ref| (worst: output "
            f"{at}, element {j}, off by {abs(off):.3g} where {allowed:.3g} is allowed)",
            **figures,
        )
    return verdict(None, **figures)


def _rel(diffs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    num = sum(float(d.pow(2).sum()) for d in diffs)
    den = sum(float(w.pow(2).sum()) for w in refs)
    return float((num**0.5) / max(den**0.5, 1e-30))


def same_precision(
    model: torch.nn.Module, inputs: Sequence[Any], dtype: str | None, want: Any
) -> Any:
    """Eager ``model`` at the compute dtype ``dtype`` (bf16 / fp16) on ``inputs``, in the fp32
    output's dtype: the error this precision has on this model, which bounds a backend that
    computes in it (:func:`check_numerics`). ``want`` is the fp32 output on ``inputs``.

    Autocast around the fp32 model: matmuls and convolutions in ``dtype``, reductions,
    normalizations and residual sums in fp32. That is the error a compiled low-precision
    model shows too: Inductor keeps a fused kernel's intermediates in fp32 and does not round
    them to the cast's dtype (``emulate_precision_casts`` is off), so a residual stream that
    the model cast to bf16 stays fp32 inside its kernels, where eager on the cast model would
    round it. Where autocast fails (an op without a kernel in ``dtype``), the model and its
    inputs cast to ``dtype``. None for any other dtype, or where neither runs."""
    if dtype not in LOW_PRECISION:
        return None
    low = getattr(torch, dtype)
    want = flatten_tensors(want)
    device = next((t.device.type for t in want), "cpu")
    found: list[torch.Tensor] = []
    with contextlib.suppress(Exception), torch.autocast(device, dtype=low):
        found = [t.detach().clone() for t in flatten_tensors(model(*inputs))]
    if len(found) != len(want):
        with contextlib.suppress(Exception):
            cast = copy.deepcopy(model).to(low)
            args = [t.to(low) if t.is_floating_point() else t for t in inputs]
            found = [t.detach().clone() for t in flatten_tensors(cast(*args))]
            del cast
    if len(found) != len(want) or any(f.shape != w.shape for f, w in zip(found, want, strict=True)):
        return None
    return [f.to(w.dtype) for f, w in zip(found, want, strict=True)]


class GateCheck:
    """The validate stage's numerical check (:func:`judge`'s ``equivalent``), set up once for
    ``model`` on the fresh inputs of ``seeds`` and run on one candidate (:func:`judge`) or many
    in its process (measured selection's rungs): the worst seed decides. Selection holds each
    rung to the gate's own inputs and bounds, so a plan it keeps is one the gate passes; a plan
    near its limit checked on other inputs may not be (docs/design-notes.md#the-gates-inputs)."""

    def __init__(
        self,
        model: Callable[..., Any],
        template: tuple[torch.Tensor, ...],
        seeds: Sequence[int] = SEEDS,
    ) -> None:
        self.model = model
        self.inputs = [fresh_inputs(template, seed) for seed in seeds]
        with torch.no_grad():
            self.wants = [_clone(model(*x)) for x in self.inputs]
        self._same: dict[str, list[Any]] = {}

    def outputs(self, candidate: Callable[..., Any]) -> list[list[torch.Tensor]]:
        """``candidate`` on each seed's inputs, each output cloned at once (a CUDA-graphed
        model's next replay overwrites the last)."""
        with torch.no_grad():
            return [_clone(candidate(*x)) for x in self.inputs]

    def __call__(
        self, got: Sequence[Any], *, dtype: str | None, rtol: float, atol: float, calibrate: bool
    ) -> Numerics:
        """``got`` (:meth:`outputs`) against eager's fp32 outputs, calibrated by eager at
        ``dtype`` where ``calibrate`` and the model is a module, as :func:`judge` does."""
        refs: list[Any] = [None] * len(self.inputs)
        if calibrate and isinstance(self.model, torch.nn.Module) and dtype is not None:
            if dtype not in self._same:
                with torch.no_grad():
                    self._same[dtype] = [
                        same_precision(self.model, x, dtype, want)
                        for x, want in zip(self.inputs, self.wants, strict=True)
                    ]
            refs = self._same[dtype]
        return worst_of(
            [
                check_numerics(want, out, dtype=dtype, rtol=rtol, atol=atol, reference=ref)
                for want, out, ref in zip(self.wants, got, refs, strict=True)
            ]
        )


def _clone(value: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in flatten_tensors(value)]


@dataclass
class CandidateOutputs:
    """What a candidate computed on the fresh inputs of ``seeds``, and on the first seed's
    again after the others: all the checks need of it. It can be computed in the process that
    imports the generated file and judged in one that never did (``save`` / ``load``)."""

    seeds: list[int]
    outputs: list[list[torch.Tensor]]
    again: list[torch.Tensor]

    def save(self, path: Path) -> None:
        """To ``path`` (tensors on the CPU, each one's device recorded), atomically."""
        devices = [[t.device.type for t in out] for out in self.outputs]
        data = {
            "seeds": self.seeds,
            "outputs": [[t.cpu() for t in out] for out in self.outputs],
            "again": [t.cpu() for t in self.again],
            "devices": devices,
            "again_devices": [t.device.type for t in self.again],
        }
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(data, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> CandidateOutputs:
        """Read back with tensors only (``weights_only``), each on the device it came from."""
        data = torch.load(path, weights_only=True)
        outputs = [
            [t.to(d) for t, d in zip(out, devs, strict=True)]
            for out, devs in zip(data["outputs"], data["devices"], strict=True)
        ]
        again = [t.to(d) for t, d in zip(data["again"], data["again_devices"], strict=True)]
        return cls(seeds=[int(s) for s in data["seeds"]], outputs=outputs, again=again)


def run_candidate(
    candidate: Callable[..., Any], template: tuple[torch.Tensor, ...], seeds: Sequence[int]
) -> CandidateOutputs:
    """``candidate`` on the fresh inputs of each seed, then on the first seed's again."""
    with torch.no_grad():
        outputs = [_clone(candidate(*fresh_inputs(template, seed))) for seed in seeds]
        again = _clone(candidate(*fresh_inputs(template, seeds[0])))
    return CandidateOutputs(seeds=list(seeds), outputs=outputs, again=again)


def anti_cheat_checks(
    baseline: Callable[..., Any],
    candidate: Callable[..., Any],
    template: tuple[torch.Tensor, ...],
    *,
    dtype: str | None,
    rtol: float,
    atol: float,
    seeds: Sequence[int] = SEEDS,
    calibrate: bool = True,
) -> tuple[Numerics, dict[str, StepResult]]:
    """:func:`judge` of ``candidate``'s outputs, in this process."""
    got = run_candidate(candidate, template, seeds)
    return judge(baseline, template, got, dtype=dtype, rtol=rtol, atol=atol, calibrate=calibrate)


def judge(
    baseline: Callable[..., Any],
    template: tuple[torch.Tensor, ...],
    got: CandidateOutputs,
    *,
    dtype: str | None,
    rtol: float,
    atol: float,
    calibrate: bool = True,
) -> tuple[Numerics, dict[str, StepResult]]:
    """Numerics over the candidate's seeds (:func:`check_numerics` against ``baseline`` on the
    same fresh inputs, calibrated by eager at ``dtype`` where ``calibrate`` and ``baseline``
    is a module) plus the anti-cheating checks (docs/how-it-works.md#the-validator); the worst
    seed is reported."""
    checks: dict[str, StepResult] = {}
    outs, seeds = got.outputs, got.seeds
    equivalence = GateCheck(baseline, template, seeds)
    worst = equivalence(outs, dtype=dtype, rtol=rtol, atol=atol, calibrate=calibrate)
    finite = all(bool(torch.isfinite(t).all()) for o in outs for t in o if t.is_floating_point())
    checks["finite"] = StepResult(
        status="pass" if finite else "fail",
        detail="no NaN/Inf in any output" if finite else "the output contains NaN or Inf",
    )
    constant = all(t.numel() > 1 and bool((t == t.flatten()[0]).all()) for o in outs for t in o)
    checks["not_constant"] = StepResult(
        status="fail" if constant else "pass",
        detail="every output element has the same value" if constant else "output values vary",
    )
    same = len(outs) > 1 and all(
        len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        for a, b in itertools.pairwise(outs)
    )
    checks["depends_on_input"] = StepResult(
        status="fail" if same else "pass",
        detail=f"identical output for {len(outs)} different inputs (seeds {list(seeds)})"
        if same
        else f"outputs differ across seeds {list(seeds)}",
    )
    # Stateless: the first seed's input again, after the others, gives its first output.
    repeat = check_numerics(outs[0], got.again, dtype=dtype, rtol=rtol, atol=atol)
    checks["stateless"] = StepResult(
        status="pass" if repeat.ok else "fail",
        detail="the same input gives the same output after other calls"
        if repeat.ok
        else f"calling again with seed {seeds[0]}'s input gave a different output "
        f"({repeat.failed}): state is carried between calls",
    )
    checks["equivalent"] = StepResult(status="pass" if worst.ok else "fail", detail=describe(worst))
    return worst, checks


def worst_of(per_seed: Sequence[Numerics]) -> Numerics:
    """The comparison that decides over several inputs: a failed one first, else the one
    nearest its relative limit."""
    return max(per_seed, key=lambda n: (not n.ok, n.rel_err / (n.rel_limit or n.rtol)))


def describe(n: Numerics) -> str:
    """One line on a comparison: the failed check and its figures, or the margins it passed by."""
    if n.failed:
        return n.failed
    limit = n.rel_limit if n.rel_limit is not None else n.rtol
    by = (
        f", eager's own {n.dtype} error {n.reference_rel_err:.2e}"
        if n.reference_rel_err is not None
        else ""
    )
    return (
        f"relative error {n.rel_err:.2e} (max abs {n.max_abs_err:.2e}) within limit "
        f"{limit:.2e} for {n.dtype}{by}, every element within atol + limit*|ref|"
    )


def check_llm_pass(
    pid: str,
    path: Path,
    load_baseline: Callable[[], Any],
    overrides: Mapping[str, Any] | None = None,
) -> PassStatus:
    """Stage 3 for one LLM-written pass (``apply(gm, example_inputs) -> int``) of a type the
    library lacks: import it, run it on the baseline's Dynamo graph alone (no Inductor, no
    other pass) and check the result against a separate eager copy (``load_baseline()`` builds
    each, seeded) with ``anti_cheat_checks`` at the baseline dtype. The code is untrusted: any
    failure of its own is its verdict, never an error of the stage."""
    from pytest_opprof.tolerances import tolerance_for

    shown = f"{path.parent.name}/{path.name}"

    def failed(why: str) -> PassStatus:
        return PassStatus(name=pid, status="FAILED", detail=f"{why[:400]}; {shown} not run further")

    try:
        spec = importlib.util.spec_from_file_location(f"opprof_llm_{abs(hash(pid))}", path)
        if spec is None or spec.loader is None:
            return failed("cannot be imported")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        return failed(f"import failed: {type(exc).__name__}: {exc}")
    apply = getattr(module, "apply", None)
    if not callable(apply):
        return failed("defines no apply(gm, example_inputs)")
    counts: list[int] = []
    errors: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        try:
            found = apply(gm, example_inputs)
            gm.graph.lint()
            gm.recompile()
            counts.append(int(getattr(found, "matches", found) or 0))
        except (Exception, SystemExit) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = load_baseline().model
    torch.manual_seed(0)
    base = load_baseline()
    fn = torch.compile(model, backend=backend)
    try:
        with torch.no_grad():
            fn(*base.inputs)
    except (Exception, SystemExit) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    if errors:
        return failed(f"apply() failed: {errors[0].splitlines()[0]}")
    applied = sum(counts)
    if not applied:
        return PassStatus(
            name=pid, status="NOT_APPLIED", detail=f"apply() changed no site ({shown})"
        )
    rtol, atol = tolerance_for(None, dict(overrides or {}))
    _, checks = anti_cheat_checks(base.model, fn, base.inputs, dtype=None, rtol=rtol, atol=atol)
    bad = [f"{k}: {c.detail}" for k, c in checks.items() if c.status == "fail"]
    if bad:
        return PassStatus(name=pid, status="FAILED", detail="; ".join(bad)[:500], matches=applied)
    return PassStatus(
        name=pid,
        status="APPLIED",
        matches=applied,
        detail=f"applied at {applied} site(s), {checks['equivalent'].detail}, and passed "
        f"every check; not part of the backend: review {shown} before adding it as a pass",
    )
