"""benchmarks/refresh_artifacts.py re-derives a run's timelines and counters from its raw files:
here the H200 run of conv_block (its profiles in tests/data/h200/conv_block, traces in
tests/data/h200, ncu logs in tests/data/ncu/h200), which must come back exactly as written."""

from __future__ import annotations

import gzip
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof.schema import Profile, read_artifact

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "tests" / "data" / "h200"


def _tool() -> object:
    spec = importlib.util.spec_from_file_location(
        "refresh_artifacts", ROOT / "benchmarks" / "refresh_artifacts.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two dumped artifacts differ, floats compared to 1e-12 relative."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if a == pytest.approx(b, rel=1e-12, abs=1e-12) else [f"{path}: {a} vs {b}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def test_refresh_reproduces_the_committed_profiles(tmp_path: Path) -> None:
    name = "conv_block"
    folder = tmp_path / name
    out = folder / "profiler_output"
    (out / "ncu").mkdir(parents=True)
    for f in ("profile.json", "profile_optimized.json"):
        (folder / f).write_bytes(gzip.decompress((H200 / name / f"{f}.gz").read_bytes()))
    for trace in H200.glob(f"{name}*.trace.json.gz"):  # read by content: gzip is fine
        shutil.copy(trace, out / trace.name.removesuffix(".gz"))
    for prov in H200.glob(f"{name}.*.provenance.json"):
        shutil.copy(prov, out / prov.name)
    shutil.copy(ROOT / "tests" / "data" / "ncu" / "h200" / f"{name}.log", out / "ncu" / "ncu.log")

    tool = _tool()
    for f in ("profile.json", "profile_optimized.json"):
        assert tool.refresh_profile(folder / f, name)  # type: ignore[attr-defined]
        got = read_artifact(folder / f, Profile)
        want = read_artifact(H200 / name / f"{f}.gz", Profile)
        # Python 3.12 (the GPU machine) sums floats with compensation, 3.11 does not: the
        # duration-weighted means agree to ~1e-16, not bit for bit.
        ours, theirs = ([t.model_dump() for t in p.timelines] for p in (got, want))
        for refreshed, committed in zip(ours, theirs, strict=True):
            # counted from the traces since the run: new in the refresh, absent as committed
            if committed["summary"]["launches_per_iter"] is None:
                assert refreshed["summary"].pop("launches_per_iter") >= 1.0
                committed["summary"].pop("launches_per_iter")
        assert _differences(ours, theirs) == []
        assert got.timing == want.timing
    optimized = read_artifact(folder / "profile_optimized.json", Profile).timelines[0]
    assert optimized.summary.attributed_share == 1.0 and not optimized.unattributed_kernels
