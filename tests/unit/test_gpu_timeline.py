"""benchmarks/gpu_timeline.py: a run's stage logs laid on one clock (the wall clock each log
starts with), each wait for the GPU split by what it was behind."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _timeline() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gpu_timeline", ROOT / "benchmarks" / "gpu_timeline.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _log(folder: Path, workload: str, name: str, lines: list[str]) -> None:
    out = folder / workload / "profiler_output"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.log").write_text("\n".join(lines) + "\n")


def test_a_wait_is_split_into_behind_a_measurement_a_quiet_wait_and_a_drain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a waits from 1 s to 9 s: behind b's quiet wait (2-3 s) and measurement (3-5 s), then
    # behind nobody holding the GPU alone (1-2 s and 5-9 s: drains)
    _log(
        tmp_path,
        "a",
        "select",
        [
            "[opprof] +    0.0 s  forked from the fork server of pid 7 at 10:00:00.000 UTC",
            "[opprof] +    1.0 s  waiting for the GPU: another process on it is at work",
            "[opprof] +    9.0 s  had the GPU after 8.0 s",
            "[opprof] +    9.5 s  task select done, 8.0 s of it waiting for the GPU",
        ],
    )
    _log(
        tmp_path,
        "b",
        "recapture",
        [
            "[opprof] +    0.0 s  started at 10:00:01.000 UTC",
            "a line of the workload's own output, not the stage's",
            "[opprof] +    1.0 s  waiting for the compiles of other processes on the host to end",
            "[opprof] +    2.0 s  the host was quiet after 1.0 s",
            "[opprof] +    4.0 s  let go of the GPU, held to itself for 2.00 s",
        ],
    )
    _log(tmp_path, "c", "capture", ["[opprof] +    0.0 s  torch imported"])  # no start time
    tl = _timeline()
    assert tl.main(tmp_path) == 0
    out = capsys.readouterr()
    assert "1 logs without a start time skipped" in out.err
    assert "2 stage processes over 10 s; the GPU held alone (measuring) for 2 s" in out.out
    assert "| a | 10 | 8.0 | 2.0 | 1.0 | 5.0 |" in out.out
    assert "- a/select: 1.0–9.0 s, 5.0 s while nobody held it alone" in out.out


def test_a_quiet_wait_holding_nothing_of_the_gpu_is_not_a_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # b waits for the host's compiles from 1 s to 3 s without the GPU (devicelock.QUIETED),
    # then measures 3-5 s; a's wait for the GPU over 2-5 s is behind that measurement only
    from pytest_opprof import devicelock

    _log(
        tmp_path,
        "a",
        "select",
        [
            "[opprof] +    0.0 s  started at 10:00:00.000 UTC",
            "[opprof] +    5.0 s  had the GPU after 3.0 s",
        ],
    )
    _log(
        tmp_path,
        "b",
        "recapture",
        [
            "[opprof] +    0.0 s  started at 10:00:00.000 UTC",
            f"[opprof] +    1.0 s  {devicelock.WAITING_QUIET}",
            f"[opprof] +    3.0 s  {devicelock.QUIETED} 2.0 s",
            f"[opprof] +    5.0 s  {devicelock.MEASURED} 2.00 s",
        ],
    )
    assert _timeline().main(tmp_path) == 0
    out = capsys.readouterr().out
    assert "idle, a quiet measurement waiting for the host's compiles to end: 0 s" in out
    assert "waiting for them holding nothing of the GPU: 2 s" in out
    assert "| a | 5 | 3.0 | 2.0 | 0.0 | 1.0 |" in out


def test_logs_without_a_start_time_are_said_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _log(tmp_path, "c", "capture", ["[opprof] +    0.0 s  forked from the fork server of pid 7"])
    assert _timeline().main(tmp_path) == 1
    assert "no stage log with a start time" in capsys.readouterr().err


def test_the_h200_run_of_2026_12_03b_on_one_clock(capsys: pytest.CaptureFixture[str]) -> None:
    """The first run whose logs carry the wall clock: 42 stage processes (capture, select,
    validate, and the recapture's three timing processes, for seven workloads); the GPU was held
    alone for a third of the run, and gpt2, the last to end, waited 80 s for it."""
    tl = _timeline()
    assert tl.main(ROOT / "tests" / "data" / "results" / "h200-2026-12-03b" / "plain-n7") == 0
    out = capsys.readouterr().out
    assert "42 stage processes over 209 s; the GPU held alone (measuring) for 71 s" in out
    assert "| gpt2 | 209 | 80.1 | 47.4 | 5.7 | 26.9 |" in out
    assert "All waits: 674 s, 210 s (31%) of them drains" in out
    # the timing processes (the recapture and its two retimes) held it longest
    assert "The GPU held alone, by stage: 72 s in all" in out
    assert "| recapture | 9 | 21.7 | 30% | 6.1 |" in out
    assert "| retime | 18 | 20.2 | 28% | 2.3 |" in out
    assert "| select | 47 | 18.7 | 26% | 1.9 |" in out


def test_a_run_across_midnight_reads_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _log(
        tmp_path,
        "a",
        "capture",
        [
            "[opprof] +    0.0 s  started at 23:59:59.000 UTC",
            "[opprof] +    4.0 s  let go of the GPU, held to itself for 2.00 s",
        ],
    )
    _log(
        tmp_path,
        "b",
        "capture",
        [
            "[opprof] +    0.0 s  started at 00:00:00.000 UTC",
            "[opprof] +    1.0 s  waiting for the GPU: another process on it is at work",
            "[opprof] +    3.0 s  had the GPU after 2.0 s",
        ],
    )
    assert _timeline().main(tmp_path) == 0
    out = capsys.readouterr().out
    assert "2 stage processes over 4 s; the GPU held alone (measuring) for 2 s" in out
    assert "| b | 4 | 2.0 | 2.0 | 0.0 | 0.0 |" in out  # behind a, across midnight


def test_long_shared_holds_are_summed_by_what_they_were(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A compile's long holds of the GPU shared (``devicelock.SHARED``), which
    a measurer's drain waits for, summed by what they were."""
    from pytest_opprof import devicelock

    _log(
        tmp_path,
        "a",
        "stock",
        [
            "[opprof] +    0.0 s  started at 10:00:00.000 UTC",
            f"[opprof] +    3.0 s  {devicelock.SHARED} 2.50 s: Inductor's benchmark_choice",
            f"[opprof] +    5.0 s  {devicelock.SHARED} 1.50 s: Inductor's benchmark_choice",
            f"[opprof] +    9.0 s  {devicelock.SHARED} 4.00 s: freezing",
        ],
    )
    tl = _timeline()
    assert tl.main(tmp_path) == 0
    out = capsys.readouterr().out
    assert "(a measurement waits for the one under way): 3, 8 s in all" in out
    table = out[out.index("| what |") :].splitlines()
    assert table[2:4] == [
        "| Inductor's benchmark_choice | 2 | 4.0 | 2.5 |",
        "| freezing | 1 | 4.0 | 4.0 |",
    ]


def _two_processes(folder: Path) -> None:
    """a measures 2-4 s and b waits behind it 1-4 s, then b measures 6-9 s (clock 10:00:00)."""
    from pytest_opprof import devicelock

    _log(
        folder,
        "a",
        "capture",
        [
            "[opprof] +    0.0 s  started at 10:00:00.000 UTC",
            f"[opprof] +    4.0 s  {devicelock.MEASURED} 2.00 s",
        ],
    )
    _log(
        folder,
        "b",
        "capture",
        [
            "[opprof] +    0.0 s  started at 10:00:00.000 UTC",
            "[opprof] +    4.0 s  had the GPU after 3.0 s",
            f"[opprof] +    9.0 s  {devicelock.MEASURED} 3.00 s",
        ],
    )


def test_until_reads_a_run_as_it_stood_at_that_second(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run cut short (the machine taken back) beside a whole one: the same first seconds of
    each. A measurement under way at the cut counts up to it."""
    _two_processes(tmp_path)
    tl = _timeline()
    assert tl.main(tmp_path, until=7.0) == 0
    out = capsys.readouterr().out
    assert "2 stage processes over 7 s; the GPU held alone (measuring) for 3 s" in out
    assert tl.main(tmp_path) == 0
    assert "over 9 s; the GPU held alone (measuring) for 5 s" in capsys.readouterr().out


def test_the_host_s_cpus_beside_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """host_load.txt's samples inside the run's span (10:00:00-10:00:09) are summed; the one
    before it, and a line cut mid-write, are not."""
    _two_processes(tmp_path)
    (tmp_path / "host_load.txt").write_text(
        "09:59:58.000000 0.100 1 16\n"
        "10:00:02.000000 0.950 40 16\n"
        "10:00:04.000000 1.000 32 16\n"
        "10:00:06.000000 0.500 8 16\n"
        "10:00:08.000000 0.97\n"
    )
    assert _timeline().main(tmp_path) == 0
    out = capsys.readouterr().out
    assert (
        "Host CPUs (3 samples): 82% busy on average, 90% or more for 67% of the run; "
        "runnable threads per CPU: median 2.0, most 2.5" in out
    )


def test_compiles_held_back_and_pauses_are_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A quiet measurement's pause of the compiles, and a compile's wait behind one, as the
    stage logs say them (``devicelock.PAUSED``, ``devicelock.COMPILES_AGAIN``)."""
    from pytest_opprof import devicelock

    _log(
        tmp_path,
        "a",
        "recapture",
        [
            "[opprof] +    0.0 s  started at 10:00:00.000 UTC",
            f"[opprof] +    1.0 s  {devicelock.PAUSED} 3 processes, 2 {devicelock.WORKERS_PAUSED}",
            f"[opprof] +    4.0 s  {devicelock.MEASURED} 3.00 s",
        ],
    )
    _log(
        tmp_path,
        "b",
        "stock",
        [
            "[opprof] +    0.0 s  started at 10:00:00.000 UTC",
            f"[opprof] +    2.0 s  {devicelock.WAITING_TO_COMPILE}",
            f"[opprof] +    4.0 s  {devicelock.COMPILES_AGAIN} 2.0 s",
        ],
    )
    assert _timeline().main(tmp_path) == 0
    assert (
        "Compiles held back by a quiet measurement: 1 waits, 2 s in all; quiet measurements "
        "that paused the compiles under way: 1, 3 processes stopped in all"
    ) in capsys.readouterr().out


def test_the_gpu_time_passes_and_the_recapture_beside_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # w's validation runs 10-20 s (validate, then its numerics); its recapture starts at 10 s,
    # compiles until 16 s and waits at the gate until 20 s; its retime starts at 12 s and
    # reaches the gate at 22 s, validation over. Together they ran 6 + 8 s beside validation.
    from pytest_opprof.stages import capture, recapture

    at = "forked from the fork server of pid 7 at"
    _log(
        tmp_path,
        "w",
        "validate",
        [f"[opprof] +    0.0 s  {at} 10:00:10.000 UTC", "[opprof] +    8.0 s  generated tests"],
    )
    _log(
        tmp_path,
        "w",
        "validate_numerics",
        [f"[opprof] +    0.0 s  {at} 10:00:18.000 UTC", "[opprof] +    2.0 s  task done"],
    )
    _log(
        tmp_path,
        "w",
        "recapture",
        [
            f"[opprof] +    0.0 s  {at} 10:00:10.000 UTC",
            "[opprof] +    6.0 s  waiting for validation to end before timing",
            f"[opprof] +   10.0 s  {recapture.VALIDATED} after 4.0 s of waiting",
            f"[opprof] +   12.0 s  {capture.GPU_TIMES} 0.75 s",
        ],
    )
    _log(
        tmp_path,
        "w",
        "retime1",
        [
            f"[opprof] +    0.0 s  {at} 10:00:12.000 UTC",
            f"[opprof] +   10.0 s  {recapture.VALIDATED} after 0.0 s of waiting",
        ],
    )
    _log(
        tmp_path,
        "v",
        "capture",
        [
            f"[opprof] +    0.0 s  {at} 10:00:00.000 UTC",
            f"[opprof] +    3.0 s  {capture.GPU_TIMES} 1.25 s",
        ],
    )
    assert _timeline().main(tmp_path) == 0
    out = capsys.readouterr().out
    assert "GPU-time passes (the GPU alone): 2, 2.0 s in all, the longest 1.25 s" in out
    assert (
        "Recaptures started beside validation: 1 workloads; their processes ran 14 s while "
        "validation did, then waited 4 s for it to pass"
    ) in out


def test_selection_s_builds_the_warmers_builds_and_the_waits_for_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Per workload: selection's builds as its log says them (task_select), those the FX graph
    cache answered whole, the rung warmers' builds ahead of it and selection's waits for
    them."""
    at = "forked from the fork server of pid 7 at"
    note = "(trace 1.0, aot 3.4, inductor 0.3, kernels 0.0 s; FX graph cache {} hit, {} miss)"
    _log(
        tmp_path,
        "w",
        "backend",
        [
            f"[opprof] +    0.0 s  {at} 10:00:00.000 UTC",
            "[opprof] +   20.3 s  built cuda_graphs-model: model 0.0 s, compile and first call "
            f"5.7 s {note.format(1, 0)}",
            "[opprof] +   22.0 s  waited 2.5 s for the rung warmer's build of "
            "cuda_graphs-model+dtype_promotion-1",
            "[opprof] +   36.6 s  built cuda_graphs-model+dtype_promotion-1: model 0.0 s, compile "
            f"and first call 4.5 s {note.format(1, 0)}",
            "[opprof] +   55.4 s  built cuda_graphs-model+dtype_promotion-1+bn_fold-1: model "
            f"0.0 s, compile and first call 15.1 s {note.format(0, 1)}",
        ],
    )
    _log(
        tmp_path,
        "w",
        "warm_rungs",
        [
            f"[opprof] +    0.0 s  {at} 10:00:01.000 UTC",
            "[opprof] +   19.0 s  built cuda_graphs-model+dtype_promotion-1 ahead of selection: "
            f"14.0 s {note.format(0, 1)}",
        ],
    )
    _log(tmp_path, "v", "capture", [f"[opprof] +    0.0 s  {at} 10:00:00.000 UTC"])
    assert _timeline().main(tmp_path) == 0
    out = capsys.readouterr().out
    builds = out[out.index("Selection's builds") :]
    assert "| w | 3 | 25.3 | 2 | 1 | 14.0 | 1 | 2.5 |" in builds
    assert "| v |" not in builds  # no selection in its logs
