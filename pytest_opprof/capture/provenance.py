"""Which ATen ops each Inductor-generated kernel computes, read from Inductor's own output code.

Inductor writes the provenance of a fused kernel into the wrapper module it generates
(``torch._inductor.utils.get_kernel_metadata``, the same text in torch 2.11 and 2.13)::

    # kernel path: /tmp/torchinductor_u/ab/cab....py
    # Topologically Sorted Source Nodes: [x, y], Original ATen: [aten.convolution, aten.relu]
    # Source node to ATen node mapping: ...
    triton_poi_fused_convolution_relu_0 = async_compile.triton('triton_poi_fu...', '''
    ...
        # Topologically Sorted Source Nodes: [x, y], Original ATen: [aten.convolution, aten.relu]
        stream0 = get_raw_stream(0)
        triton_poi_fused_convolution_relu_0.run(buf1, arg1_1, 4096, stream=stream0)

Both the comment above the definition and the one above the ``.run(`` call site are read. Older
releases wrote ``# Source Nodes: [...]`` (no "Topologically Sorted"); Inductor writes ``Unsorted``
when the nodes span several graphs. The same comment above ``extern_kernels.mm(...)`` belongs to
an extern call, not to a generated kernel, and is skipped.

The C++ kernels of the CPU backend carry no such comment (torch 2.13: ``CppScheduling`` writes
none). Their name is built from the same data, ``cpp_fused_<sorted op names>_<n>``
(``config.cpp.descriptive_names = "original_aten"``, the default), so a kernel without a comment
is decoded from its name against a vocabulary of ATen op names: the ops this module's comments
name, then ``known_ops``. With ``config.cpp.enable_kernel_profile`` the kernel body opens a
``RAIIAtenRecordFunctionHandle`` named ``graph_<id>_<kernel>``; that name is what the profiler
records, so it is added as an alias with the kernel's ops.

``parse_provenance`` is pure; ``collect_inductor_provenance`` imports torch when called.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

_PROVENANCE_COMMENT = re.compile(
    r"^\s*(?:#|//)\s*(?:Topologically Sorted |Unsorted )?Source Nodes: \[[^\]]*\], "
    r"Original ATen: \[(?P<aten>[^\]]*)\]"
)
_DEFINITION = re.compile(r"^(?P<name>[A-Za-z_]\w*) = async_compile\.\w+\(")
_RUN_CALL = re.compile(r"\b(?P<name>[A-Za-z_]\w*)\.run\(")
_DIRECT_CALL = re.compile(r"^\s*(?:[\w ,]+=\s*)?(?P<name>[A-Za-z_]\w*)\(")
_EXTERN_CALL = re.compile(r"\bextern_kernels\.\w+\(|\btorch\.ops\.\w+\.\w+|\baten\.\w+[.(]")
_RECORD_FUNCTION_ALIAS = re.compile(r'RAIIAtenRecordFunctionHandle\s+\w+\(\s*"(?P<alias>[^"]+)"')
_DESCRIPTIVE_NAME = re.compile(r"^(?:triton_[a-z]+|cpp)_fused_(?P<body>\w+?)_\d+$")


def aten_name(qualified: str) -> str:
    """``aten.convolution`` → ``aten::convolution``; a higher-order op's bare name is kept."""
    namespace, dot, op = qualified.strip().partition(".")
    return f"{namespace}::{op}" if dot else namespace


def parse_provenance(source: str, known_ops: Iterable[str] = ()) -> dict[str, list[str]]:
    """Map each kernel defined in one Inductor wrapper module to the ATen ops it fuses.

    ``known_ops`` (``aten::relu`` style) only serves to decode the names of kernels that carry
    no provenance comment; ``collect_inductor_provenance`` passes every registered ATen op.
    Keys are exact kernel names, only those whose ops are known; values keep Inductor's order,
    without duplicates.
    """
    found: dict[str, list[str]] = {}
    commented: list[list[str]] = []  # every comment's ops, extern calls' too: the vocabulary
    defined: list[str] = []
    aliases: dict[str, str] = {}
    block_ops: list[str] | None = None  # provenance in the comment block just above this line
    pending_ops: list[str] | None = None  # provenance waiting for its call site
    body_of: str | None = None  # the kernel whose source string we are inside

    for line in source.splitlines():
        if body_of is not None:
            handle = _RECORD_FUNCTION_ALIAS.search(line)
            if handle:
                aliases[handle["alias"]] = body_of
            if line.lstrip().startswith("'''"):
                body_of = None
            continue
        stripped = line.strip()
        comment = _PROVENANCE_COMMENT.match(line)
        if comment:
            ops = _split_ops(comment["aten"])
            commented.append(ops)
            block_ops = ops
            pending_ops = ops
            continue
        if stripped.startswith("#"):
            continue
        definition = _DEFINITION.match(line)
        if definition:
            name = definition["name"]
            defined.append(name)
            found.setdefault(name, [])
            if block_ops is not None:
                _extend(found[name], block_ops)
            if line.count("'''") % 2 == 1:
                body_of = name
            block_ops = None
            pending_ops = None
            continue
        block_ops = None
        if pending_ops is None or not stripped:
            continue
        called = _called_kernel(line, found)
        if called is not None:
            _extend(found[called], pending_ops)
            pending_ops = None
        elif _EXTERN_CALL.search(line):
            pending_ops = None  # the comment belonged to an extern kernel or a fallback op

    vocabulary = _vocabulary(commented, known_ops)
    for name in defined:
        if not found[name]:
            found[name] = decode_kernel_name(name, vocabulary)
    for alias, kernel in aliases.items():
        found.setdefault(alias, list(found.get(kernel, [])))
    return {name: ops for name, ops in found.items() if ops}


def decode_kernel_name(name: str, vocabulary: dict[str, str]) -> list[str]:
    """The ops of a descriptive kernel name (``cpp_fused_mean_relu_1``), or ``[]``.

    Inductor joins the sorted, distinct op names with ``_`` (``get_fused_kernel_name``), and op
    names contain ``_`` themselves, so the body is split into a strictly increasing sequence of
    names from ``vocabulary`` (short name → qualified name), using as few ops as possible.
    Nothing is guessed: a body that has no such split decodes to ``[]``.
    """
    match = _DESCRIPTIVE_NAME.match(name)
    if not match or not vocabulary:
        return []
    body = match["body"]

    @cache
    def split(start: int, previous: str) -> tuple[str, ...] | None:
        if start == len(body):
            return ()
        best: tuple[str, ...] | None = None
        end = start
        while end < len(body):
            end = body.find("_", end + 1)
            if end == -1:
                end = len(body)
            token = body[start:end]
            if token in vocabulary and token > previous:
                rest = split(end + 1 if end < len(body) else end, token)
                if rest is not None and (best is None or len(rest) + 1 < len(best)):
                    best = (token, *rest)
        return best

    tokens = split(0, "")
    return [vocabulary[token] for token in tokens] if tokens else []


def collect_inductor_provenance() -> dict[str, list[str]]:
    """Provenance of every kernel in the wrapper modules Inductor has loaded in this process.

    Call it in the process that compiled the model, after the compiled calls ran; the runner
    passes the result to ``attribution.build_timeline``. Kernel numbering restarts in each graph,
    so two graphs can each hold a ``triton_poi_fused_add_0``; the descriptive name already fixes
    the set of ops, and the lists of such kernels are merged.
    """
    try:
        from torch._inductor.codecache import PyCodeCache
    except ImportError:  # a torch without Inductor: nothing was compiled by it
        return {}
    known = _registered_aten_ops()
    provenance: dict[str, list[str]] = {}
    for source in _module_sources(PyCodeCache):
        for name, ops in parse_provenance(source, known).items():
            _extend(provenance.setdefault(name, []), ops)
    return provenance


def _module_sources(cache: Any) -> Iterator[str]:
    """The source text of each distinct module in ``PyCodeCache``, in a stable order.

    torch 2.11 and 2.13 keep ``modules`` (a list) and ``modules_no_attr`` (path → module);
    releases before 2.5 kept ``cache`` (key → module). Each is read when present.
    """
    modules: dict[int, ModuleType] = {}
    for attribute in ("modules", "modules_no_attr", "cache"):
        held = getattr(cache, attribute, None)
        if isinstance(held, dict):
            held = list(held.values())
        if not isinstance(held, (list, tuple)):
            continue
        for module in held:
            if isinstance(module, ModuleType):
                modules.setdefault(id(module), module)
    paths = sorted({str(getattr(m, "__file__", "") or "") for m in modules.values()} - {""})
    for path in paths:
        try:
            yield Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:  # the cache directory was cleaned under us
            log.debug("cannot read Inductor module %s: %s", path, exc)


def _registered_aten_ops() -> tuple[str, ...]:
    import torch

    try:
        names = torch._C._dispatch_get_all_op_names()
    except AttributeError:  # not a public API; decoding then uses the comments' ops only
        return ()
    return tuple(sorted({n.partition(".")[0] for n in names if n.startswith("aten::")}))


def _called_kernel(line: str, kernels: dict[str, list[str]]) -> str | None:
    run = _RUN_CALL.search(line)
    if run and run["name"] in kernels:
        return run["name"]
    direct = _DIRECT_CALL.match(line)
    if direct and direct["name"] in kernels:
        return direct["name"]
    return None


def _vocabulary(seen: Iterable[list[str]], known_ops: Iterable[str]) -> dict[str, str]:
    """Short op name → qualified name; ops named in this module's comments win."""
    vocabulary: dict[str, str] = {}
    for op in known_ops:
        vocabulary.setdefault(op.partition("::")[2] or op, op)
    for ops in seen:
        for op in ops:
            vocabulary[op.partition("::")[2] or op] = op
    return vocabulary


def _split_ops(text: str) -> list[str]:
    ops: list[str] = []
    _extend(ops, [aten_name(part) for part in text.split(",") if part.strip()])
    return ops


def _extend(target: list[str], ops: Iterable[str]) -> None:
    for op in ops:
        if op not in target:
            target.append(op)
