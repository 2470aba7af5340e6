"""Stage 3, validate: the six steps of docs/how-it-works.md#the-validator on the generated
file. Steps 2 to 5 run in a child that imports the file (``task_validate``) and saves its
outputs; step 6 judges them in a child that never imports it (``task_validate_numerics``), with
the checks of ``pytest_opprof.numerics``. Where a process more fits (``tests_beside``), step 4,
the generated tests, runs in a third child beside the other two (``task_validate_tests``). The
report records the sha256 of the file it validated.
"""

from __future__ import annotations

import contextlib
import json
import os
import py_compile
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pytest_opprof.errors import ArtifactError, OpprofError, StageError
from pytest_opprof.pipeline import WorkloadRun, file_sha256
from pytest_opprof.schema import (
    VALIDATION_STEPS,
    BackendSelection,
    ChildSpec,
    Numerics,
    Optimizations,
    PassStatus,
    Profile,
    StepResult,
    ValidationReport,
    read_artifact,
    write_artifact,
    write_text_atomic,
)
from pytest_opprof.stages import common, recapture

NAME = "validate"


def validate_file(run: WorkloadRun, generated: Path) -> ValidationReport:
    """The six validation steps (docs/how-it-works.md#the-validator); the first failure
    blocks the rest. Steps 2 to 5 run in a child that imports the file and saves its outputs;
    step 6 judges them in another child that never imports it
    (``runner.task_validate_numerics``). Where ``tests_beside``, step 4 runs in a third child
    beside both (``task_validate_tests``): the report is the one the steps in order give, a
    step after a failed one reported as blocked by it even where it ran beside."""
    steps: dict[str, StepResult] = {}
    extra: dict[str, Any] = {}
    digest = file_sha256(generated)
    dtype = None
    sel_path = run.profiler_output / "backend_selection.json"
    if sel_path.exists():
        selection = read_artifact(sel_path, BackendSelection)
        # the dtype whose tolerance selection held the plan to (TF32 for an fp32 plan on TF32
        # tensor cores), as the generated file's own tests are
        dtype = selection.numerics_dtype or selection.plan.dtype

    def blocked_after(failed: str) -> None:
        later = VALIDATION_STEPS[VALIDATION_STEPS.index(failed) + 1 :] if failed in steps else ()
        for name in VALIDATION_STEPS:
            if name in later or name not in steps:
                steps[name] = StepResult(status="skipped", detail=f"blocked by {failed}")
        if "smoke" in later:  # what ran beside the failed step is not the file's record
            extra.clear()

    try:
        with tempfile.TemporaryDirectory() as tmp:
            py_compile.compile(str(generated), doraise=True, cfile=str(Path(tmp) / "x.pyc"))
        steps["syntax"] = StepResult(status="pass", detail="py_compile accepted the file")
    except py_compile.PyCompileError as exc:
        steps["syntax"] = StepResult(status="fail", detail=str(exc.msg).strip())
    except FileNotFoundError:
        steps["syntax"] = StepResult(
            status="fail", detail=f"{generated} does not exist; re-run the backend stage"
        )
    if steps["syntax"].status == "pass":
        with tempfile.TemporaryDirectory() as tmp:
            result, outputs = Path(tmp) / "result.json", Path(tmp) / "outputs.pt"
            tests_log = str((run.profiler_output / "generated_tests.log").resolve())
            tests = Path(tmp) / "tests.json" if tests_beside(run) else None
            with _tests_child(run, generated, tests, tests_log) as tests_done:
                run.run_child(
                    "validate",
                    "validate",
                    generated=str(generated.resolve()),
                    result=str(result),
                    outputs=str(outputs),
                    tests_log=None if tests is not None else tests_log,
                    dtype=dtype,
                )
                data = json.loads(result.read_text())
                steps.update({k: StepResult(**v) for k, v in data["steps"].items()})
                extra.update({k: v for k, v in data.items() if k != "steps"})
                if outputs.exists():
                    # judged where the file under test was never imported
                    run.run_child(
                        "validate_numerics",
                        "validate",
                        result=str(result),
                        outputs=str(outputs),
                        dtype=dtype,
                    )
                    data = json.loads(result.read_text())
                    steps.update({k: StepResult(**v) for k, v in data["steps"].items()})
                    extra.update({k: v for k, v in data.items() if k != "steps"})
            if tests is not None and tests_done is not None:
                tests_done.result()  # the child's failure to run is the stage's, as in step 2's
                steps["tests"] = StepResult(**json.loads(tests.read_text())["steps"]["tests"])
    llm_passes = _validate_llm_passes(run, dtype) if steps["syntax"].status == "pass" else []
    if digest and file_sha256(generated) != digest:
        steps["syntax"] = StepResult(
            status="fail", detail=f"{generated.name} changed while it was validated; run again"
        )
    failed = next((n for n in VALIDATION_STEPS if n in steps and steps[n].status == "fail"), None)
    blocked_after(failed or "nothing")
    ordered = {n: steps[n] for n in VALIDATION_STEPS}
    message = ""
    if failed:
        number = VALIDATION_STEPS.index(failed) + 1
        message = f"BLOCKED — fix step {number} ({failed}): {steps[failed].detail}"
    return ValidationReport(
        file=generated.name,
        sha256=digest,
        backend=f"opprof_{run.spec.stem}",
        steps=ordered,
        passes=[PassStatus(**p) for p in extra.get("passes", [])],
        numerics=Numerics(**extra["numerics"]) if "numerics" in extra else None,
        checks={k: StepResult(**v) for k, v in extra.get("checks", {}).items()},
        overall="BLOCKED" if failed else "READY_FOR_PROFILING",
        message=message,
        llm_passes=llm_passes,
    )


def tests_beside(run: WorkloadRun) -> bool:
    """Whether step 4, the generated tests, runs in a process of its own beside the smoke run
    and the judge: on the CPU, and on a GPU where the capture's peak memory says one process
    more fits beside the most a workload runs at validation (the recapture's timing processes
    started beside it, validation's, the counters pass; ``common.side_by_side``). The tests
    compile the model as the smoke run does (the FX graph cache answers one of the two), and
    one after the other they made most of a validation's time
    (docs/design-notes.md#the-generated-tests-run-beside)."""
    profile = run.out_dir / "profile.json"
    if not profile.is_file():
        return False
    try:
        meta = read_artifact(profile, Profile).capture_metadata
    except ArtifactError:
        return False  # the serial steps say what is wrong where it matters
    if meta.device_type != "cuda":
        return True
    return common.side_by_side(meta, common.timing_processes(run, meta.device_type) + 3)


@contextlib.contextmanager
def _tests_child(
    run: WorkloadRun, generated: Path, result: Path | None, log: str
) -> Iterator[Future[None] | None]:
    """Step 4 in its own process beside the block (``task_validate_tests``), its answer in
    ``result``; nothing where ``result`` is None (the tests run in ``task_validate``)."""
    if result is None:
        yield None
        return

    def tests() -> None:
        run.run_child(
            "validate_tests",
            "validate",
            generated=str(generated.resolve()),
            result=str(result),
            tests_log=log,
        )

    with common.beside(tests) as done:
        yield done


def _validate_llm_passes(run: WorkloadRun, dtype: str | None) -> list[PassStatus]:
    """Stage 3 for LLM-written pass code (``optimizations.json`` proposals with a
    ``pass_file``): each runs in a child process on the baseline's Dynamo graph and is checked
    against eager like the backend. It never enters the backend; the report says what it did."""
    opt_path = run.out_dir / "optimizations.json"
    if not opt_path.exists():
        return []
    proposals = read_artifact(opt_path, Optimizations).proposals
    files = [
        {"id": p.id, "file": str((run.out_dir / str(p.params["pass_file"])).resolve())}
        for p in proposals
        if p.params.get("pass_file") and p.params.get("implemented") is False
    ]
    if not files:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        try:
            run.run_child(
                "validate_llm_passes", "validate", passes=files, result=str(result), dtype=dtype
            )
            data = json.loads(result.read_text())
        except (OpprofError, OSError, ValueError) as exc:
            detail = f"the check itself did not finish: {str(exc).splitlines()[0][:300]}"
            return [PassStatus(name=f["id"], status="FAILED", detail=detail) for f in files]
    return [PassStatus(**p) for p in data["llm_passes"]]


def run(run: WorkloadRun) -> str:
    ahead = recapture.start_ahead(run)  # compiling beside the validation, timing after it
    report = None
    try:
        report = validate_file(run, run.generated)
        write_artifact(run.profiler_output / "validation_report.json", report)
    finally:
        if ahead is not None:
            ahead.validation_ended(report)
    if report.overall == "BLOCKED":
        raise StageError(f"{run.generated.name}: {report.message}")
    n = report.numerics
    return "READY_FOR_PROFILING" + (f" (relative error {n.rel_err:.2e})" if n else "")


def edited_since_validation(run: WorkloadRun) -> bool:
    """The generated file exists and is not the one its validation report checked."""
    path = run.profiler_output / "validation_report.json"
    if not path.exists() or not run.generated.exists():
        return False
    try:
        report = read_artifact(path, ValidationReport)
    except ArtifactError:
        return False
    return report.sha256 != file_sha256(run.generated)


def task_validate(spec: ChildSpec) -> None:
    """Validation steps 2 to 5 in one process, so torch is imported once, not three times
    (docs/design-notes.md#importing-torch-once): the generated file imports and registers
    its backend, its generated tests pass (run here by ``pytest.main``, where the spec names
    their log; else a process beside runs them, ``task_validate_tests``), a smoke run, and the
    candidate's outputs for step 6. The first failure ends the task; the parent marks the
    later steps as blocked."""
    common.setup_torch()
    steps: dict[str, Any] = {}
    from pytest_opprof.capture.system import resolve_device

    device = resolve_device(common.options(spec).device)
    module = _validate_import(spec, steps)
    if module is None:
        _write_steps(spec, steps)
        return
    common.compile_off_gpu(device)
    if spec.tests_log is not None:
        steps["tests"] = _generated_tests(spec)
        common.phase("generated tests")
        common.step_done(device)
        if steps["tests"].status == "fail":
            _write_steps(spec, steps)
            return
        import torch

        torch._dynamo.reset()  # the tests' compiled graphs are not the smoke run's
        common.compile_off_gpu(device)  # the reset cleared Dynamo's callbacks
        # The tests imported the file again and re-registered its backend, which now records
        # into that copy's PASS_RESULTS: import it once more, so what the smoke run applies
        # is ours.
        module = common.import_generated(spec.need("generated"))
    _validate_run(spec, module, steps)


def task_validate_tests(spec: ChildSpec) -> None:
    """Validation step 4 in a process of its own, beside ``task_validate``'s smoke run and
    the judge: the generated tests by ``pytest.main``, their step written to ``spec.result``."""
    from pytest_opprof.capture.system import resolve_device

    common.setup_torch()
    device = resolve_device(common.options(spec).device)
    common.compile_off_gpu(device)
    steps = {"tests": _generated_tests(spec)}
    common.phase("generated tests")
    _write_steps(spec, steps)


def _validate_import(spec: ChildSpec, steps: dict[str, Any]) -> Any:
    """Steps 2 and 3: import, registration. Returns the module, or None after a failure."""
    import torch

    from pytest_opprof.schema import StepResult

    path = spec.need("generated")
    try:
        module = common.import_generated(path)
        steps["import"] = StepResult(status="pass", detail=f"imported {path.name}")
    except BaseException as exc:
        steps["import"] = StepResult(status="fail", detail=f"{type(exc).__name__}: {exc}")
        return None
    name = getattr(module, "BACKEND", None)
    listed = torch._dynamo.list_backends(exclude_tags=())
    ok = isinstance(name, str) and name in listed
    steps["registration"] = StepResult(
        status="pass" if ok else "fail",
        detail=f"backend {name!r} is registered"
        if ok
        else f"backend {name!r} is not in torch._dynamo.list_backends(); the file must call "
        "runtime.register_backend(BACKEND, ...) at import",
    )
    return module if ok else None


def _generated_tests(spec: ChildSpec) -> Any:
    """Step 4: ``test_<stem>_optimized.py`` by ``pytest.main`` in this process, its output in
    ``generated_tests.log``; a failure names the failing tests."""
    import io

    import pytest

    from pytest_opprof.schema import StepResult, write_text_atomic

    generated = spec.need("generated")
    test_file = generated.with_name(f"test_{generated.name}")
    log = spec.need("tests_log")
    if not test_file.exists():
        return StepResult(status="fail", detail=f"{test_file.name} is missing; re-run backend")
    args = [
        str(test_file),
        "-q",
        "-rf",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:opprof",
        "--rootdir",
        str(test_file.parent),
        "-c",
        os.devnull,
        # the user's conftests above the output folder are not the generated tests' (and,
        # with the plugin off, their pytest_opprof_* hooks would be unknown hooks)
        "--confcutdir",
        str(test_file.parent),
    ]
    os.environ["COLUMNS"] = "400"  # untruncated short summary lines
    out = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(test_file.parent)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = int(pytest.main(args))
    finally:
        os.chdir(cwd)
    text = out.getvalue()
    write_text_atomic(log, text)
    lines = text.strip().splitlines() or ["no output"]
    if code == 0:
        return StepResult(status="pass", detail=lines[-1].strip("= "))
    # Name the failing checks: pytest's short summary ("FAILED file::test[seed] - reason").
    failed = [line.split("::", 1)[-1] for line in lines if line.startswith("FAILED ")]
    shown = "; ".join(failed[:3]) + (f"; … {len(failed) - 3} more" if len(failed) > 3 else "")
    return StepResult(
        status="fail",
        detail=f"{test_file.name}: {lines[-1].strip('= ')}: {shown} (see {log.name})",
    )


def _write_steps(spec: ChildSpec, steps: dict[str, Any], **extra: Any) -> None:
    payload = {"steps": {k: v.model_dump() for k, v in steps.items()}, **extra}

    write_text_atomic(spec.need("result"), json.dumps(payload, indent=2))


def _validate_run(spec: ChildSpec, module: Any, steps: dict[str, Any]) -> None:
    """Validation step 5, a smoke run (1 warmup, 1 measured call), and the candidate's outputs
    for step 6 (``task_validate_numerics``), saved to ``spec.outputs``."""
    import torch

    from pytest_opprof.backend import runtime
    from pytest_opprof.backend.model_graph import ModelGraph
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.capture.timing import synchronize
    from pytest_opprof.numerics import SEEDS, run_candidate
    from pytest_opprof.schema import PassStatus, StepResult

    opts = common.options(spec)
    device = resolve_device(opts.device)
    try:
        # The file's input serves as the template of the fresh inputs only: the judge draws
        # its own from the workload's, with the same seeds.
        model, x = module.get_model_and_input()
        template = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        fn = runtime.optimized_callable(module, model)
        with torch.no_grad():
            fn(*template)
            synchronize(device)
            t0 = time.perf_counter()
            fn(*template)
            synchronize(device)
        steps["smoke"] = StepResult(
            status="pass",
            detail=(f"1 warmup + 1 measured call ran ({(time.perf_counter() - t0) * 1000:.3f} ms)"),
        )
        common.step_done(device)
    except BaseException as exc:
        steps["smoke"] = StepResult(status="fail", detail=f"{type(exc).__name__}: {exc}"[:500])
        steps["numerics"] = StepResult(status="skipped", detail="blocked by smoke")
        _write_steps(spec, steps)
        return
    # The outputs only: they are judged in a process that never imported this file
    # (task_validate_numerics), which could otherwise patch torch or the checks themselves.
    run_candidate(fn, template, SEEDS).save(spec.need("outputs"))
    common.phase("candidate outputs")
    results = list(getattr(module, "PASS_RESULTS", []))
    passes = [
        PassStatus(name=r.name, status=r.status, detail=r.detail, matches=r.matches)
        for r in results
    ]
    if isinstance(fn, ModelGraph):
        recorded = fn.captured and fn.replays > 0
        passes.append(
            PassStatus(
                name="cuda_graphs-model",
                status="APPLIED" if recorded and not fn.fallbacks else "NOT_APPLIED",
                detail=f"whole-model CUDA graph {'recorded' if fn.captured else 'not recorded'}: "
                f"{fn.replays} replays, {fn.fallbacks} calls ran uncaptured",
                matches=int(recorded),
            )
        )
    _write_steps(spec, steps, passes=[p.model_dump() for p in passes])


def task_validate_numerics(spec: ChildSpec) -> None:
    """Validation step 6 in a process that never imported the file under test: the workload
    loaded here is the reference (seeded as the generated file seeds its copy), the
    candidate's outputs are read from ``spec.outputs`` (tensors only), and the tolerances
    come from the plan's compute dtype and the workload's OPPROF, never from the file."""
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.numerics import CandidateOutputs, calibrated, judge
    from pytest_opprof.schema import StepResult
    from pytest_opprof.tolerances import tolerance_for

    common.setup_torch()
    device = resolve_device(common.options(spec).device)
    reference = common.load_baseline(spec, device)
    got = CandidateOutputs.load(spec.need("outputs"))
    dtype = spec.dtype
    rtol, atol = tolerance_for(dtype, spec.overrides)
    numerics, checks = judge(
        reference.model,
        reference.inputs,
        got,
        dtype=dtype,
        rtol=rtol,
        atol=atol,
        calibrate=calibrated(spec.overrides),
    )
    failed = [k for k, v in checks.items() if v.status == "fail"]
    step = StepResult(
        status="fail" if failed else "pass",
        detail="; ".join(f"{k}: {checks[k].detail}" for k in failed)
        if failed
        else checks["equivalent"].detail,
    )
    _write_steps(
        spec,
        {"numerics": step},
        numerics=numerics.model_dump(),
        checks={k: v.model_dump() for k, v in checks.items()},
    )


def task_validate_llm_passes(spec: ChildSpec) -> None:
    """Stage 3 for LLM-written passes (``spec.passes``: proposal id and file): each is
    imported here, in a child process, run on the baseline's Dynamo graph (no Inductor, no
    other pass) and checked against a separate eager copy of the model with the backend's
    checks at the baseline dtype. None of them enters the generated backend."""
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.numerics import check_llm_pass

    common.setup_torch()
    device = resolve_device(common.options(spec).device)

    def load() -> Any:
        return common.load_baseline(spec, device)

    checked = [
        check_llm_pass(e["id"], Path(e["file"]), load, spec.overrides).model_dump()
        for e in spec.passes
    ]
    write_text_atomic(spec.need("result"), json.dumps({"llm_passes": checked}, indent=2))


TASKS: dict[str, Callable[[ChildSpec], None]] = {
    "validate": task_validate,
    "validate_numerics": task_validate_numerics,
    "validate_tests": task_validate_tests,
    "validate_llm_passes": task_validate_llm_passes,
}
"""The child halves, by the task name a spec carries (``runner`` dispatches them)."""
