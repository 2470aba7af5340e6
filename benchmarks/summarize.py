"""Summarise a benchmark run (the seven examples and the real-model suite) into JSON and Markdown.

    python benchmarks/summarize.py OUT_DIR [OUT_DIR …] --json results/h200.json --md results/h200.md

Each OUT_DIR is an ``--opprof-out`` folder (or a folder of ``<name>/h200`` artifacts); every
figure is read from the artifacts the pipeline wrote, never typed in. Targets are the
hand-tuned figures of EXAMPLES.md (H200, torch 2.11), for the examples only: the real-model
suite (benchmarks/models) has none, and is held to torch.compile and the stock baseline.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from pytest_opprof.backend.plan import replaced_by_model_graph
from pytest_opprof.measure import split_processes
from pytest_opprof.pipeline import STOCK_FILE
from pytest_opprof.schema import (
    BackendSelection,
    Optimizations,
    Profile,
    Speedup,
    StockBaseline,
    ValidationReport,
    read_artifact,
    timing_variant,
)

# EXAMPLES.md: best hand-tuned latency (ms) and its ratio over torch.compile fp32.
TARGETS = {
    "conv_block": (0.120, 2.12),
    "mlp_activations": (0.121, 2.17),
    "sdpa_attention": (0.126, 3.25),
    "depthwise_separable_conv": (0.118, 2.35),
    "embedding_projection": (0.541, 11.4),
    "gpt2": (0.625, 4.94),
    "lstm_sequence_encoder": (3.78, 1.08),
}


EXAMPLES, MODELS = "examples", "models"
"""A row's ``suite``: one of the seven examples (with targets), or any other workload of the run
(the real-model suite, without)."""

MODELS_DIR = Path(__file__).resolve().parent / "models"
"""The real-model suite's folders, found beside this script wherever it is run from."""


def model_names() -> list[str]:
    """The real-model suite: each folder ``benchmarks/models/NAME`` holding ``NAME.py`` (the
    rule gpu_session.sh's ``models`` group expands by), sorted."""
    if not MODELS_DIR.is_dir():
        return []
    return sorted(d.name for d in MODELS_DIR.iterdir() if (d / f"{d.name}.py").is_file())


def discover(folders: list[Path]) -> dict[str, Path | None]:
    """The run's workloads other than the examples, by name, sorted: each subfolder of an
    OUT_DIR whose artifacts hold ``profile_optimized.json`` (the first OUT_DIR that has them
    wins, as for the examples), and, as None (missing), each subfolder named after a model of
    the suite without it, so that a model whose stages failed stays in the table instead of
    vanishing from it. Any other folder without the artifacts is not a workload."""
    known = set(model_names())
    found: dict[str, Path | None] = {}
    for folder in folders:
        if not folder.is_dir():
            continue
        for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
            name = sub.name
            if name in TARGETS or found.get(name) is not None:
                continue
            where = _find(folder, name)
            if where is not None or name in known:
                found[name] = where
    return dict(sorted(found.items()))


def _find(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / name / "h200", folder / "examples" / name / "h200"):
        if _artifact(candidate, "profile_optimized.json").exists():
            return candidate
    return None


def _artifact(where: Path, name: str) -> Path:
    """``where/name``, or its gzip copy (``name.gz``) where the results were archived so."""
    plain = where / name
    packed = where / f"{name}.gz"
    return packed if not plain.exists() and packed.exists() else plain


def read_summary(path: Path) -> dict[str, Any]:
    """A run's ``summary.json``, or its gzip copy (``summary.json.gz``), as main keeps them."""
    path = _artifact(path.parent, path.name)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


CACHED_S = 0.015
"""A stage item faster than this found its artifacts cached (a resumed call): not counted."""


def stage_seconds(junit_files: list[Path]) -> dict[str, dict[str, float]]:
    """Wall time of each stage of each workload from the stage JUnit (``--opprof-junit``) of
    one or more calls, in order; a stage a later call resumed from its cache counts once. A
    call that ran a workload's stages anew from the start (its capture) replaces what earlier
    calls had for it, unless it stopped before the last stage (``speedup``) and an earlier
    call had finished: the artifacts are then the earlier call's."""
    import xml.etree.ElementTree as ET

    out: dict[str, dict[str, float]] = {}
    for path in junit_files:
        ran: dict[str, dict[str, float]] = {}
        for case in ET.parse(path).iter("testcase"):
            seconds = float(case.get("time") or 0.0)
            if seconds > CACHED_S:
                ran.setdefault(case.get("classname", ""), {})[case.get("name", "")] = seconds
        for workload, stages in ran.items():
            before = out.get(workload, {})
            if "capture" not in stages:  # resumed: its earlier stages come from before
                out[workload] = {**before, **stages}
            elif "speedup" in stages or "speedup" not in before:
                out[workload] = stages
    return out


def _in_effect(where: Path, sel: BackendSelection, val: ValidationReport) -> list[str]:
    """The chosen plan's proposals that changed the program: without those whose pass
    validation recorded as NOT_APPLIED, and Inductor's CUDA graphs where one graph of the
    whole call replaced them."""
    proposals = read_artifact(_artifact(where, "optimizations.json"), Optimizations).proposals
    types = {p.id: p for p in proposals}
    idle = {r.name for r in val.passes if r.status == "NOT_APPLIED"}
    kept = []
    for pid in sel.plan.proposals:
        p = types.get(pid)
        # Selection's own proposals (CUDA graphs) are not in optimizations.json.
        kind = p.type if p is not None else pid.split("-")[0]
        scope = p.params.get("scope") if p is not None else pid.rpartition("-")[2]
        if kind in idle or pid in idle or replaced_by_model_graph(sel.plan, kind, scope):
            continue
        kept.append(pid)
    return kept


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}"


def _gpu_time(*profiles: Profile) -> dict[str, dict[str, float | None]]:
    """Per timeline: the timing pass's median per call and its GPU time per call with the
    host hidden, beside the timeline's kernel time (sum) and busy time (union of kernel
    intervals) per iteration, all in ms."""
    out: dict[str, dict[str, float | None]] = {}
    for profile in profiles:
        for t in profile.timelines:
            stats = profile.timing.variants.get(timing_variant(t.label))
            if stats is None:
                continue
            busy = t.summary.busy_time_per_iter_us
            own = sorted(split_processes(stats.samples_ms, stats.samples_per_process or None)[0])
            out[t.label] = {
                "timing_ms": stats.median_ms,
                # the timeline's and the GPU time's own process (the recapture's, pooled first)
                "own_ms": own[len(own) // 2] if own and stats.processes > 1 else None,
                "gpu_ms": profile.timing.gpu_time_ms.get(timing_variant(t.label)),
                "kernel_ms": t.summary.device_time_per_iter_us / 1000.0,
                "busy_ms": busy / 1000.0 if busy is not None else None,
                "idle_ms": t.summary.idle_time_per_iter_us / 1000.0,
            }
    return out


def _processes(profile: Profile) -> list[dict[str, Any]]:
    """Per timing process of a profile, in order: each variant's median, the launching
    thread's median CPU share and its preemptions over its rounds, the host's CPUs while it
    timed (``Timing.host``), and the median host reference with the rounds set aside. Empty
    for a profile timed in one process without them."""
    t = profile.timing
    n = t.processes
    every = {k: s for k, s in t.variants.items() if s.processes == n}
    runs = {  # each variant timed in every process: its samples, shares, switches per process
        k: [
            split_processes(seq, s.samples_per_process or None) if seq else []
            for seq in (s.samples_ms, s.cpu_share, s.preempted)
        ]
        for k, s in every.items()
    }
    full = next(iter(every.values()), None)
    hosts = None
    if full is not None and len(t.host_us) == len(full.samples_ms):
        groups = full.samples_per_process or None
        hosts = split_processes(t.host_us, groups)
        rounds = split_processes(range(len(t.host_us)), groups)
    out: list[dict[str, Any]] = []
    for i in range(n):
        row: dict[str, Any] = {}
        for name in ("eager", "compile", "optimized"):
            if name not in runs:
                continue
            ms, shares, switches = runs[name]
            row[f"{name}_ms"] = statistics.median(ms[i])
            if shares:
                row[f"{name}_cpu_share"] = statistics.median(shares[i])
                row[f"{name}_cpu_share_min"] = min(shares[i])
                row[f"{name}_preempted"] = int(sum(switches[i]))
        if i < len(t.host):
            row["host"] = t.host[i].model_dump()
        if hosts is not None and full is not None:
            row["host_us"] = statistics.median(hosts[i])
            row["set_aside"] = sum(1 for j in full.set_aside if j in rounds[i])
        out.append(row)
    return out if any("host" in r or "compile_cpu_share" in r for r in out) else []


GEMM_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm")


def gemm_bytes(shapes: list[Any], op: str, itemsize: int) -> int | None:
    """The DRAM bytes a GEMM's shapes imply: each operand read once, the output written once
    (the floor a kernel with perfect reuse reaches). ``linear``'s weight is (N, K)."""
    dims = [s for s in shapes if isinstance(s, list) and s]
    bias: list[int] = []
    if op == "aten::addmm" and len(dims) > 2:  # addmm(bias, a, b)
        bias, dims = dims[0], dims[1:]
    elif op == "aten::linear" and len(dims) > 2:  # linear(a, weight, bias)
        bias = dims[2]
    if len(dims) < 2 or len(dims[0]) < 2:
        return None
    a, b = dims[0], dims[1]
    n = b[0] if op == "aten::linear" else b[-1]
    elements = math.prod(a) + math.prod(b) + math.prod(a[:-1]) * n
    return (elements + (math.prod(bias) if bias else 0)) * itemsize


def largest_gemm_bytes(profile: Profile, label: str = "eager") -> dict[str, Any] | None:
    """The longest GEMM of ``label``'s timeline: its DRAM bytes as ncu counted them beside the
    bytes its shapes imply (fp32 at capture)."""
    timeline = next((t for t in profile.timelines if t.label == label), None)
    if timeline is None:
        return None
    gemms = [op for op in timeline.operators if op.name in GEMM_OPS]
    if not gemms:
        return None
    op = max(gemms, key=lambda o: o.gpu_time_us)
    itemsize = 2 if profile.capture_metadata.dtype in ("bfloat16", "float16") else 4
    implied = gemm_bytes(op.input_shapes, op.name, itemsize)
    kernels = [k for k in op.kernels if not k.name.startswith(("Memcpy", "Memset"))]
    counted = [k.metrics.get("dram_bytes") for k in kernels]  # ncu profiles kernels only
    known = counted and all(v is not None for v in counted)
    measured = sum(float(v) for v in counted if v is not None) if known else None
    return {
        "operator": f"{op.name}#{op.call_index}",
        "shapes": op.input_shapes,
        "gpu_time_us": op.gpu_time_us,
        "implied_bytes": implied,
        "dram_bytes": measured,
        "ratio": measured / implied if measured is not None and implied else None,
    }


def _counters(profile: Profile) -> dict[str, Any]:
    """The counters pass of the capture: seconds, replay mode, coverage per timeline."""
    c = profile.counters or {}
    out: dict[str, Any] = {"seconds": c.get("seconds"), "replay": c.get("replay")}
    for label in ("eager", "compiled"):
        entry = c.get(label)
        if isinstance(entry, dict):
            out[label] = {
                k: entry.get(k)
                for k in (
                    "kernels",
                    "kernels_with_counters",
                    "kernels_replayed",
                    "time_coverage",
                    "time_coverage_replayed",
                    "note",
                    "seconds",
                )
            }
    out["largest_gemm"] = largest_gemm_bytes(profile)
    return out


def shortfall(row: dict[str, Any], opt: Profile) -> dict[str, Any] | None:
    """For a workload that meets neither target: by how much it misses each, and what its
    optimized timeline says sets the latency (kernel time against the call's latency, and the
    operator that holds most of it)."""
    if row["meets_target"]:
        return None
    timeline = next((t for t in opt.timelines if t.label == "optimized"), None)
    out: dict[str, Any] = {
        "latency_over_target": row["optimized_ms"] / row["target_ms"] - 1,
        "ratio_under_target": 1 - row["speedup_vs_compile"] / row["target_ratio"],
    }
    if timeline is None or not timeline.aggregated:
        return out
    kernel_ms = timeline.summary.device_time_per_iter_us / 1000.0
    busy = timeline.summary.busy_time_per_iter_us
    top = max(timeline.aggregated, key=lambda a: a.share)
    out.update(
        kernel_ms=kernel_ms,
        busy_ms=busy / 1000.0 if busy is not None else None,
        top_operator=top.name,
        top_ms=top.share * kernel_ms,
        top_share=top.share,
        top_kernels=sorted(k for k in top.kernel_names if not k.startswith("Mem"))[:2],
        # operators[] hold one iteration's calls
        copy_ms=sum(
            k.duration_us
            for op in timeline.operators
            for k in op.kernels
            if k.name.startswith(("Memcpy", "Memset"))
        )
        / 1000.0,
    )
    return out


def _shortfall_line(name: str, r: dict[str, Any]) -> str:
    s = r["shortfall"]
    line = (
        f"- {name}: {r['optimized_ms']:.3f} ms is {s['latency_over_target']:.0%} above "
        f"{r['target_ms']} ms, and {r['speedup_vs_compile']:.2f}× is "
        f"{s['ratio_under_target']:.0%} below {r['target_ratio']}×."
    )
    if "kernel_ms" not in s:
        return line
    busy = s["busy_ms"] if s["busy_ms"] is not None else s["kernel_ms"]
    share = busy / r["optimized_ms"]
    if share >= 0.9:
        line += (
            f" The GPU is busy {share:.0%} of the call ({busy:.3f} ms of kernels): kernel time, "
            "not launch overhead, sets the latency."
        )
    else:
        line += (
            f" The GPU is busy {share:.0%} of the call ({busy:.3f} ms of kernels): the rest is "
            "host and launch overhead."
        )
    kernels = ", ".join(k[:60] for k in s["top_kernels"])
    line += (
        f" Its largest operator, {s['top_operator']}, takes {s['top_ms']:.3f} ms "
        f"({s['top_share']:.0%} of kernel time; {kernels})"
    )
    if s["top_ms"] >= r["target_ms"]:
        line += f", more than the {r['target_ms']} ms target by itself."
    else:
        line += (
            f", which leaves {r['target_ms'] - s['top_ms']:.3f} ms of the target for the other "
            f"kernels' {s['kernel_ms'] - s['top_ms']:.3f} ms."
        )
    if s.get("copy_ms", 0.0) >= 0.05 * s["kernel_ms"]:
        line += (
            f" Copies and fills (Memcpy/Memset) take {s['copy_ms']:.3f} ms of it "
            f"({s['copy_ms'] / s['kernel_ms']:.0%})."
        )
    return line


STAGE_LOGS = (
    "capture",
    "counters",
    "stock",
    "stock_warm",
    "backend",
    "validate",
    "validate_tests",
    "recapture",
)
"""The stage children's logs: ``counters`` is the counters pass's own process where it ran
beside the later stages (``--opprof-ncu-when=beside``); inside the capture, its phase there.
``validate_tests``: the generated tests' process, where it ran beside validation's."""
FORMER_LOGS = {"backend": "select"}
"""A stage whose child logged under another name in runs before: read where its own is absent."""


TASK_DONE = re.compile(
    r"^task \S+ done(?:, ([\d.]+) s of it waiting for the GPU)?"
    r"(?:, ([\d.]+) s with the GPU to itself)?$"
)


def child_seconds(where: Path) -> dict[str, float]:
    """Each stage child's own duration from its log's last "[opprof] +  N s  task … done" line
    (the stage JUnit adds the parent's share; a call cut short loses its JUnit, not its logs),
    the counters pass (inside the capture, or its own process beside the later stages), the
    recapture's extra timing processes summed, and ``waiting``: the seconds all of them
    waited for the GPU's lock (runs sharing a GPU), and ``alone``: the seconds they held it
    exclusively, measuring."""
    out: dict[str, float] = {}
    folder = where / "profiler_output"
    logs = [
        (
            s,
            log
            if (log := folder / f"{s}.log").exists() or s not in FORMER_LOGS
            else folder / f"{FORMER_LOGS[s]}.log",
        )
        for s in STAGE_LOGS
    ]
    logs += [("retime", p) for p in sorted(folder.glob("retime*.log"))]
    for stage, log in logs:
        if not log.exists():
            continue
        marks = re.findall(
            r"^\[opprof\] \+\s*([\d.]+) s  (.*)$", log.read_text(errors="replace"), re.M
        )
        for i, (at, what) in enumerate(marks):
            if done := TASK_DONE.match(what):
                out[stage] = out.get(stage, 0.0) + float(at) if stage == "retime" else float(at)
                if done.group(1):
                    out["waiting"] = out.get("waiting", 0.0) + float(done.group(1))
                if done.group(2):
                    out["alone"] = out.get("alone", 0.0) + float(done.group(2))
            elif what == "counters pass" and i:
                out["counters"] = float(at) - float(marks[i - 1][0])
    return out


def geomean(ratios: list[float]) -> float | None:
    """The geometric mean of ``ratios``; None where there is nothing to average."""
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


def _speedup(s: Speedup | None) -> tuple[float | None, list[float] | None]:
    """A speedup's ratio and its 95% CI; (None, None) where the pair was not timed."""
    return (s.ratio, [s.ci_low, s.ci_high]) if s is not None else (None, None)


def stock_recipe(where: Path) -> tuple[str | None, str | None]:
    """The stock recipe the baseline measured (``"cast at bfloat16"``), and, where none of the
    recipes passed, the stage's reason; (None, None) where no stock baseline was chosen."""
    path = _artifact(where, STOCK_FILE)
    if not path.exists():
        return None, None
    stock = read_artifact(path, StockBaseline)
    if stock.recipe is None:
        return None, stock.message or None
    return (f"{stock.recipe} at {stock.dtype}" if stock.dtype else stock.recipe), None


def workload_row(
    where: Path,
    suite: str,
    stage_times: dict[str, float] | None,
    target: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """One workload's row from its artifacts. Every figure of a variant or pair the run did not
    time (the stock baseline where it was not measured, or torch.compile where it failed on a
    model) is None. ``target`` is (ms, ratio over torch.compile), the examples' alone: a row
    without one (a model's) has None for both, and neither ``meets_target`` nor
    ``shortfall``."""
    base = read_artifact(_artifact(where, "profile.json"), Profile)
    opt = read_artifact(_artifact(where, "profile_optimized.json"), Profile)
    sel = read_artifact(
        _artifact(where / "profiler_output", "backend_selection.json"), BackendSelection
    )
    val = read_artifact(where / "profiler_output" / "validation_report.json", ValidationReport)
    v = opt.timing.variants
    sp = {(s.baseline, s.candidate): s for s in opt.timing.speedups}

    def ms(name: str) -> tuple[float | None, list[float] | None]:
        stats = v.get(name)
        return (stats.median_ms, [stats.ci_low_ms, stats.ci_high_ms]) if stats else (None, None)

    (eager_ms, eager_ci), (compile_ms, compile_ci) = ms("eager"), ms("compile")
    (stock_ms, stock_ci), (optimized_ms, optimized_ci) = ms("stock"), ms("optimized")
    vs_compile, vs_compile_ci = _speedup(sp.get(("compile", "optimized")))
    vs_stock, vs_stock_ci = _speedup(sp.get(("stock", "optimized")))
    recipe, stock_message = stock_recipe(where)
    target_ms, target_ratio = target if target is not None else (None, None)
    meets = None
    if target_ms is not None and target_ratio is not None and optimized_ms is not None:
        meets = optimized_ms <= target_ms or (vs_compile is not None and vs_compile >= target_ratio)
    row: dict[str, Any] = {
        "suite": suite,
        "eager_ms": eager_ms,
        "compile_ms": compile_ms,
        "optimized_ms": optimized_ms,
        "eager_ci_ms": eager_ci,
        "compile_ci_ms": compile_ci,
        "optimized_ci_ms": optimized_ci,
        "speedup_vs_compile": vs_compile,
        "speedup_vs_compile_ci": vs_compile_ci,
        "speedup_vs_eager": _speedup(sp.get(("eager", "optimized")))[0],
        "stock_ms": stock_ms,
        "stock_ci_ms": stock_ci,
        "speedup_vs_stock": vs_stock,
        "speedup_vs_stock_ci": vs_stock_ci,
        "stock_over_compile": _speedup(sp.get(("compile", "stock")))[0],
        "stock_recipe": recipe,
        "stock_message": stock_message,
        "dtype": sel.plan.dtype or "float32",
        "passes_kept": _in_effect(where, sel, val),
        "plan": sel.plan.proposals,
        "rel_error": val.numerics.rel_err if val.numerics else None,
        "validation": val.overall,
        "target_ms": target_ms,
        "target_ratio": target_ratio,
        "meets_target": meets,
        "compile_seconds": opt.timing.compile_seconds,
        "stage_seconds": stage_times,
        "counters": _counters(base),
        "source": str(where),
        "gpu_time": _gpu_time(base, opt),
        "child_seconds": child_seconds(where),
        "processes": _processes(opt),
    }
    # The shortfall is measured against the targets: a row without one (a model, or an
    # example not timed against torch.compile) has none to miss.
    row["shortfall"] = shortfall(row, opt) if meets is not None and vs_compile is not None else None
    return row


def _figures(rows: dict[str, Any], suite: str, key: str) -> list[float]:
    return [
        r[key]
        for r in rows.values()
        if r.get("suite", EXAMPLES) == suite and r.get(key) is not None
    ]


def summarize(folders: list[Path], junit_files: list[Path] | None = None) -> dict[str, Any]:
    """Rows for the seven examples (each listed, ``missing`` where its artifacts are not there)
    and for every other workload of the run (``discover``), and the geometric means of each
    suite's speedups. ``geomean_speedup_vs_compile`` is the examples' alone, as in runs before
    the real-model suite, so that the figure keeps its meaning across runs. A call that ran
    models and no example at all (no example's folder in any OUT_DIR) lists no examples."""
    stages = stage_seconds(junit_files or [])
    others = discover(folders)
    ran_examples = any(
        (f / name).is_dir() or (f / "examples" / name).is_dir() for f in folders for name in TARGETS
    )
    rows: dict[str, Any] = {}
    workloads: list[tuple[str, str, Path | None, tuple[float, float] | None]] = []
    if ran_examples or not others:
        for name, target in TARGETS.items():
            found = next((p for f in folders if (p := _find(f, name))), None)
            workloads.append((name, EXAMPLES, found, target))
    workloads += [(name, MODELS, where, None) for name, where in others.items()]
    for name, suite, at, aim in workloads:
        if at is None:
            rows[name] = {"suite": suite, "status": "missing"}
        else:
            rows[name] = workload_row(at, suite, stages.get(name), aim)
    below = [
        n
        for n, r in rows.items()
        if r.get("speedup_vs_stock_ci") and r["speedup_vs_stock_ci"][1] < 1.0
    ]
    return {
        "workloads": rows,
        "geomean_speedup_vs_compile": geomean(_figures(rows, EXAMPLES, "speedup_vs_compile")),
        "geomean_speedup_vs_stock": geomean(_figures(rows, EXAMPLES, "speedup_vs_stock")),
        "models_geomean_speedup_vs_compile": geomean(_figures(rows, MODELS, "speedup_vs_compile")),
        "models_geomean_speedup_vs_stock": geomean(_figures(rows, MODELS, "speedup_vs_stock")),
        # the workloads the stock baseline beat beyond the timing's noise
        "stock_below_one": below,
    }


def _times(ratio: float | None, ci: list[float] | None) -> str:
    """A speedup with its 95% CI (``2.74× (1.81–4.16)``), or — where the pair was not timed."""
    if ratio is None or not ci:
        return "—"
    return f"{ratio:.2f}× ({ci[0]:.2f}–{ci[1]:.2f})"


def _err(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def _geomeans(compile_gm: float | None, stock_gm: float | None, rows: list[dict[str, Any]]) -> str:
    """The geometric means over torch.compile and over the stock baseline, in words; the one
    over the stock baseline says how many workloads it averages where some were not timed
    against it (the two are then over different workloads)."""
    if compile_gm is None:
        return ""
    line = f"over torch.compile: {compile_gm:.2f}×"
    if stock_gm is not None:
        timed = [r for r in rows if r.get("speedup_vs_compile") is not None]
        n = sum(r.get("speedup_vs_stock") is not None for r in timed)
        part = f" ({n} of {len(timed)} workloads)" if n < len(timed) else ""
        line += f"; over the stock baseline: {stock_gm:.2f}×{part}"
    return line


def markdown(result: dict[str, Any]) -> str:
    every = result["workloads"]
    suites: dict[str, dict[str, Any]] = {EXAMPLES: {}, MODELS: {}}
    for name, r in every.items():  # a summary written before suites: all examples
        suites[r.get("suite", EXAMPLES)][name] = r
    examples, models = suites[EXAMPLES], suites[MODELS]
    # A run that measured no stock baseline keeps the examples' table as it always was.
    stock = any(r.get("speedup_vs_stock") is not None for r in every.values())
    lines: list[str] = []
    if examples:
        lines += [
            "| workload | eager ms | compile ms | optimized ms | × compile (95% CI) | "
            + ("× stock (95% CI) | " if stock else "")
            + "target ms / × | meets | dtype | rel. error | in effect |",
            "|---|---|---|---|---|" + ("---|" if stock else "") + "---|---|---|---|---|",
        ]
    timed = {n: r["stage_seconds"] for n, r in every.items() if r.get("stage_seconds")}
    for name, r in examples.items():
        vs_stock = f"{_times(r.get('speedup_vs_stock'), r.get('speedup_vs_stock_ci'))} | "
        if "optimized_ms" not in r:
            lines.append(f"| {name} | — | — | — | — | {'— | ' if stock else ''}— | missing | | | |")
            continue
        meets = r["meets_target"]
        lines.append(
            f"| {name} | {_ms(r['eager_ms'])} | {_ms(r['compile_ms'])} | "
            f"{_ms(r['optimized_ms'])} | "
            f"{_times(r['speedup_vs_compile'], r['speedup_vs_compile_ci'])} | "
            + (vs_stock if stock else "")
            + f"{r['target_ms']} / {r['target_ratio']}× | "
            f"{'—' if meets is None else 'yes' if meets else 'no'} | {r['dtype']} | "
            f"{_err(r['rel_error'])} | {', '.join(r['passes_kept']) or '—'} |"
        )
    if examples:
        said = _geomeans(
            result["geomean_speedup_vs_compile"],
            result.get("geomean_speedup_vs_stock"),
            list(examples.values()),
        )
        lines.append("")
        lines.append(f"Geometric mean {said}" if said else "")
    if models:
        lines += [
            "",
            "Real-model suite (benchmarks/models; no hand-tuned targets: each held to "
            "torch.compile and to the stock baseline, the faster stock recipe whose outputs "
            "pass the validator):",
            "",
            "| workload | eager ms | compile ms | stock ms | optimized ms | × compile (95% CI) | "
            "× stock (95% CI) | dtype | rel. error | in effect |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in models.items():
            if "optimized_ms" not in r:
                lines.append(f"| {name} | missing | — | — | — | — | — | | | |")
                continue
            lines.append(
                f"| {name} | {_ms(r['eager_ms'])} | {_ms(r['compile_ms'])} | "
                f"{_ms(r.get('stock_ms'))} | {_ms(r['optimized_ms'])} | "
                f"{_times(r['speedup_vs_compile'], r['speedup_vs_compile_ci'])} | "
                f"{_times(r.get('speedup_vs_stock'), r.get('speedup_vs_stock_ci'))} | "
                f"{r['dtype']} | {_err(r['rel_error'])} | {', '.join(r['passes_kept']) or '—'} |"
            )
        said = _geomeans(
            result.get("models_geomean_speedup_vs_compile"),
            result.get("models_geomean_speedup_vs_stock"),
            list(models.values()),
        )
        if said:
            lines += ["", f"Real-model suite, geometric mean {said}."]
    recipes = {
        n: r.get("stock_recipe") or f"none passed ({r['stock_message']})"
        for n, r in every.items()
        if r.get("stock_recipe") or r.get("stock_message")
    }
    if recipes:
        lines += [
            "",
            "Stock baseline recipe: "
            + "; ".join(f"{n}, {how}" for n, how in recipes.items())
            + ".",
        ]
    below = result.get("stock_below_one") or []
    if below:
        lines += [
            "",
            "Slower than the stock baseline (the 95% CI over stock wholly below 1×): "
            + ", ".join(below)
            + ".",
        ]
    missed = {n: r for n, r in result["workloads"].items() if r.get("shortfall")}
    if missed:
        lines += [
            "",
            "Where neither target is met, by how much and what the optimized timeline says:",
            "",
        ]
        lines += [_shortfall_line(n, r) for n, r in missed.items()]
    agree = {n: r["gpu_time"] for n, r in result["workloads"].items() if r.get("gpu_time")}
    if agree:
        pooled = any(g.get("own_ms") is not None for per in agree.values() for g in per.values())
        lines += [
            "",
            "GPU time per call (ms): the timing pass (CUDA events, no profiler) as latency, and "
            "as GPU time with the host hidden (calls queued behind a GPU sleep), beside the "
            "timeline's kernel time (sum) and busy time (union of kernel intervals) per "
            "iteration. kernel sum / GPU time near 1: the timeline saw the call's kernels and "
            "only those (busy / GPU time where kernels overlap: a sum counts concurrent kernels "
            "twice); busy / latency near 1: the GPU never waited on the host"
            + (
                ". The latency is pooled over the timing processes; the timeline, the GPU time "
                "and the latency of their process alone are the recapture's:"
                if pooled
                else ":"
            ),
            "",
            "| workload | timeline | latency | "
            + ("its process | " if pooled else "")
            + "GPU time | kernel sum | busy | kernel sum / GPU time | busy / GPU time | "
            "busy / latency |",
            "|---|---|---|" + ("---|" if pooled else "") + "---|---|---|---|---|---|",
        ]
        for name, per in agree.items():
            for label, g in per.items():
                busy, gpu = g["busy_ms"], g.get("gpu_ms")
                own = f"{_ms(g.get('own_ms'))} | " if pooled else ""
                lines.append(
                    f"| {name} | {label} | {g['timing_ms']:.3f} | {own}{_ms(gpu)} | "
                    f"{g['kernel_ms']:.3f} | {_ms(busy)} | {_ratio(g['kernel_ms'], gpu)} | "
                    f"{_ratio(busy, gpu)} | {_ratio(busy, g['timing_ms'])} |"
                )
    procs = {n: r["processes"] for n, r in result["workloads"].items() if r.get("processes")}
    if procs:
        lines += [
            "",
            "The recapture's timing processes, in order (ms: each one's medians; CPU share: the "
            "launching thread's CPU time over each round's wall time, median and lowest, with "
            "its involuntary context switches over the rounds; the host while it timed, from "
            "/proc/stat: CPUs' worth busy on its own CPUs and on the others, and stolen by the "
            "hypervisor; host reference: the median µs per call of the fixed CPU work timed "
            "at each round's start, and the rounds set aside as run on a slowed host):",
            "",
            "| workload | # | eager | compile | optimized | compile CPU share (lowest) | "
            "switches | own CPUs busy | other CPUs busy | stolen | host reference µs | set aside |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, rows in procs.items():
            for i, p in enumerate(rows, start=1):
                share = p.get("compile_cpu_share")
                shown = f"{share:.2f} ({p['compile_cpu_share_min']:.2f})" if share else "—"
                h = p.get("host")
                host = (
                    f"{h['own_busy']:.2f} of {h['own_cpus']} | "
                    f"{h['other_busy']:.2f} of {h['other_cpus']} | "
                    f"{h['own_steal'] + h['other_steal']:.2f}"
                    if h
                    else "— | — | —"
                )
                lines.append(
                    f"| {name} | {i} | {_ms(p.get('eager_ms'))} | {_ms(p.get('compile_ms'))} | "
                    f"{_ms(p.get('optimized_ms'))} | {shown} | "
                    f"{p.get('compile_preempted', '—')} | {host} | "
                    + f"{_us(p.get('host_us'))} | {p.get('set_aside', '—')} |"
                )
    counted = {n: r["counters"] for n, r in result["workloads"].items() if r.get("counters")}
    if counted:
        lines += [
            "",
            "Counters (Nsight Compute, one process per workload): seconds, replay mode, share of "
            "kernel time with counters (replayed launches + launches of the same configuration), "
            "and the longest eager GEMM's DRAM bytes against the bytes its shapes imply:",
            "",
            "| workload | ncu s | replay | eager coverage (replayed) | compiled coverage "
            "(replayed) | longest GEMM | DRAM / implied |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, ct in counted.items():
            cells = []
            for label in ("eager", "compiled"):
                e = ct.get(label) or {}
                cov, rep = e.get("time_coverage"), e.get("time_coverage_replayed")
                shown = f"{cov:.1%}" if cov is not None else "—"
                cells.append(f"{shown} ({rep:.1%})" if rep is not None else shown)
            g = ct.get("largest_gemm") or {}
            ratio = g.get("ratio")
            dram = (
                f"{g['dram_bytes'] / 1e6:.3g} / {g['implied_bytes'] / 1e6:.3g} MB = {ratio:.2f}"
                if ratio is not None
                else "—"
            )
            secs = ct.get("seconds")
            lines.append(
                f"| {name} | {secs if secs is not None else '—'} | {ct.get('replay') or '—'} | "
                f"{cells[0]} | {cells[1]} | {g.get('operator', '—')} | {dram} |"
            )
    children = {
        n: r["child_seconds"] for n, r in result["workloads"].items() if r.get("child_seconds")
    }
    if children:
        names = ["capture", "counters", "stock", "backend", "validate", "recapture", "retime"]
        alone = any("alone" in st for st in children.values())
        warmed = any("stock_warm" in st for st in children.values())
        if warmed:
            names.insert(names.index("stock") + 1, "stock_warm")
        if any("validate_tests" in st for st in children.values()):
            names.insert(names.index("validate") + 1, "validate_tests")
        lines += [
            "",
            "Stage children's own time (s, from their logs; counters is the Nsight Compute pass, "
            "inside capture or in its own process beside the later stages, stock the stock "
            "baseline's task (--opprof-stock), beside "
            "selection or before it, "
            + ("stock_warm the process that compiles its last recipe beside it, " * warmed)
            + (
                "validate_tests the generated tests' process beside validation's, "
                * ("validate_tests" in names)
            )
            + "retime the recapture's extra timing processes summed, "
            "which run "
            "beside the recapture where they start together; waiting, the part of all of it "
            "spent waiting for the GPU's lock"
            + ("; alone, the part spent holding it exclusively, measuring" if alone else "")
            + "; the stage JUnit below adds the parent's share):",
            "",
            "| workload | "
            + " | ".join(names)
            + " | sum | waiting |"
            + (" alone |" if alone else ""),
            "|---|" + "---|" * (len(names) + 2 + alone),
        ]
        totals = {"sum": 0.0, "waiting": 0.0, "alone": 0.0}
        for name, st in children.items():
            cells = [f"{st[n]:.1f}" if n in st else "—" for n in names]
            total = sum(v for k, v in st.items() if k not in ("counters", "waiting", "alone"))
            extra = [st.get("waiting")] + ([st.get("alone")] if alone else [])
            shown = " | ".join(f"{v:.1f}" if v is not None else "—" for v in extra)
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {total:.1f} | {shown} |")
            totals["sum"] += total
            totals["waiting"] += st.get("waiting", 0.0)
            totals["alone"] += st.get("alone", 0.0)
        if totals["waiting"]:
            lines += [
                "",
                f"All stage processes: {totals['sum']:,.0f} process-seconds, "
                f"{totals['waiting']:,.0f} of them waiting for the GPU"
                + (
                    f" and {totals['alone']:,.0f} with it to themselves (measuring: no sharing "
                    "overlaps these)."
                    if alone
                    else "."
                ),
            ]
    if timed:
        names = ["capture", "propose", "backend", "validate", "recapture", "speedup"]
        lines += ["", "Pipeline wall time per stage (s, from the stage JUnit):", ""]
        lines.append("| workload | " + " | ".join(names) + " | total |")
        lines.append("|---|" + "---|" * (len(names) + 1))
        for name, st in timed.items():
            cells = [f"{st[n]:.1f}" if n in st else "—" for n in names]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {sum(st.values()):.1f} |")
    return "\n".join(lines) + "\n"


def compare(first: dict[str, Any], second: dict[str, Any], names: tuple[str, str]) -> str:
    """Two runs' results side by side (two ``summarize`` JSONs): each speedup over
    torch.compile with its CI, the change, whether the CIs overlap and the ratios agree within
    3%, and the optimized latencies."""
    a_name, b_name = names

    def host(row: dict[str, Any]) -> float | None:
        """The median host reference over the recapture's timing processes (µs per call)."""
        refs = [p["host_us"] for p in row.get("processes", []) if "host_us" in p]
        return statistics.median(refs) if refs else None

    hosts = any(host(r) is not None for r in first["workloads"].values())
    lines = [
        f"| workload | {a_name} × compile (CI) | {b_name} × compile (CI) | change | CIs overlap "
        f"| within ±3% | optimized ms {a_name} / {b_name} |"
        + (" host reference µs |" if hosts else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if hosts else ""),
    ]
    overlap = close = 0
    # A row without the figure (missing, or a model torch.compile failed on) is not compared.
    timed = [
        n
        for n in first["workloads"]
        if all(
            run["workloads"].get(n, {}).get("speedup_vs_compile") is not None
            and run["workloads"][n].get("speedup_vs_compile_ci")
            for run in (first, second)
        )
    ]
    untimed = [n for n in {**first["workloads"], **second["workloads"]} if n not in timed]
    for name in timed:
        a, b = first["workloads"][name], second["workloads"][name]
        (alo, ahi), (blo, bhi) = a["speedup_vs_compile_ci"], b["speedup_vs_compile_ci"]
        change = b["speedup_vs_compile"] / a["speedup_vs_compile"] - 1.0
        overlaps, within = alo <= bhi and blo <= ahi, abs(change) <= 0.03
        overlap, close = overlap + overlaps, close + within
        lines.append(
            f"| {name} | {a['speedup_vs_compile']:.2f}× ({alo:.2f}–{ahi:.2f}) | "
            f"{b['speedup_vs_compile']:.2f}× ({blo:.2f}–{bhi:.2f}) | {change * 100:+.1f}% | "
            f"{'yes' if overlaps else 'no'} | {'yes' if within else 'no'} | "
            f"{a['optimized_ms']:.4f} / {b['optimized_ms']:.4f} |"
            + (f" {_us(host(a))} / {_us(host(b))} |" if hosts else "")
        )
    lines += [
        "",
        f"CIs overlap for {overlap} of {len(timed)}; ratios within ±3% for {close} of "
        f"{len(timed)}.",
    ]
    if untimed:
        lines += ["", f"Not timed against torch.compile in both runs: {', '.join(untimed)}."]
    if hosts:
        lines += [
            "",
            "Host reference: the median over the recapture's timing processes of the fixed CPU "
            "work timed at each round's start (µs per call; capture.timing.host_reference_us). "
            "A launch-bound torch.compile baseline (its host path longer than its GPU time) "
            "moves with it.",
        ]
    return "\n".join(lines) + "\n"


def table_and_geomean(summary: Path) -> tuple[str, str]:
    """A summary.md's table of the workloads (it ends at the first blank line) and its
    geometric-mean line."""
    lines = summary.read_text(encoding="utf-8").splitlines()
    table = "\n".join(lines[: lines.index("")])
    geomean = next(line for line in lines if line.startswith("Geometric mean"))
    return table, geomean.rstrip(".")


README_RUN = re.compile(r"\]\((benchmarks/results/[^)/]+)/?\)")


def readme_differs(readme: Path) -> str | None:
    """Where the README's results table or geometric mean is not that of the committed summary
    of the one run it links (``benchmarks/results/<session>/summary.md``, as this script wrote
    it), what differs, in words; None where they match. So the README shows no figure that no
    run produced."""
    text = readme.read_text(encoding="utf-8")
    runs = sorted(set(README_RUN.findall(text)))
    if len(runs) != 1:
        return f"{readme}: links {len(runs)} runs under benchmarks/results ({runs}); link one"
    summary = readme.parent / runs[0] / "summary.md"
    if not summary.is_file():
        return f"{readme}: links {runs[0]}, which has no summary.md"
    try:
        table, geomean = table_and_geomean(summary)
    except (ValueError, StopIteration):
        return f"{summary}: no table and geometric-mean line as summarize.py writes them"
    if table not in text:
        return f"{readme}: its results table is not {summary}'s; copy it from there"
    if geomean not in text:
        return f"{readme}: its geometric mean is not {summary}'s ({geomean!r})"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument(
        "--junit", type=Path, nargs="*", default=[], help="stage JUnit files of the calls"
    )
    parser.add_argument(
        "--compare",
        type=Path,
        nargs=2,
        metavar=("FIRST", "SECOND"),
        help="print two runs' summary JSONs side by side instead",
    )
    parser.add_argument(
        "--check-readme",
        type=Path,
        metavar="README",
        help="check that README's results table is the committed summary of the run it links",
    )
    args = parser.parse_args()
    if args.check_readme:
        differs = readme_differs(args.check_readme)
        if differs:
            raise SystemExit(differs)
        print(f"{args.check_readme}: its results table is its linked run's summary")
        return
    if args.compare:
        runs = []
        for path in args.compare:
            try:
                runs.append(read_summary(path))
            except (OSError, ValueError) as exc:
                parser.error(f"{path}: not a summary JSON ({exc}); pass two summary.json files")
        names = (args.compare[0].parent.name, args.compare[1].parent.name)
        print(compare(runs[0], runs[1], names))
        return
    if not (args.folders and args.json and args.md):
        parser.error("give the run's folders, --json and --md (or --compare FIRST SECOND)")
    result = summarize(args.folders, args.junit)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    args.md.write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
