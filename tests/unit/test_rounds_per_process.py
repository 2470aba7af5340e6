"""benchmarks/rounds_per_process.py: the recaptures' pooled ratios recomputed from fewer rounds
of each timing process (docs/reproducibility.md#rounds-per-timing-process)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMINGS = ROOT / "tests" / "data" / "results" / "timings.json.gz"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "rounds_per_process", ROOT / "benchmarks" / "rounds_per_process.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its NamedTuple looks its module up there
    spec.loader.exec_module(module)
    return module


def test_one_pair_timed_twice_widens_with_fewer_rounds(tmp_path: Path) -> None:
    # again-n7 and its retiming (h200-2026-12-03b): every ratio within 1.2% a minute later,
    # the intervals overlapping for all seven; plain-n7 and its retiming (h200-2026-12-02):
    # conv_block's intervals apart, its torch.compile call 20-30% slower a minute later
    # (docs/reproducibility.md)
    every = json.loads(gzip.decompress(TIMINGS.read_bytes()))
    runs = ("h200-2026-12-03b/again-n7", "h200-2026-12-02/plain-n7")
    keep = {k: v for k, v in every.items() if k.startswith(runs)}
    assert len(keep) == 28
    subset = tmp_path / "timings.json.gz"
    subset.write_bytes(gzip.compress(json.dumps(keep).encode()))
    script = _script()
    rows = {r["rounds"]: r for r in script.summary(list(script.read(subset)), [5])}
    assert set(rows) == {"first 5", "last 5", "every"}
    assert rows["every"]["timed_twice"] == 14 and rows["every"]["apart"] == 1
    assert rows["every"]["holds_every_rounds_ratio"] == 28
    assert rows["every"]["moved_max"] == 0.0
    for cut in ("first 5", "last 5"):
        assert rows[cut]["half_width_median"] > rows["every"]["half_width_median"]
        assert rows[cut]["moved_max"] > 0.0


def _variant(samples: list[list[float]]) -> dict[str, Any]:
    return {"samples_ms": [x for p in samples for x in p], "samples_per_process": [15] * 3}


def test_slow_first_rounds_move_the_first_cut_not_the_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the second process's compiled call runs 1.5x slower in its first six rounds
    rng = random.Random(0)
    compile_ = [[1.0 + rng.gauss(0, 0.005) for _ in range(15)] for _ in range(3)]
    compile_[1][:6] = [x * 1.5 for x in compile_[1][:6]]
    optimized = [[0.5 + rng.gauss(0, 0.0025) for _ in range(15)] for _ in range(3)]
    profile = {
        "timing": {
            "variants": {"compile": _variant(compile_), "optimized": _variant(optimized)},
            "speedups": [{"baseline": "compile", "candidate": "optimized"}],
            "host_us": [],
        }
    }
    run = tmp_path / "session" / "run"
    (run / "w").mkdir(parents=True)
    (run / "w" / "profile_optimized.json").write_text(json.dumps(profile))
    script = _script()
    found = list(script.read(run))
    assert [(p.key, p.pair) for p in found] == [("session/run/w", "compile/optimized")]
    first, last = script.cut(found[0], 5, False), script.cut(found[0], 5, True)
    every = script.cut(found[0], None, False)
    assert abs(last.ratio / every.ratio - 1) < 0.01
    assert first.ci_high / first.ci_low > 1.2 * (last.ci_high / last.ci_low)
    assert script.main([str(run), "--counts", "5"]) == 0
    assert "| every | 1 |" in capsys.readouterr().out


def test_a_folder_without_pooled_rounds_says_what_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _script().main([str(tmp_path)]) == 1
    assert "give unpacked runs" in capsys.readouterr().err
