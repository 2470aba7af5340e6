"""Stage 3: numerical equivalence and the checks that a backend cannot fool.

The first steps (syntax, import, registration, the generated tests) are cheap and run in order;
the last one compares the optimized workload with the baseline on fresh inputs of several seeds
and checks that the output is finite, not constant, depends on the input, and carries no state
from one call to the next (a cached or memoised output fails it).

LLM-written passes of types the library lacks get the same checks on their own
(``check_llm_pass``), outside the backend.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pytest_opprof.schema import Numerics, PassStatus, StepResult
from pytest_opprof.workload import flatten_tensors, fresh_inputs

SEEDS: tuple[int, ...] = (0, 1, 2)


def compare(want: Any, got: Any, *, dtype: str | None, rtol: float, atol: float) -> Numerics:
    """Relative L2 error over all output tensors (and the largest absolute error)."""
    w_list, g_list = flatten_tensors(want), flatten_tensors(got)
    mismatch = Numerics(
        max_abs_err=float("inf"),
        rel_err=float("inf"),
        rtol=rtol,
        atol=atol,
        dtype=dtype or "float32",
        ok=False,
    )
    if len(w_list) != len(g_list):
        return mismatch
    max_abs = 0.0
    num = den = 0.0
    for w, g in zip(w_list, g_list, strict=True):
        if w.shape != g.shape:
            return mismatch
        wd, gd = w.detach().double(), g.detach().double()
        diff = gd - wd
        max_abs = max(max_abs, float(diff.abs().max()) if diff.numel() else 0.0)
        num += float(diff.pow(2).sum())
        den += float(wd.pow(2).sum())
    rel = (num**0.5) / max(den**0.5, 1e-30)
    finite = rel == rel and max_abs == max_abs
    ok = finite and (rel <= rtol or max_abs <= atol)
    return Numerics(
        max_abs_err=max_abs, rel_err=rel, rtol=rtol, atol=atol, dtype=dtype or "float32", ok=ok
    )


def _clone(value: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in flatten_tensors(value)]


def anti_cheat_checks(
    baseline: Callable[..., Any],
    candidate: Callable[..., Any],
    template: tuple[torch.Tensor, ...],
    *,
    dtype: str | None,
    rtol: float,
    atol: float,
    seeds: Sequence[int] = SEEDS,
) -> tuple[Numerics, dict[str, StepResult]]:
    """Numerics over several seeds plus the checks of DESIGN §2.4; the worst seed is reported."""
    checks: dict[str, StepResult] = {}
    per_seed: list[Numerics] = []
    outs: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for seed in seeds:
            inputs = fresh_inputs(template, seed)
            want = _clone(baseline(*inputs))
            got = _clone(candidate(*inputs))
            per_seed.append(compare(want, got, dtype=dtype, rtol=rtol, atol=atol))
            outs.append(got)
        worst = max(per_seed, key=lambda n: (not n.ok, n.rel_err))
        finite = all(
            bool(torch.isfinite(t).all()) for o in outs for t in o if t.is_floating_point()
        )
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
        again = _clone(candidate(*fresh_inputs(template, seeds[0])))
        repeat = compare(outs[0], again, dtype=dtype, rtol=rtol, atol=atol)
        checks["stateless"] = StepResult(
            status="pass" if repeat.ok else "fail",
            detail="the same input gives the same output after other calls"
            if repeat.ok
            else f"calling again with seed {seeds[0]}'s input gave a different output "
            f"(relative error {repeat.rel_err:.2e}): state is carried between calls",
        )
    checks["equivalent"] = StepResult(
        status="pass" if worst.ok else "fail",
        detail=f"relative error {worst.rel_err:.2e} (max abs {worst.max_abs_err:.2e}) against "
        f"tolerance {worst.rtol:.1e} for {worst.dtype}",
    )
    return worst, checks


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
