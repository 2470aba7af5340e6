"""Would fewer rounds per timing process do? Recomputes the recaptures' pooled speedups from only
``k`` of each timing process's rounds (its first ``k``, or its last: a longer warmup), with the
pipeline's own statistics (``measure.speedup``, the slowed host's rounds set aside as the
recapture sets them aside), and lays them beside the same ratios from every round: how much
wider the intervals get, how far the ratios move, and how many intervals of a run and its
retiming a minute later (``X`` and ``X-retimed``) still miss each other. No GPU: it reads the
rounds a GPU run kept (docs/reproducibility.md#rounds-per-timing-process).

    python benchmarks/rounds_per_process.py SOURCE [SOURCE ...] [--counts 5,8,10,12]

A SOURCE is an unpacked run (a folder with a folder per workload holding
``profile_optimized.json``, or ``.json.gz``: every pooled ratio) or the history tests' rounds
(``tests/data/results/timings.json.gz``: torch.compile over optimized, every run timed twice).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytest_opprof.measure import slow_host_rounds, speedup, split_processes  # noqa: E402
from pytest_opprof.schema import Speedup  # noqa: E402

RETIMED = "-retimed"


class Pooled(NamedTuple):
    """One pooled ratio's rounds: ``key`` names the run and workload (``session/run/workload``),
    ``pair`` the ratio (``baseline/candidate``)."""

    key: str
    pair: str
    baseline: list[list[float]]
    candidate: list[list[float]]
    host_us: list[list[float]] | None


def _json(path: Path) -> Any:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def _pooled(key: str, pair: str, a: dict[str, Any], b: dict[str, Any], host: Any) -> Pooled | None:
    groups = a.get("samples_per_process") or []
    if len(groups) < 2 or len(b["samples_ms"]) != sum(groups):
        return None  # one process: nothing pooled to cut
    hosts = split_processes(host, groups) if host and len(host) == sum(groups) else None
    return Pooled(
        key,
        pair,
        split_processes(a["samples_ms"], groups),
        split_processes(b["samples_ms"], groups),
        hosts,
    )


def read(source: Path) -> Iterator[Pooled]:
    """The pooled ratios of an unpacked run folder or of a ``timings.json.gz``."""
    if source.is_file():
        for key, t in sorted(_json(source).items()):
            found = _pooled(key, "compile/optimized", t["compile"], t["optimized"], t["host_us"])
            if found is not None:
                yield found
        return
    for path in sorted(source.glob("*/profile_optimized.json*")):
        timing = _json(path)["timing"]
        key = f"{source.parent.name}/{source.name}/{path.parent.name}"
        for s in timing["speedups"]:
            a, b = timing["variants"][s["baseline"]], timing["variants"][s["candidate"]]
            if a.get("samples_per_process") != b.get("samples_per_process"):
                continue
            pair = f"{s['baseline']}/{s['candidate']}"
            found = _pooled(key, pair, a, b, timing.get("host_us"))
            if found is not None:
                yield found


def cut(p: Pooled, k: int | None, last: bool) -> Speedup:
    """``p``'s ratio from ``k`` rounds of each process (its last ``k`` with ``last``), every
    round where ``k`` is None; rounds on a slowed host set aside as the recapture does."""

    def keep(parts: list[list[float]]) -> list[list[float]]:
        return [(q[-k:] if last else q[:k]) if k else q for q in parts]

    a, b = keep(p.baseline), keep(p.candidate)
    host = [x for q in keep(p.host_us) for x in q] if p.host_us else []
    base, cand = p.pair.split("/")
    return speedup(
        base,
        [x for q in a for x in q],
        cand,
        [x for q in b for x in q],
        groups=[len(q) for q in a],
        set_aside=slow_host_rounds(host) if host else [],
    )


def _half_width(s: Speedup) -> float:
    """The interval's half-width, in percent of the ratio (on the log scale)."""
    return 50 * math.log(s.ci_high / s.ci_low)


def _apart(x: Speedup, y: Speedup) -> bool:
    return x.ci_high < y.ci_low or y.ci_high < x.ci_low


def summary(pooled: Sequence[Pooled], counts: Sequence[int]) -> list[dict[str, Any]]:
    """One row per cut (``k`` rounds a process, first or last; then every round): the
    ratios, the median and 90th percentile of their intervals' half-widths, how many intervals
    still hold the all-rounds ratio, the median and largest move from it, and how many of the
    runs timed twice (``X``, ``X-retimed``) have intervals that miss each other."""
    every = {(p.key, p.pair): cut(p, None, False) for p in pooled}
    twice = [
        ((p.key, p.pair), (p.key.replace(RETIMED + "/", "/"), p.pair))
        for p in pooled
        if RETIMED + "/" in p.key
    ]
    twice = [(a, b) for a, b in twice if b in every]
    rows = []
    for k, last in [(k, last) for k in counts for last in (False, True)] + [(None, False)]:
        got = {(p.key, p.pair): cut(p, k, last) for p in pooled}
        widths = sorted(_half_width(s) for s in got.values())
        moved = sorted(100 * abs(math.log(got[x].ratio / every[x].ratio)) for x in got)
        rows.append(
            {
                "rounds": "every" if k is None else f"{'last' if last else 'first'} {k}",
                "ratios": len(got),
                "half_width_median": statistics.median(widths),
                "half_width_p90": widths[int(0.9 * (len(widths) - 1))],
                "holds_every_rounds_ratio": sum(
                    got[x].ci_low <= every[x].ratio <= got[x].ci_high for x in got
                ),
                "moved_median": statistics.median(moved),
                "moved_max": moved[-1],
                "timed_twice": len(twice),
                "apart": sum(_apart(got[a], got[b]) for a, b in twice),
            }
        )
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| rounds a process | ratios | half-width, median | 90th pct | interval holds the "
        "every-rounds ratio | ratio moved, median | largest | timed twice: intervals apart |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        twice = f"{r['apart']} of {r['timed_twice']}" if r["timed_twice"] else "–"
        lines.append(
            f"| {r['rounds']} | {r['ratios']} | {r['half_width_median']:.1f}% | "
            f"{r['half_width_p90']:.1f}% | {r['holds_every_rounds_ratio']} | "
            f"{r['moved_median']:.2f}% | {r['moved_max']:.1f}% | {twice} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="run folders or timings.json.gz")
    parser.add_argument("--counts", default="5,8,10,12", help="rounds a process to try")
    args = parser.parse_args(argv)
    counts = sorted({int(c) for c in args.counts.split(",") if c.strip()})
    pooled = [p for source in args.sources for p in read(source)]
    if not pooled:
        print(
            "no pooled recapture rounds in "
            + ", ".join(map(str, args.sources))
            + ": give unpacked runs (a folder per workload with profile_optimized.json) or "
            "tests/data/results/timings.json.gz",
            file=sys.stderr,
        )
        return 1
    print(table(summary(pooled, counts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
