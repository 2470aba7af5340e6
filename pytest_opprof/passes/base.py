"""What every pass shares: the result type, the one log line, the never-half-mutated wrapper,
and the small FX helpers (fake values, compile-time constants) the graph passes read.

A graph pass is ``apply(gm, example_inputs) -> PassResult``. ``example_inputs`` line up with the
graph's placeholders. An entry counts as a *compile-time constant* only when it is a real
(non-fake) tensor that is an ``nn.Parameter`` or that Dynamo marked static (module buffers,
``torch._dynamo.mark_static_address``); passes may read the values of such tensors and bake
them into the graph. Anything else (fake tensors, plain activations, ``None``) is a runtime value
whose data is never read. Weight-reading passes therefore use real values where they exist and
decline to transform (``NOT_APPLIED``) where they do not.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_leaves

Status = Literal["APPLIED", "NOT_APPLIED", "FAILED"]
Level = Literal["functional", "aten", "non_graph", "inductor_config"]

LOGGER = logging.getLogger("pytest_opprof.passes")


@dataclass(frozen=True)
class PassResult:
    """What one pass did: ``matches`` is how many times it applied (or, for ``stub_detection``,
    how many untransformable sites it found); ``detail`` says what, or the error text."""

    name: str
    status: Status
    detail: str
    matches: int = 0

    @property
    def level(self) -> int:
        return logging.INFO if self.status == "APPLIED" else logging.WARNING

    @property
    def message(self) -> str:
        """The log line without its level name (what goes through ``logging``)."""
        if self.status == "APPLIED":
            return f"[pass_{self.name}] Applied: {self.detail}"
        if self.status == "NOT_APPLIED":
            return f"[pass_{self.name}] Pattern not found"
        return f"[pass_{self.name}] Failed: {self.detail}"

    def log_line(self) -> str:
        """``INFO [pass_<name>] Applied: …`` / ``WARNING [pass_<name>] Pattern not found`` /
        ``WARNING [pass_<name>] Failed: <error>`` (knowledge/validation-failures.md)."""
        return f"{logging.getLevelName(self.level)} {self.message}"

    def log(self) -> PassResult:
        LOGGER.log(self.level, "%s", self.message)
        return self


@dataclass(frozen=True)
class PassSpec:
    """A registry entry. ``apply``'s signature depends on ``level``: graph passes take
    ``(gm, example_inputs)``, non-graph passes ``(model, inputs, **params)``, Inductor-config
    passes are ``config_patches(**params)``."""

    name: str
    level: Level
    apply: Callable[..., Any]
    description: str


def applied(name: str, detail: str, matches: int) -> PassResult:
    return PassResult(name, "APPLIED", detail, matches).log()


def not_applied(name: str, detail: str = "pattern not found", matches: int = 0) -> PassResult:
    return PassResult(name, "NOT_APPLIED", detail, matches).log()


def failed(name: str, error: BaseException | str) -> PassResult:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return PassResult(name, "FAILED", text).log()


Rewrite = Callable[[torch.fx.GraphModule, Sequence[Any]], tuple[int, str]]


def run_graph_pass(
    name: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], rewrite: Rewrite
) -> PassResult:
    """Run ``rewrite`` (which returns ``(matches, detail)``) on ``gm`` in place.

    On a match the graph is linted and recompiled once. On an exception the graph and the
    attributes the rewrite added are restored, so a failing pass leaves ``gm`` as it was.
    """
    saved_graph = copy.deepcopy(gm.graph)  # node for node, in order
    for old, new in zip(gm.graph.nodes, saved_graph.nodes, strict=True):
        new.__dict__.update(old.__dict__)  # what FX does not copy, e.g. Dynamo's _dynamo_source
    saved_attrs = set(gm.__dict__) | set(gm._parameters) | set(gm._buffers) | set(gm._modules)
    sources = getattr(gm, "_param_name_to_source", None)
    saved_sources = dict(sources) if isinstance(sources, dict) else None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        # Inner compile runs under Inductor's fake mode; the passes compute on real tensors
        # (weights) and enter the fake mode explicitly where they want fake values.
        with unset_fake_temporarily():
            matches, detail = rewrite(gm, example_inputs)
        if matches:
            gm.graph.lint()
            gm.recompile()
    except Exception as exc:  # a pass must never take the compile down with it
        _restore(gm, saved_graph, saved_attrs)
        if saved_sources is not None and isinstance(sources, dict):
            sources.clear()
            sources.update(saved_sources)
        return failed(name, exc)
    if not matches:
        return not_applied(name, detail)
    return applied(name, detail, matches)


def _restore(gm: torch.fx.GraphModule, graph: torch.fx.Graph, attrs: set[str]) -> None:
    for store in (gm._parameters, gm._buffers, gm._modules):
        for key in [k for k in store if k not in attrs]:
            del store[key]
    for key in [k for k in gm.__dict__ if k not in attrs]:
        del gm.__dict__[key]
    gm.graph = graph  # the setter re-owns the graph and recompiles


# ------------------------------------------------------------------- compilation target

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("opprof_target", default=None)


@contextlib.contextmanager
def compiling_for(target: str) -> Iterator[None]:
    """Tell the passes run inside this block who lowers their output (``"inductor"`` from
    ``make_backend``), so a pass can decline a rewrite that compiler cannot lower."""
    token = _TARGET.set(target)
    try:
        yield
    finally:
        _TARGET.reset(token)


def compile_target() -> str | None:
    return _TARGET.get()


# ----------------------------------------------------------------------------- FX helpers


def fake_value(node: Any) -> Any:
    """The fake value FX recorded for ``node``: ``meta["val"]`` on aten graphs (AOT, make_fx),
    ``meta["example_value"]`` on Dynamo graphs; ``None`` when neither is there."""
    if not isinstance(node, torch.fx.Node):
        return node
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def meta_key(graph: torch.fx.Graph) -> str:
    for node in graph.nodes:
        if "val" in node.meta:
            return "val"
    return "example_value"


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or (isinstance(t, torch.Tensor) and t.device.type == "meta")


def is_constant_tensor(t: Any) -> bool:
    """A real tensor whose value may be baked into the graph: a parameter or a buffer that Dynamo
    marked static (torch >= 2.5 marks the parameters and buffers of inlined nn modules through
    ``mark_static_address``, which sets ``_dynamo_static_input_type``)."""
    if not isinstance(t, torch.Tensor) or is_fake(t):
        return False
    if isinstance(t, torch.nn.Parameter):
        return True
    return getattr(t, "_dynamo_static_input_type", None) is not None


def placeholder_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> dict[Any, Any]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders, example_inputs, strict=False))


def get_attr_value(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def register_constant(gm: torch.fx.GraphModule, prefix: str, value: torch.Tensor) -> str:
    """Store ``value`` on ``gm`` under a fresh name (a non-persistent buffer, as Inductor's
    freezing does for its ``_frozen_param`` constants) and return the name.

    Marked as freezing marks its constants (``_is_frozen_param``; the graph's
    ``_has_frozen_params``): Inductor's FX graph cache then keys the graph on the constant's
    shape, dtype and strides instead of its values, and the compiled graph reads the values
    from the graph module it is given, on a hit too (``CompiledFxGraphConstantsWithGm``,
    torch 2.11 and 2.13), so a hit never serves another model's weights. Keyed by value, each
    compile turned every folded weight into a Python list (``Tensor.tolist``), seconds per
    compile for a real model's weights (docs/design-notes.md#folded-weights-in-the-cache-key)."""
    index = 0
    while hasattr(gm, f"{prefix}{index}"):
        index += 1
    name = f"{prefix}{index}"
    gm.register_buffer(name, value, persistent=False)
    note_attribute_source(gm, name)
    value._is_frozen_param = True  # type: ignore[attr-defined]
    gm._has_frozen_params = True  # type: ignore[assignment]
    return name


def note_attribute_source(gm: torch.fx.GraphModule, name: str, source: Any = None) -> None:
    """Give a new tensor attribute of a *Dynamo* graph module its entry in
    ``_param_name_to_source``: AOTAutograd lifts every parameter and buffer of the module it
    compiles and asserts that each has one (``_try_get_metadata_from_dynamo``, torch 2.11 and
    2.13). The source only serves duplicate-input guards, which a fresh constant never needs,
    so a ``ConstantSource`` naming it will do."""
    sources = getattr(gm, "_param_name_to_source", None)
    if not isinstance(sources, dict):
        return  # not a Dynamo graph (an aten graph, or a hand-built one)
    if source is None:
        from torch._dynamo.source import ConstantSource

        source = ConstantSource(f"__opprof_{name}")
    sources[name] = source


def fake_mode_of(values: Iterator[Any] | Sequence[Any]) -> Any:
    """The fake mode of the first fake tensor in ``values`` (searched through tuples / lists,
    e.g. the value of a ``split``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for v in tree_leaves(list(values)):
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def _flat_fakes(node: torch.fx.Node) -> list[Any]:
    return [fake_value(n) for n in node.all_input_nodes]


def set_fake_value(node: torch.fx.Node, key: str, like: Sequence[torch.fx.Node] = ()) -> None:
    """Record ``node``'s fake value by running its target on its inputs' fake values.

    ``get_attr`` constants are fakified in the fake mode of ``like``. Where no fake mode is at
    hand (a graph traced without fake values) nothing is recorded; the passes then treat the
    node's dtype and shape as unknown.
    """
    if node.op == "get_attr":
        mode = fake_mode_of(fake_value(n) for n in like)
        if mode is None:
            return
        owner = node.graph.owning_module
        assert owner is not None
        real = get_attr_value(owner, str(node.target))
        node.meta[key] = _fakify(mode, real)
        return
    mode = fake_mode_of(_flat_fakes(node))
    if mode is None:
        return
    args = map_aggregate(node.args, fake_value)
    kwargs = map_aggregate(node.kwargs, fake_value)
    with mode:
        if node.op == "call_method":
            self_arg, *rest = args
            node.meta[key] = getattr(self_arg, str(node.target))(*rest, **kwargs)
        else:
            target: Any = node.target
            node.meta[key] = target(*args, **kwargs)


def _fakify(mode: Any, real: torch.Tensor) -> Any:
    try:
        return mode.from_tensor(real, static_shapes=True)
    except TypeError:  # a torch without the static_shapes keyword
        return mode.from_tensor(real)


# ------------------------------------------------------------------------- constant values


class ConstantEvaluator:
    """Values of the nodes that depend only on compile-time constants (see the module
    docstring), computed on the real tensors. ``value(node)`` is ``None`` for anything else."""

    _MISSING = object()

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.gm = gm
        self.inputs = placeholder_inputs(gm, example_inputs)
        self._memo: dict[torch.fx.Node, Any] = {}

    def value(self, node: Any) -> Any:
        if not isinstance(node, torch.fx.Node):
            return node
        if node not in self._memo:
            self._memo[node] = self._compute(node)
        result = self._memo[node]
        return None if result is self._MISSING else result

    def is_constant(self, node: Any) -> bool:
        return not isinstance(node, torch.fx.Node) or self.value(node) is not None

    def _compute(self, node: torch.fx.Node) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if node.op == "placeholder":
            value = self.inputs.get(node)
            return value if is_constant_tensor(value) else self._MISSING
        if node.op == "get_attr":
            value = get_attr_value(self.gm, str(node.target))
            ok = isinstance(value, torch.Tensor) and not is_fake(value)
            return value if ok else self._MISSING
        if node.op not in ("call_function", "call_method") or not _pure(node):
            return self._MISSING
        missing = False

        def resolve(a: Any) -> Any:
            nonlocal missing
            if isinstance(a, torch.fx.Node):
                v = self.value(a)
                if v is None:
                    missing = True
                return v
            return a

        args = map_aggregate(node.args, resolve)
        kwargs = map_aggregate(node.kwargs, resolve)
        if missing:
            return self._MISSING
        try:
            with unset_fake_temporarily(), torch.no_grad():
                if node.op == "call_method":
                    self_arg, *rest = args
                    return getattr(self_arg, str(node.target))(*rest, **kwargs)
                target: Any = node.target
                return target(*args, **kwargs)
        except Exception:
            return self._MISSING


def _in_place_name(name: str) -> bool:
    """``add_`` / ``masked_fill_``, but not dunders such as ``__eq__`` (torch 2.11's Dynamo
    records ``t == 0`` on a buffer as ``call_method __eq__``)."""
    return name.endswith("_") and not name.endswith("__")


def _pure(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op == "call_method":
        return isinstance(target, str) and not _in_place_name(target)
    if isinstance(target, torch._ops.OpOverload):
        seeded = torch.Tag.nondeterministic_seeded in target.tags
        return not (target._schema.is_mutable or seeded)
    name = getattr(target, "__name__", "")
    if _in_place_name(name):
        return False
    return not (name.startswith("rand") or name in {"dropout", "bernoulli", "normal"})


# ------------------------------------------------------------------------ target matching


def is_op(node: Any, *packets: Any) -> bool:
    """``node`` calls one of ``packets`` (aten overload packets such as ``aten.mm``, or exact
    overloads / Python callables)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return any(target is p or (packet is not None and packet is p) for p in packets)


def is_erased(node: torch.fx.Node) -> bool:
    return bool(getattr(node, "_erased", False))


def erase_if_dead(graph: torch.fx.Graph, nodes: Sequence[Any]) -> int:
    """Erase ``nodes`` that nothing reads any more, and then their inputs that became unread,
    recursively (placeholders and impure nodes stay). Returns how many were erased."""
    pending = [n for n in nodes if isinstance(n, torch.fx.Node)]
    erased = 0
    while pending:
        node = pending.pop()
        if is_erased(node) or node.users or node.op in ("placeholder", "output"):
            continue
        if node.op != "get_attr" and node.is_impure():
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased += 1
        pending.extend(inputs)
    return erased


def reapply_views(
    graph: torch.fx.Graph, result: torch.fx.Node, views: Sequence[torch.fx.Node], key: str
) -> torch.fx.Node:
    """``views`` (outermost first, as found walking down from a use) applied again, innermost
    first, on ``result``, at the graph's insertion point; the last new node (``result`` where
    there are none)."""
    for view in reversed(views):
        op: Any = view.target
        result = graph.call_function(op, (result, *view.args[1:]), dict(view.kwargs))
        set_fake_value(result, key)
    return result


def single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def scalar(value: Any) -> float | None:
    """A plain Python number (not bool, not symbolic) as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


GETITEM = operator.getitem


# ------------------------------------------------------------------ Inductor config patches

OPPROF_PREFIX = "opprof."
"""Config-patch keys under this prefix are not Inductor config: ``make_backend`` consumes them."""

ALLOW_TF32 = "opprof.allow_tf32"


def known_inductor_keys() -> frozenset[str]:
    from torch._inductor import config

    # get_config_copy() flattens nested config classes to dotted keys ("triton.cudagraphs") on
    # torch 2.11 and 2.13 alike.
    return frozenset(config.get_config_copy())


def supported_config(patches: Any) -> dict[str, Any]:
    """``patches`` without the Inductor keys this torch lacks, so a plan written on one torch
    version still compiles on another; each dropped key is logged."""
    known = known_inductor_keys()
    kept: dict[str, Any] = {}
    for key, value in dict(patches).items():
        if key.startswith(OPPROF_PREFIX) or key in known:
            kept[key] = value
        else:
            LOGGER.warning(
                "[inductor_config] %r is not an Inductor config key in torch %s; dropped",
                key,
                torch.__version__,
            )
    return kept
