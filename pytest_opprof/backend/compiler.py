"""The pass-routing ``torch.compile`` backend that generated ``<stem>_optimized.py`` files call.

``make_backend`` returns a Dynamo backend that routes the passes across three IR levels (each
proposal's ``ir_level``, as ``backend.plan`` routes it):

1. **functional** — on the Dynamo graph, before ``compile_fx``, with Dynamo's real example
   inputs (parameters arrive as ``nn.Parameter`` graph inputs on torch >= 2.5).
2. **aten** — inside Inductor's inner compile, on the graph after AOT decomposition (with
   freezing on: as ``freeze`` starts, on that same graph; see below). The example inputs there
   are fake tensors; the backend hands the passes the REAL parameter and buffer tensors at the
   static-input positions (``static_input_idxs``), so weight-reading passes such as
   ``bn_fold`` compute with real values. Backward graphs are left alone.
3. **inductor_config** — as ``compile_fx(config_patches=...)``.

Interactions that shaped this module, checked on torch 2.13 and written for 2.11 as well:

* ``freezing`` given as a config patch does nothing on its own when Dynamo inlines built-in
  nn modules (the default since 2.5): parameters only become graph attributes when Inductor's
  ``freezing`` is already on while Dynamo *traces* (``torch/_dynamo/variables/builder.py``,
  ``is_parameter_freezing``). With ``freezing`` in the patches and autograd off, the backend
  therefore turns the parameter/buffer inputs back into graph attributes itself, so Inductor's
  ``freeze`` constant-folds them; the compiled function drops those arguments at call time.
  Freezing runs *before* inner compile (``fw_compiler_freezing``) and rewrites the graph its
  own way there: its ``freezing_passes`` fold a convolution's batch norm into frozen
  constants and, on the CPU, swap ``aten.convolution`` / ``addmm`` for packed oneDNN ops. With
  freezing on, the aten passes therefore run as ``freeze`` starts (the backend wraps it), on
  the graph inner compile receives without freezing, with the real value of each input that
  ``freeze`` is about to make a constant: every pass finds the pattern it finds without
  freezing, and freezing then constant-folds what the passes produced. Inner compile does not
  run them a second time on the frozen graph.
* Freezing, and the folds of ``bn_fold`` / ``qkv_fusion``, bake the current weight values into
  the compiled code: later in-place updates of the model's parameters are not seen. That is the
  contract of inference (``eval()``, no autograd); under autograd the backend keeps weights as
  inputs (``qkv_fusion`` concatenates them in the graph, ``bn_fold`` finds its chain read by
  the backward and declines).
* AOTAutograd's cache (``torch._functorch.config.enable_autograd_cache``) keys on the Dynamo
  graph and Inductor config; a hit skips inner compile, and with it the aten passes and their
  ``PassResult``s. The backend turns it off while it compiles. Inductor's FX graph cache stays
  on: it is keyed on the graph inner compile receives *after* the passes ran, the constants
  the passes add by their shape (``passes.base.register_constant``), whose values the
  compiled graph reads from that graph module, so it cannot serve a stale graph.
* The aten passes are also available as an Inductor custom post-grad pass
  (``aten_custom_pass``), a ``CustomGraphPass`` whose ``uuid()`` hashes the pass sources so that
  Inductor's caches key on them.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof import devicelock
from pytest_opprof.backend.plan import canonical_order
from pytest_opprof.passes import get_pass, non_graph_apply
from pytest_opprof.passes.base import (
    ALLOW_TF32,
    OPPROF_PREFIX,
    PassResult,
    PassSpec,
    compiling_for,
    fake_value,
    is_constant_tensor,
    is_fake,
    note_attribute_source,
    supported_config,
)

LOGGER = logging.getLogger("pytest_opprof.passes")

Backend = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]

_REGISTERED: dict[str, Backend] = {}


def make_backend(
    *,
    functional: Sequence[str] = (),
    aten: Sequence[str] = (),
    config_patches: Mapping[str, Any] | None = None,
    results: list[PassResult] | None = None,
    passthrough: bool = False,
) -> Backend:
    """A Dynamo backend: ``functional`` passes on the Dynamo graph, then ``compile_fx`` with
    ``aten`` passes run in inner compile (as freezing starts, where ``config_patches`` turn it
    on) and ``config_patches`` applied. Each level's passes run in the canonical order
    (``backend.plan.CANONICAL_ORDER``), whatever the order they are given in. Each
    ``PassResult`` is appended to ``results`` (once per compiled graph). Unknown pass names
    raise ``KeyError``, non-graph or config passes named as graph passes raise ``ValueError``.

    ``passthrough``: run the captured graph eagerly — what a generated backend does when
    measured selection found nothing faster than eager."""
    functional_specs = _graph_specs(canonical_order(functional))
    aten_specs = _graph_specs(canonical_order(aten))
    patches = supported_config(config_patches or {})
    allow_tf32 = bool(patches.pop(ALLOW_TF32, False))
    leftover = sorted(k for k in patches if k.startswith(OPPROF_PREFIX))
    if leftover:
        raise ValueError(f"unknown opprof config keys {leftover}; known: [{ALLOW_TF32!r}]")
    sink: list[PassResult] = results if results is not None else []
    if passthrough:
        if functional_specs or aten_specs or patches:
            raise ValueError("a passthrough backend runs no passes and takes no config")

        def eager_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            return gm.forward

        return eager_backend

    def opprof_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor import compile_fx as inductor

        # passes may compute on the real inputs
        with devicelock.on_gpu(_synchronize, "graph passes on the real inputs"):
            for spec in functional_specs:
                sink.append(spec.apply(gm, example_inputs))
        inputs = list(example_inputs)
        if patches.get("freezing") and not torch.is_grad_enabled():
            _lift_constants(gm, inputs)
        # the graphs whose aten passes ran as freeze started: inner compile gets them frozen
        before_freezing: weakref.WeakSet[torch.fx.GraphModule] = weakref.WeakSet()

        def run_aten_passes(aten_gm: torch.fx.GraphModule, pass_inputs: list[Any]) -> None:
            with compiling_for("inductor"), devicelock.on_gpu(_synchronize, "aten passes"):
                for spec in aten_specs:
                    sink.append(spec.apply(aten_gm, pass_inputs))

        def before_freeze(aot_gm: torch.fx.GraphModule, aot_inputs: Sequence[Any]) -> None:
            if aten_specs:
                run_aten_passes(aot_gm, _freezing_pass_inputs(aot_inputs))
                before_freezing.add(aot_gm)

        def inner_compile(
            aten_gm: torch.fx.GraphModule, aten_inputs: Any, *a: Any, **kw: Any
        ) -> Any:
            if aten_specs and not kw.get("is_backward", False) and aten_gm not in before_freezing:
                run_aten_passes(aten_gm, _aten_pass_inputs(aten_gm, aten_inputs, kw, inputs))
            # looked up at call time, so a patched compile_fx_inner is honoured
            with _real_constants_allowed(aten_inputs):
                return inductor.compile_fx_inner(aten_gm, aten_inputs, *a, **kw)

        freezing = _freezing(before_freeze) if patches.get("freezing") else contextlib.nullcontext()
        with _no_autograd_cache(), _tf32(allow_tf32), freezing:
            compiled: Any = inductor.compile_fx(
                gm, inputs, inner_compile=inner_compile, config_patches=dict(patches)
            )
        return _with_tf32(compiled) if allow_tf32 else compiled

    return opprof_backend


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def _freezing(
    before: Callable[[torch.fx.GraphModule, Sequence[Any]], None],
) -> Iterator[None]:
    """Inductor's ``freeze(dynamo_gm, aot_gm, example_inputs)`` with ``before(aot_gm,
    example_inputs)`` called as it starts (the aten passes, on the graph freezing is about to
    rewrite). torch 2.11 and 2.13 import ``freeze`` from ``torch._inductor.freezing`` as they
    call it (``fw_compiler_freezing``), so the module's attribute is where to wrap it.

    Freezing folds the weights on real tensors (GPU kernels) in a compile that otherwise runs
    on fake ones: where the stage process let go of the GPU while it compiles
    (``devicelock.off_gpu``), the fold takes it back for its span."""
    from torch._inductor import freezing

    original = freezing.freeze

    def freeze(dynamo_gm: Any, aot_autograd_gm: Any, example_inputs: Any) -> Any:
        before(aot_autograd_gm, example_inputs)
        with devicelock.on_gpu(_synchronize, "freezing"):
            return original(dynamo_gm, aot_autograd_gm, example_inputs)

    freezing.freeze = freeze
    try:
        yield
    finally:
        freezing.freeze = original


def register_backend(name: str, **kwargs: Any) -> str:
    """Register ``make_backend(**kwargs)`` with Dynamo as ``name`` (listed by
    ``torch._dynamo.list_backends()``). Registering the same name again replaces the previous
    backend of ours; a name that belongs to another backend raises ``ValueError``."""
    from torch._dynamo.backends import registry

    backend = make_backend(**kwargs)
    backend.__name__ = name
    compiler_fns: dict[str, Any] | None = getattr(registry, "_COMPILER_FNS", None)
    known = set(torch._dynamo.list_backends(exclude_tags=()))
    if name in known and name not in _REGISTERED:
        raise ValueError(f"backend name {name!r} is taken by another backend; choose another")
    if name in _REGISTERED and compiler_fns is not None:
        # torch 2.11 and 2.13 raise "duplicate name" on re-registration; replace ours instead.
        compiler_fns.pop(name, None)
    registry.register_backend(compiler_fn=backend, name=name)
    _REGISTERED[name] = backend
    return name


def apply_non_graph(
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...] | torch.Tensor,
    *,
    dtype: str | None = None,
    channels_last: bool = False,
    pad_batch_to: int | None = None,
    autocast: bool = False,
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], list[PassResult]]:
    """The non-graph changes in a fixed order: channels_last, then precision, then padding.

    The returned model takes the original inputs and returns outputs in the original dtype; the
    returned inputs are the ones to feed it for best speed (channels_last where requested).
    ``dtype`` ``None`` / ``"float32"`` means no precision change; with ``autocast`` the model
    keeps its dtype and runs under autocast at ``dtype``.
    """
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    results: list[PassResult] = []
    was_training = model.training
    if channels_last:
        model, args, result = non_graph_apply("memory_layout")(model, args)
        results.append(result)
    if dtype is not None and dtype not in ("float32", "fp32"):
        model, args, result = non_graph_apply("dtype_promotion")(
            model, args, dtype=dtype, autocast=autocast
        )
        results.append(result)
    if pad_batch_to is not None:
        model, args, result = non_graph_apply("batch_padding")(model, args, tile=pad_batch_to)
        results.append(result)
    # Wrappers are new modules (training by default); keep the baseline's mode.
    model.train(was_training)
    return model, args, results


# ------------------------------------------------------------------------------- internals


def _graph_specs(names: Sequence[str]) -> list[PassSpec]:
    specs = []
    for name in names:
        spec = get_pass(name)
        if spec.level not in ("functional", "aten"):
            raise ValueError(
                f"{name!r} is a {spec.level} pass, not a graph pass: "
                + (
                    "pass it through config_patches"
                    if spec.level == "inductor_config"
                    else "apply it with apply_non_graph"
                )
            )
        specs.append(spec)
    return specs


def _lift_constants(gm: torch.fx.GraphModule, inputs: list[Any]) -> int:
    """Read parameters and static buffers through ``get_attr`` attributes of ``gm`` instead of
    their placeholders (what Dynamo itself emits when freezing is on while it traces), so that
    Inductor's ``freeze`` sees them as parameters of the module and constant-folds them.

    The placeholders stay, unused: Dynamo builds the call to the compiled function from the
    placeholders of this very graph object, so removing them would change what it passes.
    Returns how many inputs were lifted."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return 0
    first_body = next(n for n in gm.graph.nodes if n.op != "placeholder")
    lifted = 0
    for index, (node, value) in enumerate(zip(placeholders, inputs, strict=True)):
        if not is_constant_tensor(value) or not node.users:
            continue
        name = f"_opprof_const{index}"
        if isinstance(value, torch.nn.Parameter):
            gm.register_parameter(name, value)
        else:
            gm.register_buffer(name, value, persistent=False)
        note_attribute_source(gm, name)  # the placeholder keeps its own source
        with gm.graph.inserting_before(first_body):
            attr = gm.graph.get_attr(name)
        attr.meta = {k: v for k, v in node.meta.items() if k != "grapharg"}
        node.replace_all_uses_with(attr)
        lifted += 1
    if lifted:
        gm.graph.lint()
        gm.recompile()
    return lifted


def _aten_pass_inputs(
    gm: torch.fx.GraphModule,
    fake_inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
    dynamo: list[Any],
) -> list[Any]:
    """The inputs the aten passes see: fake tensors, except the static inputs (parameters and
    buffers), which are the real tensors when they can be lined up with the placeholders.

    AOTAutograd's flat inputs are the compiled module's own parameters and buffers followed by
    Dynamo's inputs (``aot_module_simplified``, torch 2.11 / 2.13); a mismatch in count, shape
    or dtype (duplicate-input dedup, tensor subclasses, a frozen graph) keeps them fake.
    """

    out = list(fake_inputs)
    context = torch._guards.TracingContext.try_get()
    params = list(getattr(context, "params_flat", None) or []) if context is not None else []
    real = params + list(dynamo)
    if len(real) != len(out) or any(p is None for p in params):
        return out
    for index in kwargs.get("static_input_idxs", ()) or ():
        r, f = real[index], out[index]
        if not isinstance(r, torch.Tensor) or is_fake(r) or not isinstance(f, torch.Tensor):
            continue
        if not all(isinstance(s, int) for s in f.shape):
            continue  # symbolic shapes: comparing would install guards
        out[index] = _real_for(r, f)
    return out


def _real_for(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """``real`` in place of ``fake`` where they match in shape, dtype and device (else
    ``fake``). Plain buffers (our own constants, or a torch that does not mark buffers static)
    are wrapped as aliasing Parameters: the passes' sign of a compile-time constant."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if (tuple(real.shape), real.dtype, real.device) != (tuple(fake.shape), fake.dtype, fake.device):
        return fake
    if is_constant_tensor(real):
        return real
    with unset_fake_temporarily():
        return torch.nn.Parameter(real, requires_grad=False)


def _freezing_pass_inputs(fake_inputs: Sequence[Any]) -> list[Any]:
    """The inputs the aten passes see as ``freeze`` starts: fake tensors, except the inputs that
    ``freeze`` makes constants, which are the real tensors.

    ``freeze`` turns each of the compiled module's own parameters and buffers
    (``params_flat_unwrap_subclasses``, the first inputs of the graph) into a constant unless
    the graph mutates it or an output aliases it (``replace_params_with_constants``, torch 2.11
    / 2.13); the passes may bake exactly those values in. A mismatch in count, shape or dtype
    keeps them fake.
    """

    out = list(fake_inputs)
    context = torch._guards.TracingContext.try_get()
    if context is None:
        return out
    params = list(getattr(context, "params_flat_unwrap_subclasses", None) or [])
    meta = getattr(context, "fw_metadata", None)
    if meta is None or len(params) > len(out):
        return out
    kept = {o.base_idx for o in meta.output_info if o.base_idx is not None}
    kept.update(
        i
        for i, info in enumerate(meta.input_info)
        if info.mutates_data
        or info.mutates_metadata
        or getattr(info, "mutation_inductor_storage_resize", False)
    )
    for index, (r, f) in enumerate(zip(params, out, strict=False)):
        if index in kept or not isinstance(r, torch.Tensor) or is_fake(r):
            continue
        if not isinstance(f, torch.Tensor) or not all(isinstance(s, int) for s in f.shape):
            continue
        out[index] = _real_for(r, f)
    return out


@contextlib.contextmanager
def _real_constants_allowed(fake_inputs: Sequence[Any]) -> Iterator[None]:
    """Let Inductor's fake-tensor propagation meet the real constants the aten passes put in the
    graph, exactly as ``fw_compiler_freezing`` does for frozen parameters (torch 2.11 / 2.13:
    ``mock.patch.object(fake_mode, "allow_non_fake_inputs", True)``)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(list(fake_inputs))
    if mode is None or not hasattr(mode, "allow_non_fake_inputs"):
        yield
        return
    saved = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        mode.allow_non_fake_inputs = saved


class _no_autograd_cache:
    """``torch._functorch.config.enable_autograd_cache = False`` for the duration (the flag
    exists on 2.11 and 2.13; where it does not, there is no cache to bypass)."""

    def __enter__(self) -> None:
        import torch._functorch.config as functorch_config

        self._ctx: Any = None
        if hasattr(functorch_config, "enable_autograd_cache"):
            self._ctx = functorch_config.patch(enable_autograd_cache=False)
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


class _tf32:
    """TF32 for fp32 matmul/conv while compiling and running our graph only (process-wide flags,
    restored afterwards so an eager baseline in the same process is unaffected)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> None:
        if self.enabled:
            self._old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._old


def _with_tf32(compiled: Any) -> Callable[..., Any]:
    """``compiled`` with TF32 scoped around each call. Dynamo calls a backend's result with
    positional arguments (``aot_module_simplified``'s ``forward(*runtime_args)``, torch 2.11 /
    2.13), so the wrapper does too."""

    def run(*args: Any) -> Any:
        with _tf32(True):
            return compiled(*args)

    return run


# ------------------------------------------------------------------- Inductor custom pass


def _pass_sources(names: Sequence[str]) -> bytes:
    """The bytes that define what the named passes do: this module, ``base``, ``matching``
    (the matchers passes share) and each pass module's source."""
    from pytest_opprof.passes import base, matching

    modules = [inspect.getmodule(get_pass(n).apply) for n in names]
    digest = hashlib.sha256("\0".join(names).encode())
    for module in [inspect.getmodule(_pass_sources), base, matching, *modules]:
        if module is not None:
            digest.update(inspect.getsource(module).encode())
    return digest.digest()


def aten_custom_pass(names: Sequence[str], results: list[PassResult] | None = None) -> Any:
    """The graph passes ``names`` as an Inductor ``CustomGraphPass`` for
    ``post_grad_custom_pre_pass`` / ``post_grad_custom_post_pass``, with a ``uuid()`` derived
    from the passes' source so Inductor's FX graph cache keys on their code.

    There the passes get only fake inputs (a post-grad pass receives the graph alone), so
    weight-reading passes fold only what freezing already made a constant.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass  # torch >= 2.5, 2.11, 2.13

    specs = _graph_specs(names)
    sink: list[PassResult] = results if results is not None else []
    uuid = _pass_sources([s.name for s in specs]).hex()

    class OpprofPasses(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            gm = graph.owning_module
            assert isinstance(gm, torch.fx.GraphModule)
            fakes = [fake_value(n) for n in graph.nodes if n.op == "placeholder"]
            with compiling_for("inductor"):
                for spec in specs:
                    sink.append(spec.apply(gm, fakes))

        def uuid(self) -> str:
            return uuid

    return OpprofPasses()
