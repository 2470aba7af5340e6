"""Render pytest_opprof/data/hardware.json as knowledge/hardware.md, the table for people.

    python knowledge/render_hardware.py          # rewrite hardware.md
    python knowledge/render_hardware.py --check  # exit 1 if hardware.md is stale

Standard library only, so it runs before the package is installed. The JSON, the one copy the
code reads (``pytest_opprof.knowledge``, from an installed wheel too), is the source of truth; a
unit test fails when the committed Markdown no longer matches it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JSON_PATH = HERE.parent / "pytest_opprof" / "data" / "hardware.json"
MD_PATH = HERE / "hardware.md"

TERA = 1e12
GIB = 1024**3
MIB = 1024**2
KIB = 1024


def _tflops(value: float | None) -> str:
    return "—" if value is None else f"{value / TERA:,.1f}"


def _cc(gpu: dict[str, Any]) -> str:
    major, minor = gpu["compute_capability"]
    return f"{major}.{minor}"


def _summary_row(gpu: dict[str, Any]) -> str:
    pf = gpu["peak_flops"]
    ridge = pf["bf16"] / gpu["memory_bandwidth_bytes_per_s"]
    cells = [
        f"[{gpu['name']}](#{gpu['key']})",
        _cc(gpu),
        str(gpu["sm_count"]),
        f"{gpu['boost_clock_hz'] / 1e6:.0f}",
        _tflops(pf["bf16"]),
        _tflops(pf["fp16"]),
        _tflops(pf["tf32"]),
        _tflops(pf["fp32"]),
        _tflops(pf["fp8"]),
        f"{gpu['memory_bandwidth_bytes_per_s'] / TERA:.3f}",
        f"{gpu['memory_bytes'] / GIB:g} {gpu['memory_type']}",
        f"{gpu['l2_bytes'] / MIB:g}",
        f"{ridge:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _detail(gpu: dict[str, Any]) -> list[str]:
    tile = gpu["tensor_core_tile"]
    patterns = ", ".join(f"`{p}`" for p in gpu["name_patterns"]) or "— (never matched by name)"
    multiples = ", ".join(
        f"{dtype} {tile['min_dim_multiple'][dtype]} / {tile['preferred_dim_multiple'][dtype]}"
        for dtype in tile["min_dim_multiple"]
    )
    m, n, k = tile["mma_shape_bf16"]
    lines = [
        f'<a id="{gpu["key"]}"></a>',
        f"### {gpu['name']}",
        "",
        f"- key `{gpu['key']}`, {gpu['architecture']}, compute capability {_cc(gpu)}",
        f"- device-name patterns (case-insensitive regex, tried in table order): {patterns}",
        f"- shared memory per SM {gpu['shared_memory_per_sm_bytes'] // KIB} KiB, "
        f"{gpu['max_threads_per_sm']} threads per SM, "
        f"{gpu['registers_per_sm']} 32-bit registers per SM",
        f"- tensor cores: {tile['instruction']}; bf16 MMA {m}×{n}×{k}, "
        f"row tile {tile['m_tile_rows']}",
        f"- GEMM dim multiples, required / preferred: {multiples}",
        f"- {tile['notes']}",
    ]
    for note in gpu["notes"]:
        lines.append(f"- {note}")
    if gpu["derived_fields"]:
        lines.append("- derived, not quoted: " + "; ".join(gpu["derived_fields"]))
    lines.append("- sources:")
    for ref in gpu["source"]:
        lines.append(f"  - [{ref['document']}]({ref['url']}) — {ref['table']}")
    lines.append("")
    return lines


def render(table: dict[str, Any]) -> str:
    """The Markdown page for ``table`` (the parsed hardware.json)."""
    header = (
        "| GPU | CC | SMs | boost MHz | BF16 | FP16 | TF32 | FP32 | FP8 | "
        "memory TB/s | memory GiB | L2 MiB | BF16 ridge FLOP/B |"
    )
    lines = [
        "# Hardware table",
        "",
        "<!-- Generated from pytest_opprof/data/hardware.json by render_hardware.py; do not edit"
        " by hand. -->",
        "",
        "Generated from [`pytest_opprof/data/hardware.json`](../pytest_opprof/data/hardware.json)"
        " by `python knowledge/render_hardware.py`; edit the JSON, then re-run the script (a unit"
        " test fails while this page is stale).",
        "",
        f"- **Peaks:** {table['peak_basis']}",
        "- **Units in the JSON:** base units — FLOP/s, bytes/s, bytes, Hz. "
        + table["capacity_convention"],
        f"- **Matching:** {table['matching']}",
        "",
        "Peak rates below are in TFLOP/s (dense). The ridge point is BF16 peak / memory bandwidth:"
        " work with fewer FLOP per DRAM byte than that is memory-bound.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    lines += [_summary_row(gpu) for gpu in table["gpus"]]
    lines += ["", "## Per GPU", ""]
    for gpu in table["gpus"]:
        lines += _detail(gpu)
    lines += ["## Fallback when nothing is known", ""]
    lines += _detail(table["generic"])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if hardware.md is stale")
    args = parser.parse_args(argv)
    text = render(json.loads(JSON_PATH.read_text(encoding="utf-8")))
    if args.check:
        current = MD_PATH.read_text(encoding="utf-8") if MD_PATH.exists() else ""
        if current != text:
            print(f"{MD_PATH} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    MD_PATH.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
