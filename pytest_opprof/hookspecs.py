"""Hook specifications of pytest-opprof: the extension API, and its reference documentation.

Implement any of these in a ``conftest.py`` (or a plugin) to add passes and proposal rules, add
sections to the report, change the baseline or the threshold of the gate, or adjust the timing
of a workload, without changing the package. ``conftest_examples/`` has one small, tested
conftest per hook.

A hook implemented in a conftest applies to the workloads under that conftest's folder, as
pytest's own hooks do. The plugin's own behaviour goes through the same hooks: its
implementations of the decision hooks are ``trylast``, so a user's implementation that returns
a value wins, and one that returns ``None`` leaves the decision to the next.

The ``workload`` argument of several hooks is the workload being run (a
``pytest_opprof.pipeline.WorkloadRun``); read its ``name`` (the output folder's name),
``path`` (the workload file), ``out_dir`` (``<out>/<name>/``), ``overrides`` (its ``OPPROF``
dict, validated), ``options`` (the session's options) and ``setting(key)`` (the value of an
option for this workload: its ``OPPROF`` entry, else the session's).

Hooks run in pytest's process, which never imports torch on its own: keep torch imports inside
the modules that define passes (see ``pytest_opprof_register_passes``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_opprof.backend.plan import PassRegistry
    from pytest_opprof.pipeline import StageOutcome, WorkloadRun
    from pytest_opprof.report import WorkloadArtifacts
    from pytest_opprof.schema import (
        FxGraphSummary,
        Optimizations,
        Profile,
        Proposal,
        Timing,
        WorkloadSummary,
    )


@pytest.hookspec
def pytest_opprof_register_passes(registry: PassRegistry) -> None:
    """Add graph passes to the pass library, each under a new transformation type.

    A pass runs in the child processes that build and validate the backend, and in the
    generated ``<stem>_optimized.py``, none of which sees your conftest. So a pass is named by
    where it can be imported from: a module-level function in a module of its own (not the
    conftest), given as the function or as the string ``"module:function"``::

        def pytest_opprof_register_passes(registry):
            registry.add(
                "linear_chain_fold",
                "opprof_linear_fold:apply",  # a string: pytest's process imports no torch
                level="functional",
                description="two linears in a row folded into one",
            )

    ``registry.add(name, apply, *, level, description="", path=None)``:

    - ``name``: the new type, in snake_case; it is the pass name, the proposal type, the log
      tag and the report row. A built-in type cannot be replaced.
    - ``apply``: ``apply(gm, example_inputs) -> PassResult``, as the built-in graph passes
      (``pytest_opprof.passes.base.run_graph_pass`` gives the checks, the log line and the
      never-half-mutated guarantee). A ``pytest_opprof.passes.PassSpec`` is accepted in place
      of ``name, apply, level, description``.
    - ``level``: ``"functional"`` (the Dynamo graph, before ``compile_fx``) or ``"aten"``
      (inside Inductor's inner compile, after AOT decomposition). Inductor settings are not a
      pass: propose ``algorithm_selection`` with ``params={"config_patches": {...}}``.
    - ``path``: the folder the module is imported from; by default the folder where Python
      finds it now (a conftest's folder is on ``sys.path`` under pytest's default import mode).

    The folder is put on the children's ``sys.path`` and the pass registered there before the
    backend is built; the generated file imports and registers it itself. A pass runs only
    when a proposal of its type is kept by measured selection: add the rule that proposes it
    with ``pytest_opprof_propose``. Validation classifies it ``APPLIED`` / ``NOT_APPLIED`` /
    ``FAILED`` from its ``PassResult``, like the built-ins; an exception it raises is a
    ``FAILED`` result.
    """


@pytest.hookspec
def pytest_opprof_propose(
    profile: Profile, graph: FxGraphSummary | None, optimizations: Optimizations
) -> list[Proposal] | None:
    """Return extra proposals for a workload: your own rules, next to the built-in ones.

    Called in the propose stage after the rule engine (and the LLM strategist, when on), with
    ``profile.json``, the FX graph summary (``graph.json``; ``None`` when Dynamo captured
    none) and the proposals so far. Return ``pytest_opprof.schema.Proposal`` objects (or dicts
    that validate as one); every implementation's results are merged, marked
    ``source="hook"``. A proposal whose ``id`` is taken is renumbered; its ``type`` must be a
    built-in type or one registered through ``pytest_opprof_register_passes`` (its
    ``ir_level`` is then set to the pass's level), else it is dropped with a note in
    ``optimizations.json``. The workload's ``OPPROF['skip']`` and ``--opprof-min-confidence``
    apply to hook proposals too; measured selection then keeps a proposal only when it makes
    its variant faster, as for any other.

    Base the evidence on the artifacts (``Evidence(metric=..., value=..., source=...)``, with
    ``source`` naming where in ``profile.json`` / ``graph.json`` the value is): the report
    shows it.
    """


@pytest.hookspec
def pytest_opprof_report_sections(artifacts: WorkloadArtifacts) -> list[tuple[str, str]] | None:
    """Return extra sections for a workload's ``report.md``, as ``(title, markdown)`` pairs.

    ``artifacts`` holds everything the report reads (``profile``, ``optimizations``,
    ``selection``, ``validation``, ``optimized``, ``summary``, ``out_dir``; an artifact is
    ``None`` when its stage did not run). Each section is rendered as ``## title`` followed by
    the markdown, after the built-in analysis sections and before the reproduction commands.
    """


@pytest.hookspec(firstresult=True)
def pytest_opprof_select_baseline(workload: WorkloadRun, timing: Timing) -> str | None:
    """Choose the baseline the gate compares against: ``"eager"`` or ``"compile"``.

    ``timing`` is the timing of the recapture (``profile_optimized.json``): ``variants``
    (``eager``, ``compile``, ``optimized`` and their ``median_ms``, CI, samples), the
    interleaved ``speedups`` and ``compile_seconds``. Return ``None`` to leave the choice to
    the next implementation. The plugin's own (``trylast``) implements
    ``--opprof-baseline`` / ``OPPROF['baseline']``: ``eager``, ``compile``, or ``best`` (the
    faster of the two in this very measurement).
    """


@pytest.hookspec(firstresult=True)
def pytest_opprof_min_speedup(workload: WorkloadRun, min_speedup: float) -> float | None:
    """Choose the speedup the gate demands of a workload.

    ``min_speedup`` is the value from ``--opprof-min-speedup`` / the ini, or the workload's
    ``OPPROF['min_speedup']``. Implemented in a folder's conftest, this sets a threshold for
    every workload under that folder. Return ``None`` to keep the value; the plugin's own
    (``trylast``) implementation returns it unchanged.
    """


@pytest.hookspec(firstresult=True)
def pytest_opprof_timing_settings(
    workload: WorkloadRun, settings: dict[str, int]
) -> dict[str, int] | None:
    """Adjust how a workload is timed: ``warmup_iters``, ``measure_iters`` and ``rounds``.

    ``settings`` holds the values from the options (or the workload's ``OPPROF``). Return a
    dict with the keys to change (the others keep their value), or ``None`` to keep them all;
    the values are checked like the options (``rounds`` ≥ 3). The settings are part of the
    capture stage's cache key, so changing them recomputes the stages that depend on them.
    """


@pytest.hookspec
def pytest_opprof_stage_finished(workload: WorkloadRun, stage: str, outcome: StageOutcome) -> None:
    """A stage of a workload finished: ``stage`` is one of ``capture``, ``propose``,
    ``backend``, ``validate``, ``recapture``, ``report``; ``outcome`` has ``status``
    (``passed`` / ``failed`` / ``error`` / ``skipped``), ``message``, ``seconds`` and ``cached``
    (read back from disk). Called for every stage run in this process, in order."""


@pytest.hookspec
def pytest_opprof_gate_decided(
    workload: WorkloadRun, summary: WorkloadSummary, passed: bool
) -> None:
    """The gate of a workload decided: ``passed`` is its verdict, ``summary`` has the numbers
    (``speedup``, ``ci_low``, ``ci_high``, ``baseline``, ``baseline_ms``, ``optimized_ms``,
    ``passes``, ``message``, ``report``). Not called when an earlier stage blocked the gate
    (``pytest_opprof_stage_finished`` says why). On the CPU fallback, where the gate is not
    enforced, ``passed`` is true unless ``--opprof-gate-on-cpu`` is given."""
