"""The counters pass on the CPU: ncu detection, sudo, the command line, the raw-CSV parser in
base units, the exact join, error notes and the aggregation math. The CSV files under
tests/data/ncu/ are synthetic (see their README)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof.capture import counters as c
from pytest_opprof.capture import ncu_metrics as nm
from pytest_opprof.schema import (
    ChildSpec,
    KernelRecord,
    OperatorAggregate,
    OperatorRecord,
    Timeline,
    TimelineSummary,
)
from pytest_opprof.stages.capture import task_counters_target

ROOT = Path(__file__).parents[2]
DATA = ROOT / "tests" / "data" / "ncu"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1_execute_"
GEMM += "segment_k_off_kernel__5x_cublas"
ATEN = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
    "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)"
)


def _timeline(names: list[str] | None = None) -> list[KernelRecord]:
    names = names or [
        "triton_poi_fused_add_1",
        "triton_poi_fused_add_10",
        ATEN,
        "triton_poi_fused_add_1",
        GEMM,
    ]
    durations = {"triton_poi_fused_add_1": 2.1, "triton_poi_fused_add_10": 1.6, ATEN: 1.1}
    return [
        KernelRecord(name=n, duration_us=durations.get(n, 51.0), start_us=10.0 * i)
        for i, n in enumerate(names)
    ]


def _result(name: str = "synthetic_base_units.csv") -> nm.CountersResult:
    log = (DATA / name).read_text(encoding="utf-8")
    return c.parse_run(0, log, "", _timeline())


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# -------------------------------------------------------------------------------- detection


def test_find_ncu_prefers_path(tmp_path: Path) -> None:
    on_path = _exe(tmp_path / "bin" / "ncu")
    _exe(tmp_path / "opt" / "2025.3.1" / "ncu")
    found = c.find_ncu(str(tmp_path / "bin"), (str(tmp_path / "opt" / "*" / "ncu"),))
    assert found == str(on_path)


def test_find_ncu_falls_back_to_newest_install(tmp_path: Path) -> None:
    _exe(tmp_path / "opt" / "2024.1.0" / "ncu")
    newest = _exe(tmp_path / "opt" / "2025.3.1" / "ncu")
    found = c.find_ncu(str(tmp_path / "empty"), (str(tmp_path / "opt" / "*" / "ncu"),))
    assert found == str(newest)


def test_find_ncu_none(tmp_path: Path) -> None:
    assert c.find_ncu(str(tmp_path), (str(tmp_path / "nothing" / "ncu"),)) is None


@pytest.mark.reliability
def test_run_counters_without_ncu_is_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(c, "find_ncu", lambda: None)
    result = c.run_counters_many({}, {"eager": _timeline()}, work_dir=tmp_path)["eager"]
    assert result.metrics == []
    assert result.note is not None and "ncu" in result.note and "\n" not in result.note


# ------------------------------------------------------------------------------------- sudo


@pytest.mark.parametrize(
    ("text", "euid", "expected"),
    [
        ("RmProfilingAdminOnly: 1\nRmGpuComputeExecTimeout: 0\n", 1000, True),
        ("RmProfilingAdminOnly: 0\n", 1000, False),
        ("RmProfilingAdminOnly: 1\n", 0, False),
        ("EnableMSI: 1\n", 1000, False),
    ],
)
def test_sudo_auto_reads_params(tmp_path: Path, text: str, euid: int, expected: bool) -> None:
    params = tmp_path / "params"
    params.write_text(text, encoding="utf-8")
    assert c.needs_sudo("auto", params, euid=euid) is expected


@pytest.mark.reliability
def test_sudo_explicit_and_unreadable(tmp_path: Path) -> None:
    assert c.needs_sudo("true", tmp_path / "missing", euid=0) is True
    assert c.needs_sudo("false", tmp_path / "missing", euid=1000) is False
    assert c.needs_sudo("auto", tmp_path / "missing", euid=1000) is False


# ---------------------------------------------------------------------------------- command


def test_command_replays_one_iteration(tmp_path: Path) -> None:
    cmd = c.build_command(
        "/opt/ncu",
        tmp_path / "spec.json",
        kernels_per_iteration=40,
        log_file=tmp_path / "ncu.log",
        metrics=["gpu__time_duration.sum", "dram__bytes_read.sum"],
        clock_control="base",
        python="/venv/bin/python",
        labels=("eager", "compiled"),
    )
    assert cmd[0] == "/opt/ncu"

    def arg(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    # one range per label, both included, in one process
    includes = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--nvtx-include"]
    assert "--nvtx" in cmd and includes == ["opprof_iteration_eager/", "opprof_iteration_compiled/"]
    assert arg("--launch-count") == "80"
    assert "--launch-skip" not in cmd and "--filter-mode" not in cmd
    assert arg("--clock-control") == "base"
    assert arg("--print-units") == "base"
    assert "--csv" in cmd and arg("--page") == "raw"
    assert arg("--print-kernel-base") == "demangled"
    assert arg("--metrics") == "gpu__time_duration.sum,dram__bytes_read.sum"
    assert arg("--log-file") == str(tmp_path / "ncu.log")
    assert cmd[-4:] == [
        "/venv/bin/python",
        "-m",
        "pytest_opprof.runner",
        str(tmp_path / "spec.json"),
    ]


def test_command_unique_replays_each_launch_configuration_once(tmp_path: Path) -> None:
    cmd = c.build_command(
        "ncu", tmp_path, kernels_per_iteration=500, log_file=tmp_path, metrics=[], unique=True
    )
    i = cmd.index("--filter-mode")
    assert cmd[i : i + 4] == ["--filter-mode", "per-launch-config", "--launch-count", "1"]
    assert cmd.count("--launch-count") == 1


def test_command_bound_small_iteration_and_bad_clock(tmp_path: Path) -> None:
    assert c.launch_bound(3) == 19
    with pytest.raises(ValueError, match="none or base"):
        c.build_command(
            "ncu", tmp_path, kernels_per_iteration=1, log_file=tmp_path, metrics=[],
            clock_control="max",
        )  # fmt: skip


def _through_sudo(tmp_path: Path, env: dict[str, str]) -> list[str]:
    """ncu's command for a target run through sudo, in environment ``env``."""
    return c.build_command(
        "/opt/ncu",
        tmp_path / "spec.json",
        kernels_per_iteration=2,
        log_file=tmp_path / "log",
        metrics=["gpu__time_duration.sum"],
        sudo=True,
        env=env,
    )


def test_command_through_sudo_passes_the_environment(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/local/cuda/bin:/usr/bin",
        "PYTHONPATH": "/extra",
        "CUDA_VISIBLE_DEVICES": "1",
    }
    cmd = _through_sudo(tmp_path, env)
    assert cmd[:4] == ["sudo", "-n", "-E", "env"]
    assert "PATH=/usr/local/cuda/bin:/usr/bin" in cmd
    pythonpath = next(a for a in cmd if a.startswith("PYTHONPATH="))
    root = str(Path(c.__file__).resolve().parents[2])
    assert pythonpath == f"PYTHONPATH={root}:/extra"
    assert "CUDA_VISIBLE_DEVICES=1" in cmd
    assert cmd.index("/opt/ncu") == 7


def test_sudo_keeps_the_own_cpus_flag_for_the_targets_compile(tmp_path: Path) -> None:
    """Through sudo the target still knows its CPUs are its own, so its compile goes off the
    GPU (``task_counters_target``)."""
    from pytest_opprof import devicelock

    cmd = _through_sudo(tmp_path, {"PATH": "/usr/bin", devicelock.OWN_CPUS_ENV: "1"})
    assert f"{devicelock.OWN_CPUS_ENV}=1" in cmd[: cmd.index("/opt/ncu")]


def test_requested_metrics_filters_by_chip() -> None:
    everything = c.requested_metrics()
    assert len(everything) == len(set(everything))
    assert "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active" in everything
    some = c.requested_metrics({"gpu__time_duration", "dram__bytes_read"})
    assert some == ["gpu__time_duration.sum", "dram__bytes_read.sum"]


# ---------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("value", "unit", "expected"),
    [
        ("2.5", "usecond", 2500.0),
        ("3", "msecond", 3e6),
        ("1,234", "nsecond", 1234.0),
        ("1.5", "Kbyte", 1500.0),
        ("2", "Mbyte", 2e6),
        ("2", "MB", 2e6),
        ("1", "Gbyte", 1e9),
        ("1.5", "Gbyte/second", 1.5e9),
        ("3", "Mbyte/usecond", 3e12),
        ("2", "inst/cycle", 2.0),
        ("87.5", "%", 87.5),
        ("12", "cycle", 12.0),
        ("n/a", "%", None),
        ("", "byte", None),
    ],
)
def test_to_base(value: str, unit: str, expected: float | None) -> None:
    got = nm.to_base(value, unit)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_parse_skips_prof_lines_and_reads_units() -> None:
    rows, header = nm.parse_raw_csv((DATA / "synthetic_base_units.csv").read_text())
    assert [r.id for r in rows] == [0, 1, 2, 3, 4]
    assert rows[1].name == "triton_poi_fused_add_10"
    assert rows[0].values["gpu__time_duration.sum"] == 2000.0
    assert "Kernel Name" not in header and "gpu__time_duration.sum" in header


def test_other_units_parse_to_the_same_base_values() -> None:
    base, _ = nm.parse_raw_csv((DATA / "synthetic_base_units.csv").read_text())
    auto, _ = nm.parse_raw_csv((DATA / "synthetic_auto_units.csv").read_text())
    for a, b in zip(auto, base, strict=True):
        for metric, value in b.values.items():
            assert a.values[metric] == pytest.approx(value), metric


def test_missing_metric_is_none_and_fallback_is_used() -> None:
    result = _result()
    assert result.note is None
    assert result.resolved["warp_cycles_per_issued"] is None
    assert result.resolved["tensor_active_pct"] == (
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    )
    first = result.metrics[0].metrics
    assert first["warp_cycles_per_issued"] is None
    assert first["tensor_active_pct"] == 60.0


# ------------------------------------------------------------------------------------- join


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("triton_poi_fused_add_10", "triton_poi_fused_add_10"),
        (ATEN, "vectorized_elementwise_kernel"),
        ("void (anonymous namespace)::softmax_warp_forward<float, 4>(float*, int)",
         "softmax_warp_forward"),
        ("at::native::vectorized_elementwise_kernel<4, X<(int)1> >",
         "vectorized_elementwise_kernel"),
        # The same kernel as CUPTI and as ncu 2025.3.1 named it on the H200.
        ("void at::native::(anonymous namespace)::max_pool_forward_nchw<float, int>(int, float "
         "const*, long, long, long, int, int, int, int, int, int, int, int, int, int, float*, "
         "long*)", "max_pool_forward_nchw"),
        ("void at::<unnamed>::max_pool_forward_nchw<float, int>(T2, const T1 *, long, long, long, "
         "int, int, int, int, int, int, int, int, int, int, T1 *, long *)",
         "max_pool_forward_nchw"),
    ],
)  # fmt: skip
def test_kernel_key(name: str, key: str) -> None:
    assert nm.kernel_key(name) == key


def test_join_is_exact_for_prefix_names() -> None:
    result = _result()
    assert result.warnings == []
    assert [k.index for k in result.metrics] == [0, 1, 2, 3, 4]
    assert [k.ncu_id for k in result.metrics] == [0, 1, 2, 3, 4]
    # add_10 keeps its own row, never add_1's
    assert result.metrics[1].metrics["gpu_time_ns"] == 1500.0
    assert result.metrics[0].metrics["gpu_time_ns"] == 2000.0
    assert result.metrics[3].metrics["gpu_time_ns"] == 2000.0
    gemm = result.metrics[4].metrics
    assert gemm["dram_bytes"] == 125_000_000
    assert gemm["flops"] == 3_000_000_000 + 2 * 1000


def test_count_mismatch_warns_and_never_shifts() -> None:
    log = (DATA / "synthetic_mismatch.csv").read_text()
    result = c.parse_run(0, log, "", _timeline())
    assert len(result.warnings) == 1
    warning = result.warnings[0]
    assert "'triton_poi_fused_add_10'" in warning and "1x" in warning and "2x" in warning
    assert [k.index for k in result.metrics] == [0, 2, 3, 4]
    # the later kernels keep their own rows (ids 2, 3, 4), not the extra row's
    assert [k.ncu_id for k in result.metrics] == [0, 2, 3, 4]


def test_timeline_kernel_absent_under_ncu_warns() -> None:
    log = (DATA / "synthetic_base_units.csv").read_text()
    extra = KernelRecord(name="triton_red_fused_0", duration_us=3, start_us=0)
    timeline = [*_timeline()[:4], extra]
    result = c.parse_run(0, log, "", timeline)
    assert {w.split("'")[1] for w in result.warnings} == {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1_execute_"
        "segment_k_off_kernel__5x_cublas",
        "triton_red_fused_0",
    }


# ----------------------------------------------------------------------------------- errors


@pytest.mark.reliability
def test_permission_error_gives_the_fixes() -> None:
    output = (
        "==PROF== Connected to process 77\n"
        "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
        "Performance Counters on the target device 0.\n"
    )
    result = c.parse_run(1, "", output, _timeline())
    assert result.metrics == []
    assert result.note == c.PERMISSION_FIX
    assert "--opprof-ncu-sudo=true" in result.note
    assert "NVreg_RestrictProfilingToAdminUsers=0" in result.note


@pytest.mark.reliability
def test_other_failure_keeps_the_last_lines() -> None:
    output = "\n".join(f"line {i}" for i in range(20)) + "\n==ERROR== Failed to profile kernel\n"
    note = c.classify_failure(9, output)
    assert note is not None and "exit status 9" in note
    assert "Failed to profile kernel" in note and "line 19" in note and "line 3 " not in note


def test_no_kernels_in_range_is_a_note() -> None:
    result = c.parse_run(
        0, "==PROF== Disconnected\n==WARNING== No kernels were profiled.\n", "", _timeline()
    )
    assert result.note is not None and "opprof_iteration" in result.note


@pytest.mark.reliability
def test_sudo_password_prompt_is_a_note() -> None:
    note = c.classify_failure(1, "sudo: a password is required\n")
    assert note is not None and "password" in note


def test_run_counters_with_a_fake_ncu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole parent side with a stand-in ncu that writes the synthetic CSV to --log-file."""
    fake = tmp_path / "ncu"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys, shutil\n"
        "if '--query-metrics' in sys.argv: sys.exit(1)\n"
        "log = sys.argv[sys.argv.index('--log-file') + 1]\n"
        f"shutil.copy({str(DATA / 'synthetic_base_units.csv')!r}, log)\n"
        "print('[opprof] +    9.9 s  compiled: warmed up')\n",
        encoding="utf-8",
    )
    fake.chmod(0o755)
    result = c.run_counters_many(
        {"task": "capture", "workload": "w.py"},
        {"compiled": _timeline()},
        work_dir=tmp_path / "work",
        sudo_mode="false",
        ncu=str(fake),
    )["compiled"]
    assert result.note is None, result.note
    assert len(result.metrics) == 5
    spec = (tmp_path / "work" / "counters_target.json").read_text()
    assert '"task": "counters_target"' in spec and '"compiled"' in spec
    # what the target printed is kept beside ncu's log: where the pass's time went
    assert "compiled: warmed up" in (tmp_path / "work" / "target.log").read_text()


def test_unknown_metric_is_dropped_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "ncu"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys, shutil\n"
        "if '--query-metrics' in sys.argv: sys.exit(1)\n"
        "metrics = sys.argv[sys.argv.index('--metrics') + 1]\n"
        "if 'sm__ops_path_tensor_src_all' in metrics:\n"
        "    print('==ERROR== Failed to find metric sm__ops_path_tensor_src_all.sum')\n"
        "    sys.exit(1)\n"
        "log = sys.argv[sys.argv.index('--log-file') + 1]\n"
        f"shutil.copy({str(DATA / 'synthetic_base_units.csv')!r}, log)\n",
        encoding="utf-8",
    )
    fake.chmod(0o755)
    result = c.run_counters_many(
        {}, {"eager": _timeline()}, work_dir=tmp_path / "w", sudo_mode="false", ncu=str(fake)
    )["eager"]
    assert result.note is None, result.note
    assert (
        "sm__ops_path_tensor_src_all" not in result.command[result.command.index("--metrics") + 1]
    )
    assert len(result.metrics) == 5


@pytest.mark.reliability
def test_run_counters_timeout_is_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(*args: object, **kwargs: object) -> None:
        raise subprocess.TimeoutExpired("ncu", 1)

    monkeypatch.setattr(c, "query_available", lambda ncu, sudo=False: None)
    monkeypatch.setattr(c.subprocess, "run", slow)
    result = c.run_counters_many(
        {}, {"eager": _timeline()}, work_dir=tmp_path, sudo_mode="false", ncu="ncu", timeout=1
    )["eager"]
    assert result.note is not None and "over 1 s" in result.note


# ------------------------------------------------------------------------------ aggregation


def test_aggregation_sum_weighted_mean_max() -> None:
    kernels = nm.attach(_timeline(), _result(), None, "float32")
    op = kernels[:3]  # add_1 (2000 ns, 60 %), add_10 (1500 ns, 40 %), aten (1000 ns, 20 %)
    agg = nm.aggregate(op)
    assert agg["counter_coverage"] == pytest.approx(1.0)
    assert agg["gpu_time_ns"] == 4500.0
    assert agg["dram_bytes_read"] == 4_194_304 + 2_097_152 + 1_048_576
    assert agg["instructions"] == 190_000
    assert agg["dram_throughput_pct"] == pytest.approx((2000 * 60 + 1500 * 40 + 1000 * 20) / 4500)
    assert agg["ipc"] == pytest.approx((2000 * 0.5 + 1500 * 0.4 + 1000 * 0.3) / 4500)
    assert agg["registers_per_thread"] == 20
    assert agg["warp_cycles_per_issued"] is None


def test_aggregation_leaves_out_uncovered_kernels() -> None:
    log = (DATA / "synthetic_mismatch.csv").read_text()
    kernels = nm.attach(_timeline(), c.parse_run(0, log, "", _timeline()), None, "float32")
    agg = nm.aggregate(kernels[:2])  # add_10 has no counters
    assert agg["gpu_time_ns"] == 2000.0
    assert agg["counter_coverage"] == pytest.approx(2.1 / (2.1 + 1.6))
    assert nm.aggregate(kernels[1:2]) == {"counter_coverage": 0.0}


def test_roofline_per_kernel_and_operator() -> None:
    from pytest_opprof.knowledge import lookup_gpu

    match = lookup_gpu("NVIDIA H200", 132, (9, 0))
    assert match is not None
    spec = match.spec
    result = _result()
    kernels = nm.attach(_timeline(), result, spec, "bfloat16")
    gemm = kernels[4].metrics
    seconds = 50_000e-9
    assert gemm["achieved_bytes_per_s"] == pytest.approx(125_000_000 / seconds)
    assert gemm["achieved_flops_per_s"] == pytest.approx((3e9 + 2000) / seconds)
    assert gemm["arithmetic_intensity"] == pytest.approx((3e9 + 2000) / 125_000_000)
    assert result.metrics[4].bound in ("memory", "compute")
    add = kernels[0].metrics
    assert add["pct_of_peak_bw"] == pytest.approx(
        100 * (4_194_304 + 2_097_152) / 2000e-9 / spec.memory_bandwidth_bytes_per_s
    )
    agg = nm.aggregate(kernels[:3])
    assert "achieved_bytes_per_s" not in agg  # rates are recomputed, never averaged
    nm.add_roofline(agg, spec, "float32")
    nbytes = agg["dram_bytes"]
    assert nbytes is not None
    assert agg["achieved_bytes_per_s"] == pytest.approx(nbytes / 4500e-9)


def test_module_imports_no_torch() -> None:
    code = "import sys, pytest_opprof.capture.counters; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _full_timeline() -> Timeline:
    k = _timeline()
    memcpy = KernelRecord(name="Memcpy HtoD (Pageable -> Device)", duration_us=5, start_us=1.0)
    ops = [
        OperatorRecord(name="aten::add", call_index=0, cpu_time_us=9, gpu_time_us=2.1,
                       kernels=[k[0], memcpy]),
        OperatorRecord(name="aten::add", call_index=1, cpu_time_us=9, gpu_time_us=2.1,
                       kernels=[k[3]]),
        OperatorRecord(name="aten::mm", call_index=0, cpu_time_us=9, gpu_time_us=51,
                       kernels=[k[4]]),
        OperatorRecord(name="aten::mul", call_index=0, cpu_time_us=9, gpu_time_us=1.1,
                       kernels=[k[2]]),
    ]  # fmt: skip
    aggs = [
        OperatorAggregate(name=n, calls=1, cpu_time_us=9, gpu_time_us=1, share=0.1, kernel_count=1)
        for n in ("aten::add", "aten::mm", "aten::mul")
    ]
    summary = TimelineSummary(
        iterations=3,
        device_time_per_iter_us=60,
        wall_time_per_iter_us=70,
        idle_time_per_iter_us=10,
        kernels_per_iter=6,
        attributed_share=0.97,
        high_share=0.9,
    )
    return Timeline(
        label="compiled",
        compile_mode="torch.compile(backend='inductor')",
        summary=summary,
        operators=ops,
        aggregated=aggs,
        unattributed_kernels=[k[1]],
    )


def test_apply_to_timeline() -> None:
    from pytest_opprof.knowledge import lookup_gpu

    timeline = _full_timeline()
    kernels = nm.timeline_kernels(timeline)
    assert [k.start_us for k in kernels] == [0.0, 10.0, 20.0, 30.0, 40.0]  # no memcpy
    log = (DATA / "synthetic_base_units.csv").read_text()
    result = c.parse_run(0, log, "", kernels)
    match = lookup_gpu("NVIDIA H200", 132, (9, 0))
    assert match is not None
    out = nm.apply_to_timeline(timeline, result, match.spec, "float32")
    assert timeline.operators[0].kernels[0].metrics == {}  # the input is left alone
    assert out.unattributed_kernels[0].metrics["gpu_time_ns"] == 1500.0
    assert out.operators[0].kernels[1].metrics == {}  # memcpy has no counters
    add = next(a for a in out.aggregated if a.name == "aten::add")
    assert add.metrics["gpu_time_ns"] == 4000.0
    assert add.metrics["dram_bytes"] == 2 * (4_194_304 + 2_097_152)
    assert add.metrics["achieved_bytes_per_s"] == pytest.approx(add.metrics["dram_bytes"] / 4e-6)
    assert add.metrics["counter_coverage"] == 1.0  # the memcpy is not kernel time
    mm = next(a for a in out.aggregated if a.name == "aten::mm")
    assert mm.metrics["dynamic_shared_memory_bytes"] == 196608


def test_unknown_metric_match_is_exact() -> None:
    line = "==ERROR== Failed to find metric sm__ops_path_tensor_src_all.sum"
    got = c.unknown_metrics(line, ["sm__ops_path_tensor_src_all.sum", "sm__ops_path_tensor.sum"])
    assert got == {"sm__ops_path_tensor_src_all.sum"}


def test_other_labels_have_no_target(tmp_path: Path) -> None:
    results = c.run_counters_many({}, {"optimized": _timeline()}, work_dir=tmp_path, ncu="ncu")
    result = results["optimized"]
    assert result.note is not None and "optimized" in result.note


@pytest.mark.parametrize("label", ["eager", "compiled"])
def test_target_runs_one_call_inside_the_range(
    label: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target process, with CUDA stood in for: warmup outside the range, exactly one
    call inside it, synchronized before and after; compiled only for the compiled label."""
    import torch

    import pytest_opprof.workload as workload
    from pytest_opprof.options import OpprofOptions

    events: list[str] = []

    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            events.append("call")
            return x + 1

    class Range:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            events.append(f"push {self.name}")

        def __exit__(self, *exc: object) -> None:
            events.append("pop")

    loaded = workload.LoadedWorkload(
        path=tmp_path / "w.py", model=Model(), inputs=(torch.ones(2),), tuple_input=False,
        device="cuda",
    )  # fmt: skip
    monkeypatch.setattr(workload, "load", lambda path, device: loaded)
    monkeypatch.setattr("pytest_opprof.stages.common.setup_torch", lambda: events.append("setup"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(torch.cuda.nvtx, "range", Range)

    def compile_(model: Any, backend: str) -> Any:
        events.append(backend)
        return model

    monkeypatch.setattr(torch, "compile", compile_)
    spec = ChildSpec(
        task="counters_target",
        workload=str(tmp_path / "w.py"),
        options=OpprofOptions().to_child(),
        counters_label=label,
        counters_warmup=2,
    )
    task_counters_target(spec)
    compiled = ["inductor"] if label == "compiled" else []
    assert events == [
        "setup",
        *compiled,
        "call",
        "call",
        "sync",
        f"push opprof_iteration_{label}",
        "call",
        "pop",
        "sync",
    ]
    events.clear()
    task_counters_target(spec.model_copy(update={"counters_labels": ["eager", "compiled"]}))
    assert [e for e in events if e.startswith("push") or e == "inductor"] == [
        "push opprof_iteration_eager",
        "inductor",
        "push opprof_iteration_compiled",
    ]


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_the_target_holds_the_gpu_for_its_gpu_work_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given the GPU's lock (its parent holds nothing of it), the target joins it once torch
    is imported: its model loads and its replays run with the GPU shared, its compile goes off
    the GPU (``compile_off_gpu``), and a measurer waiting between two labels goes first."""
    import torch

    import pytest_opprof.workload as workload
    from pytest_opprof import devicelock
    from pytest_opprof.options import OpprofOptions
    from pytest_opprof.stages import common

    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.delenv(devicelock.LOCK_ENV, raising=False)
    path = tmp_path / "gpu.lock"
    events: list[tuple[str, str | None]] = []

    def held() -> str | None:
        return devicelock._LOCK.held if devicelock._LOCK is not None else None

    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    def load(path: Path, device: str) -> Any:
        events.append(("load", held()))
        return workload.LoadedWorkload(
            path=path, model=Model(), inputs=(torch.ones(2),), tuple_input=False, device="cuda"
        )

    monkeypatch.setattr(workload, "load", load)
    monkeypatch.setattr(common, "setup_torch", lambda: events.append(("setup", held())))
    monkeypatch.setattr(common, "compile_off_gpu", lambda d: events.append(("off gpu", d)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range", lambda name: _Replay(name, events, held))
    monkeypatch.setattr(torch, "compile", lambda model, backend: model)
    made_way: list[str | None] = []
    monkeypatch.setattr(devicelock, "make_way", lambda: made_way.append(held()))
    spec = ChildSpec(
        task="counters_target",
        workload=str(tmp_path / "w.py"),
        options=OpprofOptions().to_child(),
        counters_labels=["eager", "compiled"],
        counters_warmup=1,
        gpu_lock=str(path),
    )
    try:
        task_counters_target(spec)
        assert events == [
            ("setup", None),  # importing torch holds nothing of the GPU
            ("load", "shared"),
            ("replay opprof_iteration_eager", "shared"),
            ("off gpu", "cuda"),
            ("replay opprof_iteration_compiled", "shared"),
        ]
        assert made_way == ["shared", "shared"]
        assert devicelock.LOCK_ENV not in os.environ  # its compile workers work under its share
    finally:
        if devicelock._LOCK is not None:
            devicelock._LOCK.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


class _Replay:
    def __init__(self, name: str, events: list[Any], held: Any) -> None:
        self.name, self.events, self.held = name, events, held

    def __enter__(self) -> None:
        self.events.append((f"replay {self.name}", self.held()))

    def __exit__(self, *exc: object) -> None:
        pass


def _fake_ncu(tmp_path: Path, csv_name: str = "synthetic_base_units.csv") -> Path:
    fake = tmp_path / "bin" / "ncu"
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys, shutil\n"
        "if '--query-metrics' in sys.argv: sys.exit(1)\n"
        "log = sys.argv[sys.argv.index('--log-file') + 1]\n"
        f"shutil.copy({str(DATA / csv_name)!r}, log)\n",
        encoding="utf-8",
    )
    fake.chmod(0o755)
    return fake


def test_counters_for_capture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_opprof.options import OpprofOptions

    fake = _fake_ncu(tmp_path)
    monkeypatch.setattr(c, "find_ncu", lambda: str(fake))
    info = {"device_name": "NVIDIA H200", "sm_count": 132, "compute_capability": "9.0"}
    spec = {"out_dir": str(tmp_path / "out"), "workload": "w.py"}
    opts = OpprofOptions(ncu="auto", ncu_sudo="false")
    timelines, summary, warnings = c.counters_for_capture(
        spec, [_full_timeline()], info, opts, "float32"
    )
    assert warnings == []
    assert summary is not None
    assert summary["compiled"]["kernels_with_counters"] == 5
    assert summary["compiled"]["time_coverage"] == 1.0
    assert summary["compiled"]["resolved"]["warp_cycles_per_issued"] is None
    mm = next(a for a in timelines[0].aggregated if a.name == "aten::mm")
    assert mm.metrics["pct_of_roofline"] is not None
    assert (tmp_path / "out" / "profiler_output" / "ncu" / "ncu.log").exists()
    assert summary["replay"] == "all" and summary["seconds"] >= 0


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_the_capture_holds_nothing_of_the_gpu_while_ncu_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capture lets go of the GPU's lock for the counters pass and hands its target the
    lock file, which the target joins for its GPU work (the test above): ncu's start, the
    target's imports and ncu's report hold no measurer back."""
    from pytest_opprof import devicelock
    from pytest_opprof.options import OpprofOptions

    fake = _fake_ncu(tmp_path)
    path = tmp_path / "gpu.lock"
    seen = tmp_path / "free.txt"
    script = fake.read_text(encoding="utf-8").replace(
        "import sys, shutil\n",
        "import sys, shutil, fcntl\n"
        f"f = open({str(path)!r}, 'a')\n"
        "try:\n"
        "    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); free = 'free'\n"
        "except BlockingIOError:\n"
        "    free = 'held'\n"
        f"open({str(seen)!r}, 'w').write(free)\n"
        "fcntl.flock(f, fcntl.LOCK_UN)\n",
    )
    fake.write_text(script, encoding="utf-8")
    monkeypatch.setattr(c, "find_ncu", lambda: str(fake))
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join()
    assert lock is not None and lock.held == "shared"
    try:
        spec = {"out_dir": str(tmp_path / "out"), "workload": "w.py"}
        opts = OpprofOptions(ncu="auto", ncu_sudo="false")
        _, summary, _ = c.counters_for_capture(spec, [_full_timeline()], {}, opts, "float32")
        assert summary is not None and summary["compiled"]["kernels_with_counters"] == 5
        assert seen.read_text() == "free"  # nobody held the GPU while ncu ran
        target = tmp_path / "out" / "profiler_output" / "ncu" / "counters_target.json"
        assert json.loads(target.read_text())["gpu_lock"] == str(path)
        assert lock.held is None
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_one_replay_serves_timelines_with_the_same_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_opprof.options import OpprofOptions

    fake = _fake_ncu(tmp_path)
    runs: list[list[str]] = []
    real = c.run_counters_many

    def counting(spec: Any, kernels_by_label: Any, **kwargs: Any) -> Any:
        runs.append(list(kernels_by_label))
        return real(spec, kernels_by_label, **kwargs)

    monkeypatch.setattr(c, "run_counters_many", counting)
    monkeypatch.setattr(c, "find_ncu", lambda: str(fake))
    eager = _full_timeline().model_copy(update={"label": "eager"})
    opts = OpprofOptions(ncu="auto", ncu_sudo="false")
    spec = {"out_dir": str(tmp_path / "out"), "workload": "w.py"}
    timelines, summary, _ = c.counters_for_capture(
        spec, [eager, _full_timeline()], {}, opts, "float32"
    )
    assert runs == [["eager"]]
    assert summary is not None and summary["compiled"]["reused_from"] == "eager"
    assert summary["eager"]["reused_from"] is None and summary["seconds"] >= 0
    assert summary["compiled"]["kernels_with_counters"] == 5
    first, second = (t.operators[0].kernels[0].metrics for t in timelines)
    assert first == second


H200_NCU = sorted((DATA / "h200").glob("*.log"))
H200_RUN = ROOT / "tests" / "data" / "h200"
"""The profiles of the run those logs were captured in (h200-2026-12-02c/counters-n7)."""
PER_LABEL = DATA / "h200-per-label"
"""An earlier H200 run's logs, one ncu process per timeline (depthwise_separable_conv): the
raw rows the one-process tests below rebuild into ranges."""


def _label_logs() -> list[tuple[str, str, Path]]:
    """(workload, timeline label, log) for every real log: ``<name>.log`` holds every label's
    range (one ncu process), ``<name>.<label>.log`` one label (the earlier layout)."""
    from pytest_opprof.schema import Profile, read_artifact

    out = []
    for log in H200_NCU:
        name, _, label = log.stem.partition(".")
        if label:
            out.append((name, label, log))
            continue
        profile = read_artifact(H200_RUN / name / "profile.json.gz", Profile)
        out += [(name, t.label, log) for t in profile.timelines if t.label != "optimized"]
    return out


@pytest.mark.parametrize(
    ("name", "label", "log"), _label_logs(), ids=[f"{n}-{x}" for n, x, _ in _label_logs()]
)
def test_real_h200_ncu_output_joins_every_kernel(name: str, label: str, log: Path) -> None:
    """ncu 2025.3.1 on the H200 against the timeline of the same run (tests/data/h200/<name>/):
    every kernel of the iteration paired, by function name + ordinal + launch geometry (and,
    where the run replayed each launch configuration once, by configuration), though ncu names
    kernels with fewer namespaces than the profiler does."""
    from pytest_opprof.schema import Profile, read_artifact

    profile = read_artifact(H200_RUN / name / "profile.json.gz", Profile)
    timeline = next(t for t in profile.timelines if t.label == label)
    counters = profile.counters or {}
    entry = counters.get(label) or {}
    source = entry.get("reused_from") or label
    unique = counters.get("replay") == "unique"
    kernels = nm.timeline_kernels(timeline)
    text = log.read_text(encoding="utf-8")
    combined = "." not in log.stem
    result = c.parse_run(0, text, "", kernels, label=source if combined else None, unique=unique)
    assert result.note is None and result.warnings == []
    assert sorted(k.index for k in result.metrics) == list(range(len(kernels)))
    for joined in result.metrics:
        assert joined.metrics["gpu_time_ns"] is not None and joined.metrics["gpu_time_ns"] > 0
        assert joined.metrics["dram_bytes_read"] is not None
    # the profile committed from the run carries the same join
    assert [k.metrics.get("gpu_time_ns") for k in kernels] == [
        j.metrics["gpu_time_ns"] for j in result.metrics
    ]
    if combined:
        rows, _ = nm.parse_raw_csv(text)
        replayed = [k for k in result.metrics if k.source == "measured"]
        assert len(replayed) == len([r for r in rows if r.label == source])


def test_real_unique_replay_of_gpt2_and_the_lstm() -> None:
    """The H200 run replayed each launch configuration once for the two large workloads: 17 of
    gpt2's 317 eager launches, 10 of the LSTM's 535; every other launch carries its
    configuration's counters, marked so, and each replayed row is one configuration."""
    from pytest_opprof.schema import Profile, read_artifact

    for name, replayed in (("gpt2", 17), ("lstm_sequence_encoder", 10)):
        profile = read_artifact(H200_RUN / name / "profile.json.gz", Profile)
        assert profile.counters is not None and profile.counters["replay"] == "unique"
        eager = next(t for t in profile.timelines if t.label == "eager")
        kernels = nm.timeline_kernels(eager)
        sources = [k.counters_source for k in kernels]
        assert sources.count("measured") == replayed
        assert sources.count("same_launch_config") == len(kernels) - replayed
        rows, _ = nm.parse_raw_csv((DATA / "h200" / f"{name}.log").read_text(encoding="utf-8"))
        configs = {
            (nm.kernel_key(r.name), str(r.grid), str(r.block), r.shared_memory) for r in rows
        }
        assert len(configs) == len(rows)


def test_real_h200_ncu_names_differ_from_the_profiler() -> None:
    """Why the key drops namespaces: the same max-pool kernel as each side named it."""
    ncu = (DATA / "h200" / "conv_block.log").read_text(encoding="utf-8")
    assert "void at::<unnamed>::max_pool_forward_nchw<float, int>(" in ncu


@pytest.mark.reliability
def test_counters_permission_denied_keeps_the_profile_and_gives_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in ncu that answers as ncu does for a user without counter access."""
    from pytest_opprof.options import OpprofOptions

    fake = tmp_path / "bin" / "ncu"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "print('==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA "
        "GPU Performance Counters on the target device 0.')\n"
        "sys.exit(1)\n",
        encoding="utf-8",
    )
    fake.chmod(0o755)
    monkeypatch.setattr(c, "find_ncu", lambda: str(fake))
    timeline = _full_timeline()
    opts = OpprofOptions(ncu="auto", ncu_sudo="false")
    spec = {"out_dir": str(tmp_path / "out"), "workload": "w.py"}
    out, summary, warnings = c.counters_for_capture(spec, [timeline], {}, opts, "float32")
    assert out == [timeline]  # the profile is kept, without counters
    assert summary is not None and summary["compiled"]["note"] == c.PERMISSION_FIX
    assert len(warnings) == 1 and "NVreg_RestrictProfilingToAdminUsers=0" in warnings[0]
    assert "--opprof-ncu-sudo=true" in warnings[0]


@pytest.mark.parametrize(("mode", "warned"), [("auto", False), ("on", True)])
@pytest.mark.reliability
def test_counters_for_capture_without_ncu(
    mode: str, warned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_opprof.options import OpprofOptions

    monkeypatch.setattr(c, "find_ncu", lambda: None)
    timeline = _full_timeline()
    opts = OpprofOptions(ncu=mode)
    out, summary, warnings = c.counters_for_capture({}, [timeline], {}, opts, "")
    assert out == [timeline]
    assert summary is not None and "not found" in summary["note"]
    assert bool(warnings) is warned


@pytest.mark.parametrize(("device", "mode"), [("cpu", "auto"), ("cuda", "off")])
def test_counters_for_capture_skipped(
    device: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_opprof.options import OpprofOptions

    def boom() -> None:
        raise AssertionError("ncu looked up")

    monkeypatch.setattr(c, "find_ncu", boom)
    opts = OpprofOptions(ncu=mode)
    got = c.counters_for_capture({}, [_full_timeline()], {}, opts, "float32", device)
    assert got == ([_full_timeline()], None, [])


@pytest.mark.reliability
def test_errors_beside_profiled_kernels_are_warnings() -> None:
    log = (DATA / "synthetic_base_units.csv").read_text()
    output = "==ERROR== Failed to profile kernel 'x' in process 4242\n"
    result = c.parse_run(0, log, output, _timeline())
    assert result.note is None and len(result.metrics) == 5
    assert len(result.warnings) == 1 and "Failed to profile kernel" in result.warnings[0]


def test_tensor_kernel_without_tensor_op_count_has_no_flops() -> None:
    rows, header = nm.parse_raw_csv((DATA / "synthetic_base_units.csv").read_text())
    resolved = nm.resolve(header) | {"tensor_ops": None}
    gemm = nm.logical_metrics(rows[4], resolved)  # tensor pipe 80 % busy
    assert gemm["flops"] is None
    add = nm.logical_metrics(rows[0], resolved)  # tensor pipe 60 % in the fixture too
    assert add["flops"] is None
    idle = rows[0].model_copy(deep=True)
    metric = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    idle.values[metric] = 0.0
    assert nm.logical_metrics(idle, resolved)["flops"] == 524288.0


def test_real_h200_ncu_row_with_another_geometry_is_left_out() -> None:
    """Same name and count but a different launch grid: a warning, never a guessed pair."""
    from pytest_opprof.schema import Profile, read_artifact

    name = "depthwise_separable_conv"
    profile = read_artifact(H200_RUN / name / "profile.json.gz", Profile)
    kernels = nm.timeline_kernels(profile.timelines[0])
    first = kernels[0].model_copy(update={"grid": [9999, 1, 1]})
    log = (DATA / "h200" / f"{name}.log").read_text(encoding="utf-8")
    unique = (profile.counters or {}).get("replay") == "unique"
    result = c.parse_run(0, log, "", [first, *kernels[1:]], label="eager", unique=unique)
    key = nm.kernel_key(first.name)
    assert any(f"kernel {key!r} launched with grid [9999, 1, 1]" in w for w in result.warnings)
    paired = {k.index for k in result.metrics}
    same_key = [i for i, k in enumerate(kernels) if nm.kernel_key(k.name) == key]
    assert not paired & set(same_key) and len(paired) == len(kernels) - len(same_key)


# ------------------------------------------------------- one process, ranges, unique replay


def _log_rows(name: str) -> tuple[list[str], list[list[str]]]:
    """A real H200 log's CSV: header + units lines, and the kernel rows as cells."""
    import csv

    lines = [x for x in (PER_LABEL / name).read_text(encoding="utf-8").splitlines()]
    start = next(i for i, x in enumerate(lines) if x.startswith('"ID"'))
    table = list(csv.reader(lines[start:]))
    return lines[start : start + 2], [r for r in table[2:] if r and r[0].isdigit()]


def _write_log(head: list[str], rows: list[list[str]]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for n, row in enumerate(rows):
        writer.writerow([str(n), *row[1:]])
    return "\n".join(["==PROF== Connected to process 1", *head]) + "\n" + buf.getvalue()


def _renamed(rows: list[list[str]], head: list[str], label: str) -> list[list[str]]:
    import csv

    header = next(csv.reader([head[0]]))
    col = next(i for i, h in enumerate(header) if "Push/Pop_Range" in h)
    out = []
    for row in rows:
        row = list(row)
        row[col] = row[col].replace("opprof_iteration", f"opprof_iteration_{label}")
        out.append(row)
    return out


def _h200_kernels(name: str, label: str) -> list[KernelRecord]:
    """The timeline of the run that wrote the per-label logs (its profile kept beside them)."""
    from pytest_opprof.schema import Profile, read_artifact

    profile = read_artifact(PER_LABEL / f"{name}.profile.json", Profile)
    return nm.timeline_kernels(next(t for t in profile.timelines if t.label == label))


def test_one_log_with_two_ranges_joins_each_label_to_its_own_rows() -> None:
    """The real eager and compiled logs of depthwise_separable_conv as one process writes them:
    rows of ``opprof_iteration_eager`` then ``opprof_iteration_compiled``, numbered on."""
    head, eager_rows = _log_rows("depthwise_separable_conv.eager.log")
    _, compiled_rows = _log_rows("depthwise_separable_conv.compiled.log")
    log = _write_log(
        head, _renamed(eager_rows, head, "eager") + _renamed(compiled_rows, head, "compiled")
    )
    rows, _ = nm.parse_raw_csv(log)
    assert [r.label for r in rows] == ["eager"] * len(eager_rows) + ["compiled"] * len(
        compiled_rows
    )
    for label in ("eager", "compiled"):
        kernels = _h200_kernels("depthwise_separable_conv", label)
        alone = c.parse_run(
            0,
            (PER_LABEL / f"depthwise_separable_conv.{label}.log").read_text(encoding="utf-8"),
            "",
            kernels,
        )
        together = c.parse_run(0, log, "", kernels, label=label)
        assert together.warnings == [] and together.note is None
        assert [k.metrics for k in together.metrics] == [k.metrics for k in alone.metrics]
        assert len(together.metrics) == len(kernels)


def test_range_label_and_shared_memory_from_the_csv() -> None:
    head, rows = _log_rows("depthwise_separable_conv.eager.log")
    parsed, _ = nm.parse_raw_csv(_write_log(head, _renamed(rows, head, "compiled")))
    assert {r.label for r in parsed} == {"compiled"}
    gemm = next(r for r in parsed if "s1688gemm_64x64" in r.name)
    assert gemm.shared_memory == 49152  # static 0 + dynamic 49,152: the profiler's value
    legacy, _ = nm.parse_raw_csv(_write_log(head, rows))
    assert {r.label for r in legacy} == {None}


def _first_of_each_config(rows: list[list[str]], head: list[str]) -> list[list[str]]:
    """What ``--filter-mode per-launch-config --launch-count 1`` leaves of a full replay."""
    import csv

    header = next(csv.reader([head[0]]))
    cols = [header.index(h) for h in ("Kernel Name", "Grid Size", "Block Size")]
    cols += [header.index("launch__shared_mem_per_block_static")]
    cols += [header.index("launch__shared_mem_per_block_dynamic")]
    seen: set[tuple[str, ...]] = set()
    out = []
    for row in rows:
        key = tuple(row[i] for i in cols)
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def test_unique_replay_fills_repeated_launches_from_the_replayed_one() -> None:
    """conv_block's eager iteration replayed once per launch configuration: every kernel still
    gets counters, the replayed ones marked measured and equal to the full replay's."""
    head, rows = _log_rows("depthwise_separable_conv.eager.log")
    firsts = _first_of_each_config(rows, head)
    assert len(firsts) < len(rows)  # the iteration repeats configurations
    kernels = _h200_kernels("depthwise_separable_conv", "eager")
    full = c.parse_run(
        0,
        (PER_LABEL / "depthwise_separable_conv.eager.log").read_text(encoding="utf-8"),
        "",
        kernels,
    )
    log = _write_log(head, _renamed(firsts, head, "eager"))
    result = c.parse_run(0, log, "", kernels, label="eager", unique=True)
    assert result.warnings == [] and result.note is None
    assert sorted(k.index for k in result.metrics) == list(range(len(kernels)))
    measured = [k for k in result.metrics if k.source == "measured"]
    assert len(measured) == len(firsts)
    by_index = {k.index: k for k in full.metrics}
    for k in measured:
        assert k.metrics == by_index[k.index].metrics
    copied = [k for k in result.metrics if k.source == "same_launch_config"]
    assert copied and all(kernels[k.index].name in {x.name for x in measured} for k in copied)
    filled = nm.attach(kernels, result, None, "float32")
    assert {k.counters_source for k in filled} == {"measured", "same_launch_config"}


def test_unique_replay_takes_a_configuration_from_the_other_range() -> None:
    """A configuration first launched in the eager range is not replayed again in the
    compiled one: the compiled launch carries the eager row's counters."""
    head, rows = _log_rows("depthwise_separable_conv.eager.log")
    k0 = _h200_kernels("depthwise_separable_conv", "eager")[:1]
    log = _write_log(head, _renamed(rows[:1], head, "eager"))
    result = c.parse_run(0, log, "", k0, label="compiled", unique=True)
    assert [(k.index, k.source) for k in result.metrics] == [(0, "same_launch_config")]
    nothing = c.parse_run(
        0, log, "", _h200_kernels("depthwise_separable_conv", "compiled")[-1:], label="x"
    )
    assert nothing.note is not None and "opprof_iteration_x" in nothing.note


def test_unique_replay_never_guesses_which_launch_a_later_row_was() -> None:
    """ncu told two launches of one (name, grid, block, smem) apart: the first launch gets the
    first row, the others copy it, and a warning says so — no ordinal pairing by guess."""
    head, rows = _log_rows("depthwise_separable_conv.eager.log")
    kernels = _h200_kernels("depthwise_separable_conv", "eager")
    key = nm.kernel_key(kernels[0].name)
    same = [k.model_copy(update={"start_us": float(i)}) for i, k in enumerate([kernels[0]] * 3)]
    import csv

    name_col = next(csv.reader([head[0]])).index("Kernel Name")
    first = [r for r in rows if nm.kernel_key(r[name_col]) == key]
    assert first
    log = _write_log(head, _renamed([first[0], first[0]], head, "eager"))
    result = c.parse_run(0, log, "", same, label="eager", unique=True)
    assert [k.source for k in result.metrics] == ["measured", *["same_launch_config"] * 2]
    assert len({k.ncu_id for k in result.metrics}) == 1
    assert any("as distinct configurations" in w for w in result.warnings)


def test_auto_replays_each_configuration_once_above_the_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--opprof-ncu-replay=auto: every launch up to UNIQUE_ABOVE kernels, one launch per
    configuration beyond (what made gpt2's and the LSTM's capture fit the time)."""
    from pytest_opprof.options import OpprofOptions

    seen: list[str] = []
    real = c.run_counters_many

    def recording(spec: Any, kernels_by_label: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["replay"])
        return real(spec, kernels_by_label, **kwargs)

    monkeypatch.setattr(c, "run_counters_many", recording)
    monkeypatch.setattr(c, "find_ncu", lambda: str(_fake_ncu(tmp_path)))
    small = _full_timeline()
    op = small.operators[0]
    one = _timeline()[0]
    many = [one.model_copy(update={"start_us": float(i)}) for i in range(c.UNIQUE_ABOVE + 1)]
    big = small.model_copy(update={"operators": [op.model_copy(update={"kernels": many})]})
    spec = {"out_dir": str(tmp_path / "out"), "workload": "w.py"}
    for timeline, mode in ((small, "auto"), (big, "auto"), (small, "unique"), (big, "all")):
        opts = OpprofOptions(ncu="auto", ncu_sudo="false", ncu_replay=mode)
        _, summary, _ = c.counters_for_capture(spec, [timeline], {}, opts, "float32")
        assert summary is not None and summary["replay"] == seen[-1]
    assert seen == ["all", "unique", "unique", "all"]
    assert (tmp_path / "out" / "profiler_output" / "ncu" / "counters_target.json").exists()


def test_ncu_replays_under_its_targets_share_of_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capture's measurements released the GPU (measuring(share_after=False)); ncu's
    replay is GPU work, so it runs under a share, never beside a measurement: the target's own,
    for which the capture hands it the lock file and holds nothing itself."""
    from pytest_opprof import devicelock
    from pytest_opprof.options import OpprofOptions

    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    lock = devicelock.join()
    assert lock is not None
    held: list[tuple[str | None, str | None]] = []
    real = c.run_counters_many

    def replaying(spec: Any, kernels_by_label: Any, **kwargs: Any) -> Any:
        held.append((lock.held, spec.get("gpu_lock")))
        return real(spec, kernels_by_label, **kwargs)

    monkeypatch.setattr(c, "run_counters_many", replaying)
    monkeypatch.setattr(c, "find_ncu", lambda: str(_fake_ncu(tmp_path)))
    try:
        with devicelock.measuring(share_after=False):
            pass
        assert lock.held is None
        spec = {"out_dir": str(tmp_path / "out"), "workload": "w.py"}
        opts = OpprofOptions(ncu="auto", ncu_sudo="false")
        c.counters_for_capture(spec, [_full_timeline()], {}, opts, "float32")
        assert held == [(None, str(tmp_path / "gpu.lock"))]
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)
