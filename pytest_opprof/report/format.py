"""How a report writes a figure, a word and a line: number formats, code spans, wrapped prose
and tables that fit.

Every report of the package formats through here, so a figure reads the same in ``report.md``,
the session report, the terminal table and the trend page. Its promise about width: no line
these helpers return is longer than ``LINE_LIMIT`` characters — prose is wrapped at ``WRAP``,
and a table cell too wide for its column is cut, its full text listed under the table.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence

from tabulate import tabulate

from pytest_opprof.schema import CPU_NOT_ENFORCED, WorkloadSummary

DASH = "—"
BASELINE_LABELS = {"eager": "eager", "compile": "torch.compile", "stock": "stock PyTorch"}
LINE_LIMIT = 300
"""The longest line a report may hold (issue #41): a reader scrolls sideways past it."""
WRAP = 100
"""Where prose is wrapped: the width of the source, like the code's."""
MIN_CELL = 12
"""A table cell is never cut below this many characters."""


def verdict(s: WorkloadSummary) -> str:
    """The status a reader is shown: never ``passed`` where the gate was not enforced (the CPU
    fallback, issue 37); a failure or an error keeps its own word."""
    return CPU_NOT_ENFORCED if s.status == "passed" and not s.enforced else s.status


def fmt_ms(value: float | None, *, unit: bool = True) -> str:
    """Milliseconds with three decimals (three significant digits below 0.1 ms)."""
    if value is None:
        return DASH
    text = f"{value:.3f}" if value == 0 or abs(value) >= 0.1 else f"{value:.3g}"
    return f"{text} ms" if unit else text


def fmt_us(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value:,.1f} µs" if abs(value) >= 1 else f"{value:.2f} µs"


def fmt_x(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}×"


def fmt_speedup(ratio: float | None, low: float | None = None, high: float | None = None) -> str:
    """``1.23× (95% CI 1.20–1.26)``; the bare ratio when no interval was measured."""
    if ratio is None:
        return DASH
    if low is None or high is None:
        return fmt_x(ratio)
    return f"{ratio:.2f}× (95% CI {low:.2f}–{high:.2f})"


def fmt_pct(share: float | None) -> str:
    return DASH if share is None else f"{share * 100:.1f}%"


def fmt_count(value: float) -> str:
    return f"{value:.0f}" if abs(value - round(value)) < 1e-9 else f"{value:.1f}"


def fmt_dtype(dtype: str | None) -> str:
    return DASH if not dtype else dtype.removeprefix("torch.")


def code(text: str, limit: int = 0) -> str:
    if limit and len(text) > limit:
        text = text[: limit - 1] + "…"
    return "`" + text.replace("`", "'") + "`"


def one_line(text: str, limit: int = 400) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with ``…``; a code span it cuts is closed again."""
    if len(text) <= limit:
        return text
    cut = text[: max(limit - 1, 1)]
    if cut.count("`") % 2:
        cut = cut[: max(limit - 2, 1)] + "…`"
        return cut
    return cut + "…"


# ------------------------------------------------------------------------------------ prose

_BLOCK_START = re.compile(r"^(?:[-+*](?:\s|$)|[>|]|#{1,6}(?:\s|$)|\d+[.)](?:\s|$)|[=-]+$|```|~~~)")
"""What would turn a wrapped line into a list item, a quote, a heading or a table row."""


def _split_long_words(text: str, room: int) -> str:
    """A word longer than a whole line (a templated kernel name) is cut into pieces."""
    words = []
    for word in text.split():
        words += (
            [word[i : i + room] for i in range(0, len(word), room)] if len(word) > room else [word]
        )
    return " ".join(words)


def wrap(text: str, *, first: str = "", rest: str | None = None, width: int = WRAP) -> list[str]:
    """Prose as lines of at most ``width`` (longer only where a word is): ``first`` starts the
    first line (a ``- `` bullet), ``rest`` the others (its indent; ``first``'s width in
    spaces by default). No line it starts may read as a new Markdown block."""
    indent = " " * len(first) if rest is None else rest
    room = LINE_LIMIT - max(len(first), len(indent)) - 1
    flat = _split_long_words(str(text), room)
    lines = textwrap.wrap(
        flat,
        width=width,
        initial_indent=first,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [first.rstrip()]
    out = [lines[0]]
    for line in lines[1:]:
        body = line[len(indent) :]
        while _BLOCK_START.match(body) and len(out[-1]) < LINE_LIMIT - 40:
            word, _, body = body.partition(" ")
            out[-1] += " " + word
            if not body:
                break
        if body:
            out.append(indent + body)
    return out


def para(text: str) -> list[str]:
    """One wrapped paragraph and the blank line after it."""
    return [*wrap(text), ""]


def bullet(text: str, *, marker: str = "- ", level: int = 0) -> list[str]:
    """One list item, wrapped, its continuation lines indented under its text."""
    pad = "  " * level
    return wrap(text, first=pad + marker, rest=pad + " " * len(marker))


# ------------------------------------------------------------------------------------ tables


def _escape(value: str) -> str:
    return value.replace("\n", " ").replace("|", "\\|")


def _render(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    text = tabulate(
        [[_escape(c) for c in row] for row in rows],
        headers=[_escape(h) for h in headers],
        tablefmt="github",
        disable_numparse=True,
    )
    return text.splitlines()


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    caps: Mapping[int, int] | None = None,
    key: int | None = 0,
    elsewhere: bool = False,
) -> list[str]:
    """A GitHub Markdown table within ``LINE_LIMIT``; cells are escaped so a ``|`` in a name
    cannot break it. A cell longer than its column's cap (``caps``: column -> characters), or
    than the width the line leaves its column, is cut; the table is then followed by each cut
    cell's full text, named by its row's ``key`` column (its number where that is cut too)
    and its header — unless the caller shows every cell in full ``elsewhere``."""
    heads = [str(h) for h in headers]
    full = [[str(c).replace("\n", " ") for c in row] for row in rows]
    limits = {j: max(MIN_CELL, n) for j, n in (caps or {}).items()}
    while True:
        cells = [
            [clip(c, limits[j]) if j in limits else c for j, c in enumerate(row)] for row in full
        ]
        lines = _render(heads, cells)
        excess = max(map(len, lines)) - LINE_LIMIT
        if excess <= 0:
            break
        widths = [max((len(_escape(r[j])) for r in cells), default=0) for j in range(len(heads))]
        wide = max(range(len(heads)), key=lambda j: widths[j])
        if widths[wide] <= MIN_CELL:
            break  # nothing left to cut: more columns than a line holds
        limits[wide] = max(MIN_CELL, widths[wide] - excess)
    lines.append("")
    cut = [
        (i, j) for i, row in enumerate(full) for j, value in enumerate(row) if cells[i][j] != value
    ]
    if cut and not elsewhere:
        lines += ["Cut to fit the table above, in full:", ""]
        for i, j in cut:
            # a row is named by its key cell, or by its number where that cell was cut too
            named = key is not None and key < len(full[i]) and cells[i][key] == full[i][key]
            name = full[i][key] if named and key is not None else f"row {i + 1}"
            name = f"#{name}" if name.isdigit() else name
            lines += bullet(f"{name} · {heads[j]}: {full[i][j]}")
        lines.append("")
    return lines


# --------------------------------------------------------------------- Markdown from others

_PREFIX = re.compile(r"^(\s*(?:[-+*]|\d+[.)])\s+|\s*>\s?|\s*)")


def _table_cells(row: str) -> list[str]:
    body = row.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", body)]


def fit_markdown(text: str) -> list[str]:
    """Markdown written elsewhere (implementation notes, a plugin's section) within
    ``LINE_LIMIT``: a long prose line is wrapped under its own bullet or quote, a table with
    a long row is laid out again by :func:`table`, a long heading is cut and a long line of
    code is split where the limit falls."""
    lines = text.strip("\n").splitlines()
    out: list[str] = []
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if fenced or line.lstrip().startswith(("```", "~~~")):
            out += [line[k : k + LINE_LIMIT] for k in range(0, max(len(line), 1), LINE_LIMIT)]
            i += 1
            continue
        if line.lstrip().startswith("|") and i + 1 < len(lines) and "-" in lines[i + 1]:
            end = i
            while end < len(lines) and lines[end].lstrip().startswith("|"):
                end += 1
            block = lines[i:end]
            if max(map(len, block)) > LINE_LIMIT:
                out += table(_table_cells(block[0]), [_table_cells(r) for r in block[2:]])[:-1]
            else:
                out += block
            i = end
            continue
        if len(line) <= LINE_LIMIT:
            out.append(line)
        elif line.lstrip().startswith("#"):
            out.append(clip(line, LINE_LIMIT))
        else:
            found = _PREFIX.match(line)
            prefix = found.group(0) if found else ""
            rest = prefix if ">" in prefix else " " * len(prefix)
            out += wrap(line[len(prefix) :], first=prefix, rest=rest)
        i += 1
    return out
