"""report.md of one workload and of the session, on the artifacts in tests/data/report/."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof.backend.selection import timed_rung
from pytest_opprof.options import OPTIONS
from pytest_opprof.report import (
    COMMENT_MARKER,
    WorkloadArtifacts,
    load_workload_artifacts,
    lookups,
    plots,
    render_comment_body,
    render_session_report,
    render_workload_report,
    write_workload_report,
)
from pytest_opprof.report import format as fmt
from pytest_opprof.schema import (
    CPU_NOT_ENFORCED,
    BackendPlan,
    BackendSelection,
    LatencyStats,
    OperatorAggregate,
    PassStatus,
    SessionSummary,
    Speedup,
    VariantResult,
    WaterfallStep,
    WorkloadSummary,
    read_artifact,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "report"
SECTIONS = (
    "## Headline",
    "## Timing",
    "## Hardware context",
    "## Operator summary",
    "## Optimizations",
    "## Implementation notes",
    "## Validation",
    "## Before and after, per operator",
    "## What drove the speedup (per-pass waterfall)",
    "## Estimated vs measured impact",
    "## Remaining opportunities",
    "## Reproduce",
    "## Caveats",
)


def _session() -> SessionSummary:
    return read_artifact(DATA / "session.json", SessionSummary)


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A session output folder holding a copy of the conv_block artifacts; cwd is its parent."""
    shutil.copytree(DATA / "conv_block", tmp_path / "results" / "conv_block")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "results"


@pytest.fixture
def full(out: Path) -> WorkloadArtifacts:
    return load_workload_artifacts(out / "conv_block", _session().workloads[0])


def _unwrap(markdown: str) -> str:
    """The report with its wrapped paragraphs and list items joined back into one line each
    (tables, headings and code left as they are), so a phrase can be found across a wrap."""
    out: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            out.append(line)
            continue
        starts = not line or fenced or line.startswith(("|", "#", "![", "```"))
        starts = starts or re.match(r"\s*(?:[-*]|\d+\.) ", line) is not None
        prev = out[-1] if out else ""
        if line.startswith("> ") and prev.startswith("> "):
            out[-1] += " " + line[2:]
        elif not starts and prev and not prev.startswith(("|", "#", "```", "![")):
            out[-1] += " " + line.strip()
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _render(a: WorkloadArtifacts, **kwargs: Any) -> str:
    return _unwrap(render_workload_report(a, **kwargs))


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def test_every_section_present_in_order(full: WorkloadArtifacts) -> None:
    text = _render(full, plots=False)
    positions = [text.index(heading + "\n") for heading in SECTIONS]
    assert positions == sorted(positions)
    assert text.startswith("# conv_block: 1.39× faster than torch.compile\n")
    assert "Not available" not in text


def test_headline_numbers_come_from_profile_optimized(full: WorkloadArtifacts) -> None:
    text = _render(full, plots=False)
    head = _section(text, "## Headline")
    assert full.optimized is not None
    for s in full.optimized.timing.speedups:
        assert fmt.fmt_speedup(s.ratio, s.ci_low, s.ci_high) in head
    # the verdict: the gate's figure with its CI, above the headline
    verdict = "**passed** · 1.39× (95% CI 1.36–1.42) against torch.compile, 0.254 ms → 0.183 ms"
    assert verdict in text[: text.index("## Headline")]
    assert "fails only when the 95% CI lies wholly below 1.00×" in text[: text.index("## Headline")]
    # against each baseline, the gate's first; at the baseline dtype and with the change, apart
    header = next(line for line in head.splitlines() if line.startswith("| against"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "against",
        "baseline latency",
        "optimized at float32",
        "speedup (95% CI)",
        "optimized, float32 → bfloat16",
        "speedup (95% CI)",
    ]
    variants = full.optimized.timing.variants
    at_dtype = fmt.fmt_ms(variants["optimized_baseline_dtype"].median_ms)
    assert _table(head) == [
        [
            "torch.compile (gate)",
            "0.254 ms",
            at_dtype,
            "1.10× (95% CI 1.08–1.12)",
            "0.183 ms",
            "1.39× (95% CI 1.36–1.42)",
        ],
        [
            "eager",
            "0.264 ms",
            at_dtype,
            "1.14× (95% CI 1.12–1.16)",
            "0.183 ms",
            "1.44× (95% CI 1.41–1.47)",
        ],
    ]
    assert "the backend runs bfloat16 where the model is float32" in head
    assert "Applied in the chosen variant: `P1`, `P2`, `P3`." in head


def test_headline_says_why_the_stock_baseline_asked_for_was_not_measured(
    full: WorkloadArtifacts,
) -> None:
    why = "not measured: w.py: backend did not finish within 810 s and was stopped"
    full.summary = full.summary.model_copy(update={"stock_note": why})
    head = _section(_render(full, plots=False), "## Headline")
    assert f"Stock PyTorch: {why}." in head


def test_headline_falls_back_to_the_recapture(full: WorkloadArtifacts) -> None:
    full.summary = full.summary.model_copy(
        update={"speedup": None, "ci_low": None, "ci_high": None, "baseline": None}
    )
    text = _render(full, plots=False)
    # best resolves to compile (0.254 ms < 0.264 ms in profile_optimized.json)
    assert text.startswith("# conv_block: 1.39× faster than torch.compile\n")
    assert (
        "**passed** · 1.39× (95% CI 1.36–1.42) against torch.compile, 0.254 ms → 0.183 ms" in text
    )


def test_strict_gate_and_threshold_are_stated(full: WorkloadArtifacts) -> None:
    full.strict_gate, full.min_speedup = True, 1.25
    text = _render(full, plots=False)
    assert "Gate: at least 1.25× against `best`" in text
    assert "passes only when the 95% CI lies wholly above 1.25×" in text
    assert "--opprof-min-speedup=1.25 --opprof-strict-gate" in text


def test_hardware_and_operator_numbers_are_traced(full: WorkloadArtifacts) -> None:
    text = _render(full, plots=False)
    hw = _section(text, "## Hardware context")
    for value in (
        "NVIDIA H200 (cuda)",
        "| 132 ",
        "9.0",
        "2.11.0+cu130 / 13.0 / 3.5.0",
        "(16, 3, 64, 64) float32",
        "10 warmup, 15 rounds × 30 calls",
        "collected",
    ):
        assert value in hw, value
    ops = _section(text, "## Operator summary")
    assert full.profile is not None
    eager = full.profile.primary
    top = max(eager.aggregated, key=lambda op: op.gpu_time_us)
    # aggregated[] holds totals over 5 iterations: the report shows them per iteration
    assert lookups.per_iter_divisor(eager) == 5.0
    row = next(line for line in ops.splitlines() if "`aten::cudnn_convolution`" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:7] == [
        "1",
        "`aten::cudnn_convolution`",
        "3",
        "152.4 µs",
        "64.2%",
        "3",
        "tensor-core idle",
    ]
    assert fmt.fmt_us(top.gpu_time_us / 5) == "152.4 µs"
    assert "237.3 µs of device time per iteration over 5 profiled iterations" in ops
    assert "99.5% of that time attributed to operators (99.5% at high confidence)" in ops
    assert "(unattributed kernels)" in ops


def test_optimizations_show_evidence_confidence_and_status(full: WorkloadArtifacts) -> None:
    text = _section(_render(full, plots=False), "## Optimizations")
    assert "| P3   | bn_fold" in text
    assert "APPLIED (folded 3 BatchNorm2d)" in text
    assert "dropped: made nothing faster: 0.1860 ms (CI 0.1841–0.1883) against 0.1830 ms" in text
    assert "`tensor_pipe_active_pct` = `0 %`" in text
    assert "`timelines[0].aggregated[1].gpu_time_us`" in text
    assert "- **Confidence:** medium (source: rules)" in text
    assert "96.5 µs per iteration, 1.52×" in text


def test_status_from_validation_not_applied_and_failed(full: WorkloadArtifacts) -> None:
    assert full.validation is not None
    full.validation.passes = [
        PassStatus(name="bn_fold", status="NOT_APPLIED", detail="Pattern not found"),
        PassStatus(name="memory_layout", status="FAILED", detail="Failed: lint error"),
    ]
    text = _render(full, plots=False)
    opts = _section(text, "## Optimizations")
    assert "NOT_APPLIED (Pattern not found)" in opts
    assert "FAILED (Failed: lint error)" in opts
    # P1 is in the plan but has no pass record: said so, not invented
    assert "in the chosen plan (non-graph change, no pass record)" in opts
    remaining = _section(text, "## Remaining opportunities")
    assert "P3 bn_fold on `aten::cudnn_batch_norm`: NOT_APPLIED" in remaining
    assert "P2 memory_layout" in remaining
    assert "P1 dtype_promotion" not in remaining


def test_implementation_notes_and_validation(full: WorkloadArtifacts) -> None:
    text = _render(full, plots=False)
    notes = _section(text, "## Implementation notes")
    assert "Chosen variant `P3+P1+P2`: dtype bfloat16; channels_last; aten passes bn_fold" in notes
    assert "### Implementation notes: conv_block" in notes  # demoted under the section
    assert "#### Plan" in notes
    assert "# not a heading inside code\n" in notes  # code fences are left alone
    assert "Inductor config triton.cudagraphs=True" in notes
    val = _section(text, "## Validation")
    assert "**READY_FOR_PROFILING**" in val
    assert "max abs error 0.0123, relative error 0.0031 (rtol 0.01, atol 0.01)" in val
    assert re.search(r"\| 3\s+\| registration\s+\| pass", val)


def test_before_after_has_kernel_counts_and_new_overhead(full: WorkloadArtifacts) -> None:
    text = _section(_render(full, plots=False), "## Before and after, per operator")
    assert "Before: the compiled timeline" in text  # the gate's baseline resolved to compile

    def cells(name: str) -> list[str]:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}`"))
        return [c.strip() for c in row.strip("|").split("|")]

    assert cells("aten::convolution")[1:] == ["148.0 µs", "3", "71.2 µs", "3", "-51.9%"]
    assert cells("aten::_to_copy")[1:] == ["—", "—", "1.8 µs", "1", "new overhead"]
    assert cells("aten::_native_batch_norm_legit_no_training")[-1] == "removed"
    assert re.search(r"\*\*device time per iteration\*\*\s+\| 190.2 µs\s+\| 9\s+\| 91.0 µs", text)


def test_kernel_time_set_against_the_gpu_time_with_the_host_hidden(
    full: WorkloadArtifacts,
) -> None:
    assert full.profile is not None and full.optimized is not None
    text = _render(full, plots=False)
    assert "host hidden" not in text  # profiles from before timing.gpu_time_ms: nothing said
    full.profile.timing.gpu_time_ms = {"eager": 0.2, "compile": 0.19}
    full.optimized.timing.gpu_time_ms = {"optimized": 0.1}
    text = _render(full, plots=False)
    operators = _section(text, "## Operator summary")
    eager_us = full.profile.primary.summary.device_time_per_iter_us
    assert (
        "measured 200.0 µs of GPU time per eager call with the host hidden (`timing.gpu_time_ms`)"
        f"; the timeline's kernels add up to {eager_us / 200.0 * 100:.1f}% of it" in operators
    )
    assert "per compiled call with the host hidden" in operators  # compiled -> timing's compile
    after = _section(text, "## Before and after, per operator")
    assert "measured 100.0 µs of GPU time per optimized call" in after
    assert "add up to 91.0% of it" in after  # 91.0 µs of kernels per iteration


def test_before_after_against_eager_when_the_gate_uses_eager(full: WorkloadArtifacts) -> None:
    full.summary = full.summary.model_copy(update={"baseline": "eager"})
    text = _section(_render(full, plots=False), "## Before and after, per operator")
    assert "Before: the eager timeline" in text
    assert "`aten::cudnn_convolution` | 152.4 µs" in text.replace("  ", "").replace(" |", " |")


def test_waterfall_and_estimated_vs_measured(full: WorkloadArtifacts) -> None:
    text = _render(full, plots=False)
    wf = _section(text, "## What drove the speedup (per-pass waterfall)")
    # the selection's step 0 is the reference itself: shown once, as the reference
    assert re.search(r"\| torch.compile \(reference\)\s+\| 0.254 ms\s+\| —\s+\| —\s+\| 1.00×", wf)
    assert "| compile " not in wf
    # a selection before schema 1.4 chained its step latencies from the ratios: marked so
    assert re.search(
        r"\| \+dtype_promotion \(P1\)\s+\| 0.188 ms \(est.\)\s+\| —\s+\| 1.25×\s+\| 1.35×", wf
    )
    assert "written before schema 1.4" in wf
    est = _section(text, "## Estimated vs measured impact")
    # bn_fold: estimated 30.0 µs; measured 0.254 - 0.236 ms = 18.0 µs; ratio 0.60
    assert re.search(
        r"\| P3 bn_fold\s+\| 30.0 µs\s+\| 1.15×\s+\| 18.0 µs\s+\| 1.08×\s+\| 0.60", est
    )
    # dtype_promotion: 0.236 - 0.188 ms = 48.0 µs against 96.5 estimated
    assert re.search(r"\| P1 dtype_promotion .*\| 48.0 µs\s+\| 1.25×\s+\| 0.50", est)
    assert "not measured (dropped: made nothing faster" in est


def test_a_step_that_carried_several_proposals(full: WorkloadArtifacts) -> None:
    assert full.selection is not None
    steps = full.selection.waterfall
    steps[1].step = "+graph (P3, P2)"
    del steps[3]
    est = _section(_render(full, plots=False), "## Estimated vs measured impact")
    # estimated 30.0 + 12.0 = 42.0 µs, 1.15 × 1.05 = 1.21×; measured 18.0 µs: ratio 0.43
    assert re.search(
        r"\| P3 bn_fold, P2 memory_layout\s+\| 42.0 µs\s+\| 1.21×\s+"
        r"\| 18.0 µs\s+\| 1.08×\s+\| 0.43",
        est,
    )
    assert est.count("P2 memory_layout") == 1


WATERFALL = "## What drove the speedup (per-pass waterfall)"


def _stats(median_ms: float) -> LatencyStats:
    return LatencyStats(
        median_ms=median_ms,
        ci_low_ms=median_ms * 0.99,
        ci_high_ms=median_ms * 1.01,
        mean_ms=median_ms,
        stdev_ms=median_ms * 0.01,
        min_ms=median_ms * 0.98,
        rounds=9,
        calls_per_round=50,
        samples_ms=[median_ms] * 9,
    )


def _gpt2_like() -> BackendSelection:
    """gpt2's selection on the H200 (tests/data/h200/gpt2), trimmed: the reference timed at
    3.297 ms in its run with eager; its first rung at 2.875 ms in its own pair, 1.53x over the
    reference timed at 4.401 ms in those rounds; then bf16 at 0.624 ms, 4.61x over 2.874 ms;
    then a rung that made nothing faster."""
    ref = BackendPlan()
    variants = [
        VariantResult(name="eager", plan=ref, latency=_stats(6.228), speedup=3.297 / 6.228),
        VariantResult(name="compile", plan=ref, latency=_stats(3.297), speedup=1.0),
    ]
    waterfall = [
        WaterfallStep(
            step="compile",
            latency_ms=3.297,
            speedup_cumulative=1.0,
            speedup_added=1.0,
            measured_ms=3.297,
        )
    ]
    below = "compile"
    proposals: list[str] = []
    for pid, ms, below_ms, ci in (
        ("cuda_graphs-model", 2.875, 4.401, (1.50, 1.56)),
        ("dtype_promotion-1", 0.624, 2.874, (4.55, 4.66)),
        ("pretranspose_weights-1", 0.6235, 0.624, (0.998, 1.003)),
    ):
        plan = BackendPlan(proposals=[*proposals, pid])
        name = "+".join(plan.proposals)
        gain = Speedup(
            baseline="current",
            candidate="candidate",
            ratio=below_ms / ms,
            ci_low=ci[0],
            ci_high=ci[1],
        )
        variant, step = timed_rung(
            name,
            plan,
            gain,
            _stats(ms),
            label=f"+{pid.split('-')[0]} ({pid})",
            below_name=below,
            below_latency=_stats(below_ms),
            below_step=waterfall[-1],
        )
        variants.append(variant)
        if ci[0] > 1.0:
            waterfall.append(step)
            below, proposals = name, plan.proposals
    return BackendSelection(
        workload="gpt2",
        reference="compile",
        reference_ms=3.297,
        variants=variants,
        chosen=below,
        plan=BackendPlan(proposals=proposals),
        waterfall=waterfall,
    )


def _table(section: str) -> list[list[str]]:
    """The first table of a section, header and separator left out, cells stripped."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]


def _ms(cell: str) -> float:
    return float(cell.split(" ms")[0])


def test_waterfall_latencies_are_measured_and_their_ratios_divide_out(
    full: WorkloadArtifacts,
) -> None:
    full.selection = _gpt2_like()
    wf = _section(_render(full, plots=False), WATERFALL)
    assert "latency (measured in selection's brief timing)" in wf
    assert "cumulative (chained from paired ratios, estimate)" in wf
    rows = _table(wf)
    assert [r[0] for r in rows] == [
        "torch.compile (reference)",
        "+cuda_graphs (cuda_graphs-model)",
        "+dtype_promotion (dtype_promotion-1)",
    ]
    # each step: its own measured latency, the plan above's in the same rounds, their ratio
    assert rows[1][1:4] == ["2.875 ms", "4.401 ms", "1.53× (95% CI 1.50–1.56)"]
    assert rows[2][1:4] == ["0.624 ms", "2.874 ms", "4.61× (95% CI 4.55–4.66)"]
    for row in rows[1:]:
        assert f"{_ms(row[2]) / _ms(row[1]):.2f}×" == row[3].split()[0]
    # chained 1.53 x 4.61 = 7.05x, where the latencies shown would give 3.297 / 0.624 = 5.28x:
    # only under the header that says it is chained, an estimate
    assert rows[2][4] == "7.05×"


def test_variant_rows_show_a_speedup_their_latencies_give_or_say_it_is_chained(
    full: WorkloadArtifacts,
) -> None:
    full.selection = _gpt2_like()
    notes = _section(_render(full, plots=False), "## Implementation notes")
    rows = {r[1]: r[1:] for r in _table(notes)}  # by variant, its number left out
    eager, compiled = rows["`eager`"], rows["`compile`"]
    # eager and compile, timed in one run: the speedup is their latencies' ratio
    assert compiled[2:5] == ["3.297 ms", "—", "1.00×"]
    assert eager[2] == "6.228 ms" and eager[4] == f"{3.297 / 6.228:.2f}×"
    # gpt2's row: 2.875 ms beside "1.53×" of a 3.297 ms reference, which 3.297 / 2.875 = 1.15x
    # does not give: the ratio is over the plan below in the same rounds, and the speedup over
    # the reference says it is chained
    rung = rows["`cuda_graphs-model`"]
    assert rung[2] == "2.875 ms"
    assert rung[3] == "1.53× (95% CI 1.50–1.56) over `compile` at 4.401 ms"
    assert rung[4] == "1.53× (chained, est.)"
    for row in rows.values():
        if row[0] not in ("`eager`", "`compile`"):
            assert row[4].endswith("(chained, est.)"), row


def test_waterfall_shows_the_recaptures_measured_latency(full: WorkloadArtifacts) -> None:
    assert full.optimized is not None
    full.selection = _gpt2_like()
    full.summary = full.summary.model_copy(
        update={"speedup": None, "ci_low": None, "ci_high": None, "baseline": None}
    )
    recaptured = full.optimized.timing.variants["optimized"]
    recaptured.median_ms = 0.467
    wf = _section(_render(full, plots=False), WATERFALL)
    assert "**Recapture of the chosen plan: 0.467 ms** per call" in wf
    assert "against torch.compile at 0.254 ms in the same rounds" in wf
    assert "the headline's and the gate's figure" in wf
    assert "selection timed each plan for 9 rounds of 50 calls" in wf
    assert "the recapture for 15 rounds of 30 calls" in wf


def test_waterfall_without_a_recapture_says_so(full: WorkloadArtifacts) -> None:
    full.selection = _gpt2_like()
    full.optimized = None
    full.summary = full.summary.model_copy(update={"speedup": None})
    wf = _section(_render(full, plots=False), WATERFALL)
    assert "The recapture measured no latency of the chosen plan" in wf


def test_waterfall_plot_gets_measured_latencies_and_the_recapture(
    full: WorkloadArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[plots.WaterfallBar] = []

    def waterfall(path: Path, steps: list[plots.WaterfallBar]) -> Path:
        drawn.extend(steps)
        return path

    monkeypatch.setattr(plots, "have_matplotlib", lambda: True)
    monkeypatch.setattr(plots, "waterfall", waterfall)
    monkeypatch.setattr(plots, "operator_bars", lambda *args, **kwargs: None)
    monkeypatch.setattr(plots, "roofline", lambda *args, **kwargs: None)
    full.selection = _gpt2_like()
    _render(full)
    assert [(b.latency_ms, b.measured, b.recapture) for b in drawn] == [
        (3.297, True, False),
        (2.875, True, False),
        (0.624, True, False),
        (0.183, True, True),  # the gate's figure, from the session summary
    ]
    assert drawn[2].speedup == pytest.approx((4.401 / 2.875) * (2.874 / 0.624))


def test_estimated_vs_measured_saving_comes_from_the_steps_own_rounds(
    full: WorkloadArtifacts,
) -> None:
    full.selection = _gpt2_like()
    est = _section(_render(full, plots=False), "## Estimated vs measured impact")
    # 4.401 - 2.875 ms in the first rung's rounds, not 3.297 - 2.875 across two runs
    assert re.search(r"\| \+cuda_graphs \(cuda_graphs-model\)\s+\| —\s+\| —\s+\| 1,526.0 µs", est)
    assert "in the same interleaved rounds." in est


def test_no_step_means_the_reference_itself(full: WorkloadArtifacts) -> None:
    assert full.selection is not None
    full.selection.waterfall = full.selection.waterfall[:1]
    text = _render(full, plots=False)
    assert "_No step: no proposal made the backend faster, so it is the reference" in text
    table = _section(text, "## Estimated vs measured impact")
    assert len([row for row in _table(table) if row[3].startswith("not measured (")]) == 4


def test_remaining_opportunities(full: WorkloadArtifacts) -> None:
    text = _section(_render(full, plots=False), "## Remaining opportunities")
    assert "P4 cuda_graphs on `*`: dropped" in text
    assert "`aten::convolution` still takes 78.2% of the optimized timeline (71.2 µs" in text
    assert "bottleneck compute-bound" in text


def test_reproduction_commands_use_real_options(full: WorkloadArtifacts) -> None:
    text = _section(_render(full, plots=False), "## Reproduce")
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert block == [
        "pytest --opprof examples/conv_block/conv_block.py --opprof-out=results",
        "opprof optimize examples/conv_block/conv_block.py --out=results",
        "opprof validate results/conv_block/conv_block_optimized.py",
    ]
    nouns = {spec.noun for spec in OPTIONS}
    full.min_speedup, full.gate_baseline, full.strict_gate = 1.5, "eager", True
    text = _section(_render(full, plots=False), "## Reproduce")
    pytest_argv, cli_argv, _ = (
        shlex.split(line) for line in text.split("```bash\n")[1].split("```")[0].splitlines()
    )
    for arg in pytest_argv[3:]:
        assert arg.startswith("--opprof-") and arg[9:].split("=")[0] in nouns, arg
    for arg in cli_argv[3:]:
        assert arg[2:].split("=")[0] in nouns, arg


def test_caveats(full: WorkloadArtifacts) -> None:
    text = _section(_render(full, plots=False), "## Caveats")
    assert "Unattributed: 0.5% of the device time of the eager timeline (`profile.json`)" in text
    assert "5 kernel records, 1.2 µs per iteration" in text
    assert "(clock control: none)" in text
    assert "not locked" in text
    assert "Edge case `launch_bound`: GPU idle 45.0 µs" in text
    assert "CPU" not in text


def test_cpu_fallback(full: WorkloadArtifacts) -> None:
    assert full.profile is not None
    full.profile.capture_metadata.cpu_fallback = True
    text = _render(full, plots=False)
    caveat = "measured on the CPU; not a GPU figure; gate not enforced unless --opprof-gate-on-cpu"
    assert f"- CPU fallback: {caveat}." in _section(text, "## Caveats")
    assert f"**{CPU_NOT_ENFORCED}**: measured on the CPU" in text[: text.index("## Headline")]
    assert "--opprof-device=cpu" in _section(text, "## Reproduce")
    full.gate_on_cpu = True
    text = _render(full, plots=False)
    assert CPU_NOT_ENFORCED not in text
    assert "--opprof-device=cpu --opprof-gate-on-cpu" in text


def test_a_gate_not_enforced_reads_so_in_the_title(
    full: WorkloadArtifacts,
) -> None:
    full.summary.enforced = False
    full.summary.message = f"{CPU_NOT_ENFORCED} (speedup 1.39×; --opprof-gate-on-cpu enforces it)"
    text = _render(full, plots=False)
    title = text[: text.index("## Headline")]
    assert f"**{CPU_NOT_ENFORCED}** · 1.39× (95% CI 1.36–1.42) against torch.compile" in title
    assert "passed" not in title
    assert f"> {CPU_NOT_ENFORCED} (speedup 1.39×;" in title  # the why, as for a failure
    assert f"**{CPU_NOT_ENFORCED}**: measured on the CPU" in title


def test_counters_missing(full: WorkloadArtifacts) -> None:
    assert full.profile is not None and full.optimized is not None
    for prof in (full.profile, full.optimized):
        prof.counters = None
        for t in prof.timelines:
            for op in t.operators:
                for k in op.kernels:
                    k.metrics = {}
    text = _render(full, plots=True)
    assert "Hardware counters missing" in _section(text, "## Caveats")
    assert "| hardware counters       | not collected" in text
    assert "_No roofline: no kernel carries both FLOP and DRAM-byte counters._" in text


def test_counters_still_pending_say_so(full: WorkloadArtifacts) -> None:
    """A profile whose counters pass, run beside the later stages, never ended (its session
    ended first): the caveat says so rather than that ncu did not run."""
    from pytest_opprof.capture.counters import PENDING

    assert full.profile is not None
    full.optimized = None
    prof = full.profile
    prof.counters = {PENDING: "the counters pass runs beside the later stages"}
    for t in prof.timelines:
        for op in t.operators:
            for k in op.kernels:
                k.metrics = {}
        for agg in t.aggregated:
            agg.metrics = {}
    caveats = _section(_render(full, plots=False), "## Caveats")
    assert "the counters pass, run beside the later stages, had not ended" in caveats
    assert "did not run or was not permitted" not in caveats


def test_no_dtype_change(full: WorkloadArtifacts) -> None:
    assert full.selection is not None and full.optimized is not None
    full.selection.plan.dtype = None
    full.optimized.capture_metadata.dtype = "float32"
    full.optimized.timing.speedups = [
        s for s in full.optimized.timing.speedups if s.candidate == "optimized"
    ]
    text = _section(_render(full, plots=False), "## Headline")
    assert "the backend keeps the baseline dtype (float32)" in text


def test_only_a_summary_renders_every_section(tmp_path: Path) -> None:
    summary = WorkloadSummary(
        name="broken",
        path="w/broken.py",
        status="error",
        stage="capture",
        message="child process crashed:\nCUDA error: out of memory",
    )
    a = WorkloadArtifacts(
        name="broken",
        path="w/broken.py",
        out_dir=tmp_path / "o" / "broken",
        summary=summary,
        stage_errors={"capture": summary.message},
    )
    text = _render(a, plots=True)
    for heading in SECTIONS:
        assert heading + "\n" in text
    assert text.startswith("# broken: no speedup measured")
    reason = "child process crashed: CUDA error: out of memory"
    assert f"_Not available (stage capture did not run: {reason})._" in text
    assert f"_Not available (stage propose did not run: blocked by capture: {reason})._" in text
    assert "_Not available (stage recapture did not run: blocked by capture" in text
    assert not (tmp_path / "o").exists()  # no plot was drawn without data


def test_blocked_validation_explains_missing_recapture(full: WorkloadArtifacts) -> None:
    assert full.validation is not None
    full.validation.overall = "BLOCKED"
    full.validation.message = "BLOCKED — fix step 6 (numerics: output is constant)"
    full.optimized = None
    full.summary = full.summary.model_copy(
        update={"status": "failed", "stage": "validate", "speedup": None}
    )
    text = _render(full, plots=False)
    expected = (
        "_Not available (stage recapture did not run: validation BLOCKED: BLOCKED — fix "
        "step 6 (numerics: output is constant))._"
    )
    assert expected in _section(text, "## Headline")
    assert expected in _section(text, "## Before and after, per operator")
    assert "**BLOCKED** — BLOCKED — fix step 6" in _section(text, "## Validation")


def test_loader_reports_an_unreadable_artifact(out: Path) -> None:
    (out / "conv_block" / "optimizations.json").write_text("{", encoding="utf-8")
    (out / "conv_block" / "profile_optimized.json").unlink()
    a = load_workload_artifacts(out / "conv_block", _session().workloads[0])
    assert a.optimizations is None and a.optimized is None and a.profile is not None
    assert "not valid JSON" in a.stage_errors["propose"]
    text = _render(a, plots=False)
    assert "_Not available (stage propose did not run: " in _section(text, "## Optimizations")
    assert "optimizations.json: not valid JSON" in text
    before_after = _section(text, "## Before and after, per operator")
    assert "(stage recapture did not run: blocked by propose: " in before_after
    del a.stage_errors["propose"]
    text = _render(a, plots=False)
    assert "(stage recapture did not run: its artifact was not found)" in text


def test_many_operators_are_cut_at_the_top_fifteen(full: WorkloadArtifacts) -> None:
    assert full.profile is not None
    t = full.profile.primary
    t.aggregated += [
        OperatorAggregate(
            name=f"aten::op{i}",
            calls=5,
            cpu_time_us=1,
            gpu_time_us=0.5,
            share=0.0001,
            kernel_count=5,
        )
        for i in range(20)
    ]
    ops = _section(_render(full, plots=False), "## Operator summary")
    assert "| 15  |" in ops and "| 16  |" not in ops
    assert "… 11 more operators" in ops


def test_names_with_pipes_do_not_break_tables(full: WorkloadArtifacts) -> None:
    assert full.profile is not None
    full.profile.primary.aggregated[0].name = "aten::weird|op"
    text = _render(full, plots=False)
    assert "`aten::weird\\|op`" in text


def test_write_workload_report_with_plots(full: WorkloadArtifacts) -> None:
    pytest.importorskip("matplotlib", reason="plots are the optional [plots] extra")
    path = write_workload_report(full)
    assert path == full.out_dir / "report.md"
    text = path.read_text(encoding="utf-8")
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert links == [
        "profiler_output/roofline.png",
        "profiler_output/operators_before_after.png",
        "profiler_output/waterfall.png",
    ]
    for link in links:
        png = path.parent / link
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5000
    assert not list(path.parent.rglob(".*.tmp"))


def test_plots_missing_matplotlib_says_how_to_install(
    full: WorkloadArtifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    text = _render(full)
    line = (
        "_plots need `pip install pytest-opprof[plots]`: no roofline, operator or waterfall plot._"
    )
    assert text.count("pip install") == 1 and line in _section(text, "## Headline")
    assert not list((full.out_dir / "profiler_output").glob("*.png"))


def test_plots_off_draws_and_mentions_nothing(full: WorkloadArtifacts) -> None:
    text = _render(full, plots=False)
    assert "![" not in text and "pip install" not in text
    assert not list((full.out_dir / "profiler_output").glob("*.png"))


def test_roofline_points_from_counters(full: WorkloadArtifacts) -> None:
    assert full.profile is not None
    points = plots.roofline_points(full.profile.timelines)
    assert len(points) == 3  # the three fp32 convolutions carry flops + DRAM bytes
    p = points[0]
    assert p.intensity == pytest.approx(2.42e9 / (3.1e7 + 1.6e7))


# ------------------------------------------------------------------------------- session


def test_session_report(tmp_path: Path) -> None:
    session = _session()
    (tmp_path / "conv_block").mkdir()
    text = render_session_report(session.workloads, device=session.device, out_dir=tmp_path)
    assert text.startswith("# pytest-opprof session report\n")
    assert "Device: NVIDIA H200 · 3 workloads: 1 passed, 1 failed, 1 error" in text
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| ") and "workload" not in line
    }
    assert rows["conv_block"] == [
        "conv_block",
        "passed",
        "torch.compile",
        "0.254",
        "0.183",
        "1.39× (95% CI 1.36–1.42)",
        "bfloat16",
        "bn_fold, dtype_promotion, memory_layout",
    ]
    assert "sdpa\\|attention" in text  # escaped, the table keeps its columns
    assert "- **lstm_sequence_encoder** (error at capture): child process crashed" in text
    assert "(failed at speedup)" in text
    links = re.findall(r"^- \[([^\]]+)\]\(([^)]+)\)$", text, re.M)
    assert links == [("conv_block", "conv_block/report.md")]
    assert text.index("| conv_block") < text.index("## Reports")


def test_session_report_says_where_the_gate_was_not_enforced(tmp_path: Path) -> None:
    session = _session()
    session.workloads[0].enforced = False
    text = render_session_report(session.workloads, device="cpu", out_dir=tmp_path)
    assert f"3 workloads: 1 {CPU_NOT_ENFORCED}, 1 failed, 1 error" in text
    assert f"**{CPU_NOT_ENFORCED}** where a workload ran on the CPU" in text
    row = next(line for line in text.splitlines() if line.startswith("| conv_block"))
    assert [c.strip() for c in row.strip("|").split("|")][:2] == ["conv_block", CPU_NOT_ENFORCED]
    assert "passed" not in text


def test_session_report_links_absolute_report_paths(tmp_path: Path) -> None:
    s = WorkloadSummary(
        name="w",
        path="w.py",
        status="passed",
        stage="report",
        report=str(tmp_path / "w" / "report.md"),
    )
    text = render_session_report([s], device="cpu", out_dir=tmp_path)
    assert "- [w](w/report.md)" in text
    empty = render_session_report([], device="cpu", out_dir=tmp_path)
    assert "0 workloads: no workload" in empty and "_No workload report was written._" in empty


def test_comment_body_has_the_hidden_marker() -> None:
    body = render_comment_body("# pytest-opprof session report\n")
    assert COMMENT_MARKER == "<!-- pytest-opprof -->"
    assert body.splitlines()[0] == COMMENT_MARKER
    assert body.endswith("# pytest-opprof session report\n")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(4.2134, "4.213 ms"), (0.254, "0.254 ms"), (0.01234, "0.0123 ms"), (None, "—")],
)
def test_fmt_ms(value: float | None, expected: str) -> None:
    assert fmt.fmt_ms(value) == expected


def test_fmt_speedup() -> None:
    assert fmt.fmt_speedup(1.2345, 1.2011, 1.2649) == "1.23× (95% CI 1.20–1.26)"
    assert fmt.fmt_speedup(1.5) == "1.50×"
    assert fmt.fmt_speedup(None) == "—"


def test_cpu_fallback_capture_reports_cpu_time(tmp_path: Path) -> None:
    """On a real CPU-fallback profile: CPU time per operator, no GPU wording, no kernels."""
    shutil.copytree(DATA / "cpu_tiny", tmp_path / "tiny")
    summary = WorkloadSummary(
        name="tiny", path="work/tiny.py", status="error", stage="propose", message="boom"
    )
    a = load_workload_artifacts(tmp_path / "tiny", summary, stage_errors={"propose": "boom"})
    assert a.profile is not None and a.profile.capture_metadata.cpu_fallback
    text = _render(a, plots=False)
    ops = _section(text, "## Operator summary")
    conv = next(op for op in a.profile.primary.aggregated if op.name == "aten::conv2d")
    assert conv.gpu_time_us == 0 and conv.cpu_time_us > 0
    assert fmt.fmt_us(conv.cpu_time_us) in ops  # per iteration already: calls == 1
    assert "CPU time/iter" in ops and "GPU" not in ops
    assert f"**{CPU_NOT_ENFORCED}**: measured on the CPU" in text[: text.index("## Headline")]
    assert "| CPU fallback " in _section(text, "## Hardware context")
    assert "_Not available (stage backend did not run: blocked by propose: boom)._" in text


def test_caveats_say_which_counters_were_carried_over(full: WorkloadArtifacts) -> None:
    """A unique-configuration replay (gpt2's on the H200): the report says how much kernel
    time ncu measured directly and how to replay every launch."""
    from pytest_opprof.schema import Profile

    gpt2 = read_artifact(Path(__file__).parents[1] / "data/h200/gpt2/profile.json.gz", Profile)
    assert gpt2.counters is not None
    full.profile = full.profile.model_copy(update={"counters": gpt2.counters})  # type: ignore[union-attr]
    text = _section(_render(full, plots=False), "## Caveats")
    assert "first launch of each launch configuration" in text
    assert "eager 8%, compiled 6%" in text and "--opprof-ncu-replay=all" in text


def test_timing_says_when_it_ran_in_several_processes(full: WorkloadArtifacts) -> None:
    from pytest_opprof.measure import Replica, pooled_timing

    assert full.optimized is not None
    one = _section(_render(full, plots=False), "## Timing")
    assert "timed interleaved in one process" in one
    timing = full.optimized.timing
    again = {name: list(v.samples_ms) for name, v in timing.variants.items()}
    pooled = pooled_timing(timing, [Replica(again)])
    full.optimized = full.optimized.model_copy(update={"timing": pooled})
    text = _render(full, plots=False)
    head = _section(text, "## Timing")
    assert "in each of 2 fresh processes, pooled" in head
    ratio = next(
        s for s in pooled.speedups if (s.baseline, s.candidate) == ("compile", "optimized")
    )
    mine = ", ".join(f"{x:.2f}×" for x in ratio.process_ratios)
    assert f"torch.compile → optimized: {mine}" in head
    assert "calls, in each of 2 processes" not in text  # the hardware rows are the capture's
    assert "Timed in the first process only" not in head
    # A retime process leaves out the plan at the baseline dtype: its rows say so.
    del again["optimized_baseline_dtype"]
    partial = pooled_timing(timing, [Replica(again)])
    full.optimized = full.optimized.model_copy(update={"timing": partial})
    head = _section(_render(full, plots=False), "## Timing")
    assert "Timed in the first process only: the plan at the baseline dtype." in head


def test_a_stock_recipe_ship_is_not_split_at_the_baseline_dtype(full: WorkloadArtifacts) -> None:
    """The recapture does not time a stock-recipe plan at float32: the headline has no float32
    columns and says why, instead of pointing at columns that are not there."""
    assert full.optimized is not None and full.selection is not None
    timing = full.optimized.timing
    twin = "optimized_baseline_dtype"
    timing = timing.model_copy(
        update={
            "variants": {n: v for n, v in timing.variants.items() if n != twin},
            "speedups": [s for s in timing.speedups if twin not in (s.baseline, s.candidate)],
        }
    )
    full.optimized = full.optimized.model_copy(update={"timing": timing})
    plan = full.selection.plan.model_copy(update={"stock_recipe": "cast"})
    full.selection = full.selection.model_copy(update={"plan": plan})

    head = _section(_render(full, plots=False), "## Headline")

    header = next(line for line in head.splitlines() if line.startswith("| against"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "against",
        "baseline latency",
        "optimized, float32 → bfloat16",
        "speedup (95% CI)",
    ]
    assert _table(head)[0] == [
        "torch.compile (gate)",
        "0.254 ms",
        "0.183 ms",
        "1.39× (95% CI 1.36–1.42)",
    ]
    assert "it ships the stock recipe, whose graph changes are stock PyTorch's" in " ".join(
        head.split()
    )
    assert "the columns at float32" not in head


def test_timing_explains_processes_that_disagree_on_a_host_bound_baseline(
    full: WorkloadArtifacts,
) -> None:
    """conv_block on the H200: the torch.compile baseline ran at 0.35 ms in one process and
    0.59 ms in another on 0.17 ms of GPU work, while the optimized call stayed put."""
    from pytest_opprof.measure import Replica, pooled_timing

    assert full.optimized is not None
    timing = full.optimized.timing
    slow_host = {
        name: [x * (2.0 if name == "compile" else 1.0) for x in v.samples_ms]
        for name, v in timing.variants.items()
    }
    compile_ms = timing.variants["compile"].median_ms
    host_bound = {**timing.gpu_time_ms, "compile": 0.4 * compile_ms}
    pooled = pooled_timing(timing, [Replica(slow_host)]).model_copy(
        update={"gpu_time_ms": host_bound}
    )
    full.optimized = full.optimized.model_copy(update={"timing": pooled})
    head = _section(_render(full, plots=False), "## Timing")
    assert "The processes disagree because the baseline is host-bound" in head
    assert (
        "of torch.compile's" in head and "follow the speed of the CPU each process ran on" in head
    )
    # GPU-bound, the same spread is not put down to the host
    gpu_bound = {**timing.gpu_time_ms, "compile": pooled.variants["compile"].median_ms}
    pooled = pooled.model_copy(update={"gpu_time_ms": gpu_bound})
    full.optimized = full.optimized.model_copy(update={"timing": pooled})
    head = _section(_render(full, plots=False), "## Timing")
    assert "host-bound" not in head


def test_hardware_names_the_gpu_the_process_saw(full: WorkloadArtifacts) -> None:
    assert full.profile is not None
    meta = full.profile.capture_metadata.model_copy(
        update={"device_uuid": "GPU-1234", "device_count": 1, "visible_devices": "1"}
    )
    full.profile = full.profile.model_copy(update={"capture_metadata": meta})
    hw = _section(_render(full, plots=False), "## Hardware context")
    assert "GPU-1234; 1 visible (CUDA_VISIBLE_DEVICES=1)" in hw


def test_session_report_names_the_gpu_each_workload_was_measured_on(tmp_path: Path) -> None:
    """From the -n 2 run on two H200s (h200x2-2026-11-30e/two-gpus): each worker's profiles
    name its own GPU."""
    run = Path(__file__).resolve().parents[1] / "data/report/two-gpus"
    session = read_artifact(run / "session.json", SessionSummary)
    text = _unwrap(render_session_report(session.workloads, device=session.device, out_dir=run))
    line = next(line for line in text.splitlines() if line.startswith("Measured on"))
    assert line == (
        "Measured on 2 GPUs: `GPU-10002e43-0f75-f087-41d2-b7c7f243a7c3`: conv_block, "
        "depthwise_separable_conv, gpt2; `GPU-59a44747-2d72-d4af-0d1e-7ef69bc68257`: "
        "embedding_projection, lstm_sequence_encoder, mlp_activations, sdpa_attention. "
        "Each process saw one GPU."
    )
    # profiles without a UUID (the CPU, or before Profile 2.3) say nothing
    session_cpu = _session()
    (tmp_path / "conv_block").mkdir()
    assert "Measured on" not in render_session_report(
        session_cpu.workloads, device=session_cpu.device, out_dir=tmp_path
    )


def test_timing_says_how_many_rounds_ran_on_a_slowed_host(full: WorkloadArtifacts) -> None:
    from pytest_opprof.measure import Replica, pooled_timing

    assert full.optimized is not None
    timing = full.optimized.timing
    rounds = timing.variants["optimized"].rounds
    timing = timing.model_copy(update={"host_us": [3.0] * rounds})
    again = {name: list(v.samples_ms) for name, v in timing.variants.items()}
    slowed = Replica(again, host_us=[6.0] * rounds)
    pooled = pooled_timing(timing, [slowed, Replica(again, host_us=[3.0] * rounds)])
    full.optimized = full.optimized.model_copy(update={"timing": pooled})
    head = _section(_render(full, plots=False), "## Timing")
    assert f"{rounds} of {3 * rounds} rounds are set aside" in head
    assert "fast rounds: 3.0 µs" in head


def test_timing_names_the_host_speed_a_host_bound_ratio_was_measured_at(
    full: WorkloadArtifacts,
) -> None:
    """Between two H200 hosts whose reference ran at 1.43 and 1.25 µs, a launch-bound
    torch.compile baseline moved 6.5%: the headline says what speed its figures are from."""
    assert full.optimized is not None
    timing = full.optimized.timing
    compile_ms = timing.variants["compile"].median_ms
    rounds = timing.variants["compile"].rounds
    host_bound = timing.model_copy(
        update={
            "host_us": [1.43] * rounds,
            "gpu_time_ms": {**timing.gpu_time_ms, "compile": 0.5 * compile_ms},
        }
    )
    full.optimized = full.optimized.model_copy(update={"timing": host_bound})
    head = _section(_render(full, plots=False), "## Timing")
    assert "at a median 1.43 µs per call" in head and "torch.compile (GPU" in head
    assert "compare runs at the same reference" in head
    # GPU-bound baselines: the host's speed does not enter the ratio, and it is not named.
    gpu_bound = host_bound.model_copy(
        update={
            "gpu_time_ms": {
                k: v.median_ms for k, v in timing.variants.items() if k in ("compile", "eager")
            }
        }
    )
    full.optimized = full.optimized.model_copy(update={"timing": gpu_bound})
    head = _section(_render(full, plots=False), "## Timing")
    assert "µs per call" not in head


def test_the_host_reference_is_named_once_where_the_processes_disagree(
    full: WorkloadArtifacts,
) -> None:
    """The processes' disagreement already says the baseline is host-bound: the host's speed
    follows it without saying so again."""
    from pytest_opprof.measure import Replica, pooled_timing

    assert full.optimized is not None
    timing = full.optimized.timing
    rounds = timing.variants["compile"].rounds
    timing = timing.model_copy(update={"host_us": [1.3] * rounds})
    slow = {
        name: [x * (2.0 if name == "compile" else 1.0) for x in v.samples_ms]
        for name, v in timing.variants.items()
    }
    pooled = pooled_timing(timing, [Replica(slow, host_us=[1.3] * rounds)])
    compile_ms = pooled.variants["compile"].median_ms
    pooled = pooled.model_copy(
        update={"gpu_time_ms": {**timing.gpu_time_ms, "compile": 0.4 * compile_ms}}
    )
    full.optimized = full.optimized.model_copy(update={"timing": pooled})
    head = _section(_render(full, plots=False), "## Timing")
    assert "The processes disagree because the baseline is host-bound" in head
    assert "at a median 1.30 µs per call (`timing.host_us`): compare runs" in head
    assert head.count("is host-bound") == 1
