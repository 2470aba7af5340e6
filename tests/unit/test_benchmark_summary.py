"""benchmarks/summarize.py over the committed H200 artifacts: every figure read, none typed."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "h200-2026-11-30b"


def _summarize() -> Any:
    spec = importlib.util.spec_from_file_location("summarize", ROOT / "benchmarks" / "summarize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_of_the_committed_run() -> None:
    tool = _summarize()
    junit = sorted(RESULTS.glob("call*-opprof-junit.xml"))
    result = tool.summarize([ROOT / "examples"], junit)
    rows = result["workloads"]
    assert set(rows) == set(tool.TARGETS)
    for name, row in rows.items():
        lo, hi = row["speedup_vs_compile_ci"]
        assert lo <= row["speedup_vs_compile"] <= hi, name
        assert row["optimized_ci_ms"][0] <= row["optimized_ms"] <= row["optimized_ci_ms"][1]
        assert row["meets_target"] == (
            row["optimized_ms"] <= row["target_ms"]
            or row["speedup_vs_compile"] >= row["target_ratio"]
        )
    ratios = [r["speedup_vs_compile"] for r in rows.values()]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    assert result["geomean_speedup_vs_compile"] == geomean
    # This run's stage times came from its stage JUnit; a resumed (cached) item counts once.
    assert rows["gpt2"]["stage_seconds"]["recapture"] > 1.0
    assert set(rows["conv_block"]["stage_seconds"]) >= {"capture", "backend", "validate"}
    table = tool.markdown(result)
    assert "Geometric mean over torch.compile" in table and "| lstm_sequence_encoder |" in table


def test_the_committed_table_is_what_the_tool_writes() -> None:
    tool = _summarize()
    junit = sorted(RESULTS.glob("call*-opprof-junit.xml"))
    written = (RESULTS / "summary.md").read_text(encoding="utf-8")
    assert tool.markdown(tool.summarize([ROOT / "examples"], junit)) == written
