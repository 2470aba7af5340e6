"""The stage process's bootstrap: ``python -m pytest_opprof.runner SPEC.json``.

User code (the workload, the generated backend) runs only in these processes, so a crash, a
hang or a CUDA error never takes pytest down. The spec (``schema.ChildSpec``) names the task;
the task is a stage's child half (``pytest_opprof.stages``), which writes its artifacts
atomically. A user's mistake (``OpprofError``) is written to ``failure.json`` beside the spec
and the process exits with ``EXIT_USER_ERROR``; anything else is a bug of ours and keeps its
traceback on stderr.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pytest_opprof import devicelock, forkserver
from pytest_opprof.forkserver import die_with_parent
from pytest_opprof.stages import common

EXIT_USER_ERROR = 3


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pytest_opprof.runner SPEC.json", file=sys.stderr)
        return 2
    spec_path = Path(args[0])
    die_with_parent()
    from pytest_opprof.errors import OpprofError
    from pytest_opprof.schema import ChildFailure, ChildSpec, write_artifact
    from pytest_opprof.stages import TASKS

    spec = ChildSpec.model_validate_json(spec_path.read_text(encoding="utf-8"))
    common.configure(
        shares_cpus=spec.shares_cpus,
        own_cpus=os.environ.get(devicelock.OWN_CPUS_ENV) == "1",
        compile_pool=spec.compile_pool,
    )
    try:
        devicelock.join(note=common.phase, siblings=spec.siblings_lock)
        TASKS[spec.task](spec)
        waited, alone = devicelock.waited_s(), devicelock.alone_s()
        common.phase(
            f"task {spec.task} done"
            + (f", {waited:.1f} s of it waiting for the GPU" * (waited >= 0.05))
            + (f", {alone:.1f} s with the GPU to itself" * (alone >= 0.05))
        )
    except OpprofError as exc:
        write_artifact(
            spec_path.with_name("failure.json"),
            ChildFailure(kind=type(exc).__name__, message=str(exc)),
        )
        return EXIT_USER_ERROR
    except BaseException as exc:
        if _is_oom(exc):
            write_artifact(
                spec_path.with_name("failure.json"),
                ChildFailure(
                    kind="WorkloadError",
                    message=f"{Path(spec.workload).name}: out of GPU memory during "
                    f"{spec.task} ({str(exc).splitlines()[0]}); use a smaller model or "
                    "batch, or free the GPU",
                ),
            )
            return EXIT_USER_ERROR
        raise
    return 0


def _is_oom(exc: BaseException) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return isinstance(exc, torch.cuda.OutOfMemoryError)


def forked(spec_path: str) -> int:
    """``main`` in a child of the fork server (torch already imported there): its stage log
    counts from the fork."""
    common.restart_clock()
    common.phase(f"forked from the fork server of pid {os.getppid()} at {common.wall_clock()}")
    return main([spec_path])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fork-server"]:  # python -m pytest_opprof.runner --fork-server SOCK
        sys.exit(forkserver.serve(sys.argv[2], forked))
    common.phase(f"started at {common.wall_clock()}")
    sys.exit(main())
