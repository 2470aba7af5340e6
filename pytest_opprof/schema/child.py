"""What a stage process is given and what it answers when user code broke: ``ChildSpec``
(``python -m pytest_opprof.runner SPEC.json``) and ``ChildFailure``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field

from pytest_opprof.schema.base import Model


class ChildSpec(Model):
    """What a stage process is asked to do (``python -m pytest_opprof.runner SPEC.json``): the
    task, the workload, the options, and each task's own inputs. Written by the parent
    (``WorkloadRun.run_child``), read by the child's bootstrap; unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")

    task: str
    workload: str
    out_dir: str = ""
    options: dict[str, Any] = Field(default_factory=dict)
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="the workload's OPPROF and the timing settings"
    )
    extra_passes: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="a record of the user passes (loaded by environment)"
    )
    generated: Path | None = Field(default=None, description="the generated file under test")
    sha256: str | None = Field(
        default=None, description="the generated file's validated hash: no other bytes are run"
    )
    dtype: str | None = Field(default=None, description="the compute dtype numerics are held to")
    result: Path | None = Field(default=None, description="where the task writes its answer")
    outputs: Path | None = Field(default=None, description="the candidate's outputs (validate)")
    tests_log: Path | None = None
    passes: list[dict[str, str]] = Field(
        default_factory=list, description="LLM-written passes to check: proposal id and file"
    )
    shares_cpus: bool = False
    compile_pool: bool = Field(
        default=False,
        description="a process sharing its CPUs that compiles graphs no cache holds (selection "
        "and the stock task side by side): it keeps Inductor's pool of compile workers, "
        "started inside the siblings' compile lock",
    )
    siblings_lock: str | None = None
    stock_done: str | None = Field(
        default=None,
        description="selection's: the file its parent creates once the stock task, run beside "
        "it, has ended; selection waits for it before trying the recipe that task kept",
    )
    stock_warm_done: str | None = Field(
        default=None,
        description="the stock task's: the file its parent creates once the stock warmer, run "
        "beside it, has ended; the stock task waits for it before building the recipe the "
        "warmer compiled, which Inductor's FX graph cache then answers",
    )
    rung_warmer: str | None = Field(
        default=None,
        description="selection's and the rung warmer's: the folder through which selection "
        "names the plan it will likely build next, the warmer compiles it ahead, and "
        "selection waits for that compile before its own build, which Inductor's FX graph "
        "cache then answers (stages.rung_warmer)",
    )
    stock_rung_only: bool = Field(
        default=False,
        description="selection's, again in a fresh process where its first died timing the "
        "stock recipe: the ladder's selection read back, its plan built again, and only the "
        "stock rung tried against it",
    )
    resume_ladder: str | None = Field(
        default=None,
        description="selection's, in a fresh process where the one before died building or "
        "timing a rung: why it died; the ladder's progress is read back, that rung dropped, "
        "the plan so far built again, and the ladder climbed on from the next rung",
    )
    gpu_lock: str | None = Field(
        default=None,
        description="counters_target's: the GPU's lock file, which it joins only for its GPU "
        "work (its parent, the capture, holds nothing of it meanwhile)",
    )
    counters_beside: bool = Field(
        default=False,
        description="the capture's: leave the counters pass to the ``counters`` task, which "
        "its parent runs beside the later stages; the profile says the counters are pending",
    )
    gate: str | None = Field(
        default=None,
        description="the recapture's, started beside validation: a file it waits for before "
        "timing, which holds the sha256 validation passed (empty where it did not)",
    )
    profile_name: str = "profile.json"
    timeline_iters: int = 3
    counters_labels: list[str] = Field(default_factory=list)
    counters_label: str = "eager"
    counters_warmup: int = 3

    def need(self, name: str) -> Path:
        """The path input ``name`` of this task, which its parent must have given."""
        value = getattr(self, name)
        if not isinstance(value, Path):
            raise TypeError(f"the spec of task {self.task!r} has no {name}: a bug of the parent")
        return value


class ChildFailure(Model):
    """What the runner writes when user code broke: read by the parent as one message."""

    kind: str
    message: str
