"""The package's docstrings and comments cite measurements by path (a probe under
``benchmarks/``, a run under ``benchmarks/results/``): each cited path exists in the tree, so a
reader can follow it. Raw run files are on the ``results`` branch (docs/results.md); cite the
run's folder, which keeps its summary here, or the docs page with the figure."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"benchmarks/[A-Za-z0-9_./*-]+")


def test_every_path_the_package_cites_exists() -> None:
    missing = []
    for source in sorted((ROOT / "pytest_opprof").rglob("*.py")):
        for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
            for match in CITED.finditer(line):
                path = match.group().rstrip(".,")
                if not (ROOT / path).exists():
                    missing.append(f"{source.relative_to(ROOT)}:{n}: {path}")
    assert missing == []
