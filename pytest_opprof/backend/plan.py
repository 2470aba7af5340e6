"""From proposals to backend plans: which pass runs at which IR level, and the variant ladder
that measured selection times.

Pure Python. A proposal's ``type`` names the pass; its ``ir_level`` routes it. The ladder adds
the proposals one group at a time in a fixed order, so each rung's gain can be attributed to
what it added: CUDA graphs, then precision, then the graph rewrites (one type per rung), layout
and Inductor settings. A plan is a set of changes, built the same way whatever the order its
rungs were timed in; the order decides what each rung is timed against.

A rung is timed against the plan below it, so the ladder starts with the two changes that
move a call's time the most, and every later rung is timed in the conditions of the plan it
would end in. Where the plan's GPU waits on the host, a shorter kernel gains nothing
measurable, so CUDA graphs come first; and a rewrite's gain can depend on the precision, so
precision comes before the rewrites (docs/design-notes.md#the-ladders-order).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_opprof.options import TRANSFORMATION_TYPES
from pytest_opprof.schema import BackendPlan, Proposal

# Rung order of the ladder; proposal types not listed are graph passes, in the "graph" place.
LADDER_ORDER: tuple[str, ...] = (
    "cuda_graphs",
    "dtype_promotion",
    "gemm_out_dtype",
    "graph",
    "gemm_algorithm",
    "memory_layout",
    "batch_padding",
    "pretranspose_weights",
    "algorithm_selection",
)

# Types that change the computation's precision: reported apart from graph changes.
PRECISION_TYPES = frozenset({"dtype_promotion"})
# Types that never transform anything (reported only).
REPORT_ONLY_TYPES = frozenset({"stub_detection"})


def add_proposal(plan: BackendPlan, proposal: Proposal) -> BackendPlan:
    """The plan with ``proposal`` applied at its IR level."""
    kind, params = proposal.type, proposal.params
    update: dict[str, object] = {"proposals": [*plan.proposals, proposal.id]}
    if kind in REPORT_ONLY_TYPES:
        return plan
    if kind == "stock_recipe":
        update["dtype"] = str(params["dtype"])
        update["stock_recipe"] = str(params["recipe"])
    elif kind == "dtype_promotion":
        update["dtype"] = str(params.get("dtype", "bfloat16"))
        update["autocast"] = params.get("mode") == "autocast"
    elif kind == "memory_layout":
        update["channels_last"] = True
    elif kind == "batch_padding":
        update["pad_batch_to"] = int(params.get("multiple", 8))
    elif kind == "pretranspose_weights":
        update["config_patches"] = {**plan.config_patches, "freezing": True}
    elif kind == "cuda_graphs" and params.get("scope") == "model":
        # One graph of the whole call replaces Inductor's per-graph recording (which cannot
        # run inside another capture).
        update["config_patches"] = {
            k: v for k, v in plan.config_patches.items() if k != "triton.cudagraphs"
        }
        update["cuda_graph_model"] = True
    elif kind == "cuda_graphs":
        update["config_patches"] = {**plan.config_patches, "triton.cudagraphs": True}
    elif kind == "algorithm_selection":
        patches = {str(k): v for k, v in params.get("config_patches", {}).items()}
        update["config_patches"] = {**plan.config_patches, **patches}
    elif proposal.ir_level == "functional":
        update["functional"] = canonical_order([*plan.functional, kind])
    elif proposal.ir_level == "aten":
        update["aten"] = canonical_order([*plan.aten, kind])
    else:
        return plan
    return plan.model_copy(update=update)


CANONICAL_ORDER: tuple[str, ...] = (
    "qkv_fusion",
    "sdpa_replacement",
    "bn_fold",
    "dtype_promotion",
    "memory_layout",
    "conv_im2col",
    "depthwise_taps",
    "gemm_out_dtype",
    "gemm_epilogue",
    "activation_substitution",
    "attention_backend",
    "gemm_algorithm",
)
"""The order in which the graph passes of one IR level run, whatever the order their rungs
were added to a plan in (selection's second pass adds a rung after those kept above it): a
pass runs after every pass that produces what it matches, and before every pass that consumes
what it matches. A level runs the listed passes it holds in this order, then user passes by
name. Pass by pass:

- ``qkv_fusion`` before ``sdpa_replacement``: the fusion matches the linears that read one
  activation, the attention pass the matmul chain after them whatever makes its q, k and v
  (the split of one wide linear included), so both apply in this order, the ladder's.
- ``bn_fold`` first of the aten passes: it matches a ``convolution`` / ``addmm`` / ``mm`` of a
  constant weight (a linear's through a bare ``t`` / ``permute``) and the per-channel affine
  after it, and leaves a plain ``convolution`` / ``addmm``, which the later passes match; only
  then does a linear's activation follow its GEMM directly (``gemm_epilogue``). Run after
  them, it would meet what they make of the GEMM, which it does not fold into: casts between
  the weight and the GEMM (``dtype_promotion``), ``mm.dtype`` (``gemm_out_dtype``, where a
  bf16 linear is cast to fp32 before its batch norm: one GEMM that only one of the two can
  take, and the fold removes a pass over the output), ``_addmm_activation``, ``tuned_mm``.
- ``dtype_promotion`` (the graph form) before the GEMM passes: ``gemm_out_dtype``,
  ``gemm_algorithm`` and ``gemm_epilogue``'s exact GELU match only the bf16 / fp16 GEMMs it
  makes, and ``gemm_epilogue`` follows its cast back up (``passes.gemm_epilogue``); run after
  them, it would not lower the fp32 ``_addmm_activation`` the epilogue makes.
- ``memory_layout`` (the graph form) after ``bn_fold`` and ``dtype_promotion``: it marks the
  input of each ``convolution`` that remains, at the dtype it computes in.
- ``conv_im2col`` after the three that match convolutions: it turns a ``convolution`` over
  fewer than 8 input channels into a gather and an ``mm`` / ``addmm``, so the fold must be in
  its weight, the casts around it and the layout on its input already. Before the GEMM
  passes, which may then take its ``mm`` (``gemm_algorithm`` tunes it).
- ``depthwise_taps`` after the same three, for the same reasons; it and ``conv_im2col`` match
  disjoint convolutions (grouped, one group), so either may run first.
- ``gemm_out_dtype`` before ``gemm_algorithm``: it turns ``convert(mm(bf16), fp32)`` into
  ``mm.dtype``, which ``gemm_algorithm`` tunes too, whereas ``tuned_mm`` would hide the
  ``mm`` from it.
- ``gemm_epilogue`` before ``activation_substitution`` (its aten form): the epilogue matches
  the spelled-out tanh GELU after a biased GEMM, which ``activation_substitution`` would turn
  into an ``aten.gelu`` the epilogue does not match.
- ``attention_backend`` matches only cuDNN attention, which no other pass makes or matches.
- ``gemm_algorithm`` last: it takes the ``mm`` nodes the other aten passes match.

The functional-level order uses the same tuple: of its passes, ``activation_substitution``
matches a GELU formula that neither of the attention passes touches. A plan applies
``dtype_promotion`` and ``memory_layout`` to the model (``dtype``, ``channels_last``); their
graph forms run only where a backend is made with them by name (``compiler.make_backend``),
which runs its passes in this order too.
"""


def canonical_order(names: Iterable[str]) -> list[str]:
    """``names`` without repeats (a pass rewrites every match it finds in one run) in
    ``CANONICAL_ORDER``, then the names it does not list (user passes) sorted: the same list
    whatever order ``names`` came in."""
    known = {name: i for i, name in enumerate(CANONICAL_ORDER)}
    return sorted(set(names), key=lambda n: (known.get(n, len(known)), n))


def replaced_by_model_graph(plan: BackendPlan, kind: str, scope: Any) -> bool:
    """A kept proposal of Inductor's per-graph CUDA graphs that the plan's one graph of the
    whole call (``cuda_graph_model``) replaced: its gain was measured, its setting is gone."""
    return plan.cuda_graph_model and kind == "cuda_graphs" and scope != "model"


def inside_model_graph(plan: BackendPlan, proposal: Proposal) -> bool:
    """``proposal`` is Inductor's per-graph CUDA graphs and ``plan`` already records the whole
    call as one CUDA graph: cudagraph trees cannot run inside another capture (torch 2.11:
    "Cannot prepare for replay during capturing stage"), and the outer graph already holds
    every kernel they would record, so there is nothing to build or time. The same test as
    :func:`replaced_by_model_graph`, asked before the rung is built."""
    return replaced_by_model_graph(plan, proposal.type, proposal.params.get("scope"))


def cannot_change(plan: BackendPlan, proposal: Proposal) -> str | None:
    """Why ``proposal`` can change nothing on top of ``plan``, so that selection does not
    build its rung; None where it may:

    - Inductor's per-graph CUDA graphs inside a plan that records the whole call as one
      (:func:`inside_model_graph`);
    - a ``gemm_epilogue`` with nothing but exact GELUs to fold, on GEMMs captured in float32
      that the plan keeps in float32: the pass folds an exact GELU only where the GEMM computes
      in bf16 / fp16 (``passes.gemm_epilogue``)."""
    if inside_model_graph(plan, proposal):
        return (
            "the plan records the whole call as one CUDA graph (cuda_graphs-model), "
            "inside which Inductor's CUDA graphs cannot run"
        )
    params = proposal.params
    if (
        proposal.type == "gemm_epilogue"
        and set(params.get("activations", ())) == {"gelu_exact"}
        and params.get("captured_itemsize") == 4
        and plan.dtype in (None, "float32")
    ):
        return (
            "its exact GELUs fold only where their GEMMs compute in bf16 / fp16, and the plan "
            "keeps them in float32"
        )
    return None


# The graph rewrites, each its own rung in this order (a user pass after them, by name), so
# that each one's gain is measured and reported on its own (gpt2's SDPA and GELU rewrites).
GRAPH_ORDER: tuple[str, ...] = (
    "qkv_fusion",
    "sdpa_replacement",
    "activation_substitution",
    "bn_fold",
    "conv_im2col",
    "depthwise_taps",
    "gemm_epilogue",
    "attention_backend",
)


def rung_of(proposal: Proposal) -> str:
    """``"graph"`` for a graph rewrite (its rung is named by its type), else the type."""
    return proposal.type if proposal.type in LADDER_ORDER else "graph"


@dataclass(frozen=True)
class Rung:
    name: str
    proposals: tuple[Proposal, ...]


def ladder(proposals: Sequence[Proposal]) -> list[Rung]:
    """Group the transforming proposals into rungs in ``LADDER_ORDER``, with one rung per graph
    rewrite type in the ``"graph"`` place (``GRAPH_ORDER``, then user passes by name)."""
    groups: dict[str, list[Proposal]] = {}
    for p in proposals:
        if p.type in REPORT_ONLY_TYPES:
            continue
        groups.setdefault(p.type, []).append(p)
    graph = sorted(
        (t for t in groups if rung_of(groups[t][0]) == "graph"),
        key=lambda t: (GRAPH_ORDER.index(t) if t in GRAPH_ORDER else len(GRAPH_ORDER), t),
    )
    order = [n for name in LADDER_ORDER for n in (graph if name == "graph" else [name])]
    return [Rung(name, tuple(groups[name])) for name in order if name in groups]


def plan_of(proposals: Sequence[Proposal]) -> BackendPlan:
    plan = BackendPlan()
    for p in proposals:
        plan = add_proposal(plan, p)
    return plan


def changes_precision(plan: BackendPlan) -> bool:
    return plan.dtype not in (None, "float32")


# ------------------------------------------------------------------------------ user passes

GRAPH_LEVELS: tuple[str, ...] = ("functional", "aten")
EXTRA_PASSES_ENV = "OPPROF_EXTRA_PASSES"
"""How a parent names the user passes to its child processes (``pytest_opprof.passes``)."""


@dataclass(frozen=True)
class ExtraPass:
    """A pass a conftest registered (``pytest_opprof_register_passes``), named by where it can
    be imported from, so that processes that never saw the conftest can load it."""

    name: str
    level: str
    target: str
    """``"module:qualname"`` of the ``apply(gm, example_inputs) -> PassResult`` function."""
    description: str = ""
    path: Path | None = None
    """The folder the module is imported from (put on the children's ``sys.path``)."""

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]

    def source_file(self) -> Path | None:
        """The module's file, found without importing it (for the stage cache key)."""
        top, _, rest = self.module.partition(".")
        if self.path is None:
            return None
        base = self.path.joinpath(top, *rest.split(".")) if rest else self.path / top
        candidates = (base.with_name(base.name + ".py"), base / "__init__.py")
        return next((c for c in candidates if c.is_file()), None)

    def child_entry(self) -> dict[str, str]:
        return {"target": self.target, "level": self.level, "description": self.description}


class PassRegistry:
    """What ``pytest_opprof_register_passes`` receives: the user passes of one workload.

    Pure Python: a pass given as a function is recorded by its ``module:qualname`` and never
    called here; one given as a string is not even imported.
    """

    def __init__(self) -> None:
        self._passes: dict[str, ExtraPass] = {}

    def add(
        self,
        name: Any,
        apply: Callable[..., Any] | str | None = None,
        *,
        level: str | None = None,
        description: str = "",
        path: str | Path | None = None,
    ) -> ExtraPass:
        """Register the pass ``name`` (see the hook's documentation); returns its record.

        ``name`` may be a ``PassSpec`` (``name``, ``level``, ``apply``, ``description``)."""
        if not isinstance(name, str) and hasattr(name, "apply"):
            spec = name
            name, apply = spec.name, spec.apply
            level = level or spec.level
            description = description or getattr(spec, "description", "")
        if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
            raise ValueError(f"pass name {name!r} is not a snake_case identifier")
        if name in TRANSFORMATION_TYPES:
            raise ValueError(
                f"{name!r} is a built-in pass and cannot be replaced; register yours under a "
                "new name (and skip the built-in with OPPROF['skip'] if it is in the way)"
            )
        if level not in GRAPH_LEVELS:
            raise ValueError(
                f"pass {name!r}: level {level!r} is not one of {', '.join(GRAPH_LEVELS)}; user "
                "passes are graph passes (Inductor settings: propose algorithm_selection with "
                "params={'config_patches': {...}})"
            )
        if apply is None:
            raise ValueError(f"pass {name!r}: give the function, or 'module:function'")
        target, found = _target_of(name, apply)
        folder = Path(path).resolve() if path is not None else found
        if folder is None:
            raise ValueError(
                f"pass {name!r}: module {target.partition(':')[0]!r} is not found on sys.path; "
                "pass path= (the folder that holds it)"
            )
        entry = ExtraPass(name, level, target, description, folder)
        known = self._passes.get(name)
        if known is not None and (known.target, known.level) != (entry.target, entry.level):
            raise ValueError(
                f"pass {name!r} is registered twice: as {known.target} ({known.level}) and as "
                f"{entry.target} ({entry.level})"
            )
        self._passes[name] = entry
        return entry

    def __contains__(self, name: object) -> bool:
        return name in self._passes

    def __getitem__(self, name: str) -> ExtraPass:
        return self._passes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._passes))

    def __len__(self) -> int:
        return len(self._passes)

    def values(self) -> list[ExtraPass]:
        return [self._passes[k] for k in self]


def _target_of(name: str, apply: Callable[..., Any] | str) -> tuple[str, Path | None]:
    """``("module:qualname", the folder it is imported from)`` for a function or a string."""
    if isinstance(apply, str):
        module, sep, qualname = apply.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"pass {name!r}: {apply!r} is not 'module:function'")
        _check_module(name, module)
        return apply, _import_root(module)
    found_module = getattr(apply, "__module__", None)
    found_qualname = getattr(apply, "__qualname__", None)
    if not callable(apply) or not found_module or not found_qualname:
        raise ValueError(f"pass {name!r}: {apply!r} is not a function")
    module, qualname = str(found_module), str(found_qualname)
    if "<" in qualname:
        raise ValueError(
            f"pass {name!r}: {module}.{qualname} cannot be imported by name (a lambda or a "
            "nested function); define it at the top level of a module"
        )
    _check_module(name, module)
    loaded = sys.modules.get(module)
    file = getattr(loaded, "__file__", None) or inspect.getsourcefile(apply)
    root = None
    if file:
        root = Path(file).resolve().parent
        depth = module.count(".") + (Path(file).name == "__init__.py")
        root = root.parents[depth - 1] if depth else root
    return f"{module}:{qualname}", root


def _check_module(name: str, module: str) -> None:
    last = module.rpartition(".")[2]
    if module == "__main__" or last == "conftest":
        raise ValueError(
            f"pass {name!r} is defined in {module!r}, which other processes cannot import by "
            "name: define the pass in a module of its own next to the conftest (e.g. "
            "opprof_passes.py) and register 'opprof_passes:apply'"
        )


def _import_root(module: str) -> Path | None:
    """The ``sys.path`` folder ``module`` is found under, without importing it (only a
    dotted module's top-level package is imported to find it)."""
    top = module.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    return origin.parent.parent if origin.name == "__init__.py" else origin.parent


def extra_targets(
    plan: BackendPlan, registry: Mapping[str, ExtraPass] | PassRegistry
) -> dict[str, str]:
    """``plan``'s user passes: type → ``module:qualname`` (``BackendPlan.extra_passes``)."""
    return {
        name: registry[name].target for name in [*plan.functional, *plan.aten] if name in registry
    }
