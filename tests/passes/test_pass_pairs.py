"""Passes compose: every ordered pair of the built-in graph passes, added to a plan in either
order, makes the same plan, and on the pattern corpus (tiny models, each pass's own among
them: ``HOME``) each pass that applies alone still applies with the other, and the output still
matches eager.

A plan runs as ``build`` runs it, without Inductor's code generation: the model changes
(``dtype``, ``channels_last``), then the functional passes on the Dynamo graph, then the graph
traced to aten with Inductor's decompositions (what inner compile receives), then the aten
passes with the real parameters. The CUDA-only passes are told to match CPU tensors
(``devices``), and ``aten.mm.dtype`` / ``bmm.dtype`` get CPU kernels for the module's duration,
as in their own tests. cuDNN attention runs on no CPU: its case is an aten graph over fake CUDA
tensors, checked by the output's shape and strides. With Inductor freezing, which changes the
graph the aten passes would see, the plan is compiled (the last tests).
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from pytest_opprof.backend.build import apply_model_changes, build
from pytest_opprof.backend.plan import (
    CANONICAL_ORDER,
    REPORT_ONLY_TYPES,
    canonical_order,
    plan_of,
)
from pytest_opprof.passes import (
    REGISTRY,
    gemm_algorithm,
    gemm_epilogue,
    gemm_out_dtype,
)
from pytest_opprof.passes.base import PassResult
from pytest_opprof.schema import BackendPlan, Evidence, Impact, Proposal

aten = torch.ops.aten
CPU = ("cpu",)

GRAPH_PASSES = sorted(
    name
    for name, spec in REGISTRY.items()
    if spec.level in ("functional", "aten") and name not in REPORT_ONLY_TYPES
)
"""The built-in passes that transform graphs."""

APPLY: dict[str, Callable[..., Any]] = {
    **{name: REGISTRY[name].apply for name in GRAPH_PASSES},
    "gemm_out_dtype": functools.partial(gemm_out_dtype.apply, devices=CPU),
    "gemm_epilogue": functools.partial(gemm_epilogue.apply, devices=CPU),
    "gemm_algorithm": functools.partial(gemm_algorithm.apply, devices=CPU, min_gflop=0),
}


# ------------------------------------------------------------------------------ the corpus


def hand_gelu(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h.pow(3))))


class Attention(torch.nn.Module):
    """Three linears reading one activation, then a hand-written attention."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(c // self.heads), dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, c))


class Gelu(torch.nn.Module):
    """A linear, then the tanh GELU spelled out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hand_gelu(self.fc(x))


class ConvBn(torch.nn.Module):
    """conv → BN → ReLU → conv → BN → ReLU, in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.c2, self.b2 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        for bn in (self.b1, self.b2):
            mean, var = bn.running_mean, bn.running_var
            assert mean is not None and var is not None
            with torch.no_grad():  # far from the identity, so a wrong fold shows
                mean.normal_()
                var.uniform_(0.5, 2.0)
                bn.weight.normal_()
                bn.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


class Depthwise(torch.nn.Module):
    """A MobileNet block: depthwise conv → BN → ReLU6 → pointwise conv → BN → ReLU6, in eval
    mode, over 4 channels (so the pointwise conv is ``conv_im2col``'s too)."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
        self.pw = torch.nn.Conv2d(4, 6, 1, bias=False)
        self.b1, self.b2 = torch.nn.BatchNorm2d(4), torch.nn.BatchNorm2d(6)
        for bn in (self.b1, self.b2):
            mean, var = bn.running_mean, bn.running_var
            assert mean is not None and var is not None
            with torch.no_grad():
                mean.normal_()
                var.uniform_(0.5, 2.0)
                bn.weight.normal_()
                bn.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.b1(self.dw(x)))
        return F.relu6(self.b2(self.pw(y)))


class Mlp(torch.nn.Module):
    """Biased linear → ReLU → biased linear, in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Logits(torch.nn.Module):
    """A bf16 projection without a bias whose output the caller wants in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter((torch.randn(24, 16) / 4).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.w).float()


def cudnn_attention(x: torch.Tensor) -> torch.Tensor:
    """A fused-QKV attention block as AOT leaves it at bf16 on sm90: split, cuDNN, merge."""
    b, s, d = x.shape
    q, k, v = x.view(b, s, 3, 2, d // 6).permute(2, 0, 3, 1, 4)
    y = aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, is_causal=True)[0]
    return y.transpose(1, 2).reshape(b, s, d // 3)


@dataclass(frozen=True)
class Case:
    make: Callable[[], torch.nn.Module] | None
    """The model (eager, on the CPU); None for a case traced straight to aten (``fake``)."""
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    tolerance: float
    fake: Callable[..., torch.Tensor] | None = None
    """A function traced over fake CUDA ``inputs``: no Dynamo graph, no values to compare."""


CORPUS: dict[str, Case] = {
    "attention": Case(Attention, lambda: (torch.randn(2, 4, 8),), 1e-4),
    "gelu": Case(Gelu, lambda: (torch.randn(3, 8),), 1e-4),
    "conv_bn": Case(ConvBn, lambda: (torch.randn(1, 3, 6, 6),), 1e-4),
    "depthwise": Case(Depthwise, lambda: (torch.randn(2, 4, 6, 6),), 1e-4),
    "mlp": Case(Mlp, lambda: (torch.randn(3, 8),), 1e-4),
    "logits": Case(Logits, lambda: (torch.randn(2, 3, 16),), 2e-2),
    "cudnn_attention": Case(None, lambda: _fake_cuda(2, 16, 96), 0.0, fake=cudnn_attention),
}


class LinearCastBn(torch.nn.Module):
    """A bf16 linear without a bias, cast to fp32 before its batch norm: ``gemm_out_dtype``
    and ``bn_fold`` each match its GEMM, and only one of them can take it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter((torch.randn(24, 16) / 4).to(torch.bfloat16))
        self.bn = torch.nn.BatchNorm1d(24)
        mean, var = self.bn.running_mean, self.bn.running_var
        assert mean is not None and var is not None
        with torch.no_grad():
            mean.normal_()
            var.uniform_(0.5, 2.0)
            self.bn.weight.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(F.linear(x.to(torch.bfloat16), self.w).float())


CASES: dict[str, Case] = {
    **CORPUS,
    "linear_cast_bn": Case(LinearCastBn, lambda: (torch.randn(6, 16),), 2e-2),
}
"""The corpus and the cases outside it (the pair tests run on the corpus)."""
HOME: dict[str, str] = {
    "qkv_fusion": "attention",
    "sdpa_replacement": "attention",
    "activation_substitution": "gelu",
    "bn_fold": "conv_bn",
    "memory_layout": "conv_bn",
    "conv_im2col": "conv_bn",
    "depthwise_taps": "depthwise",
    "dtype_promotion": "mlp",
    "gemm_epilogue": "mlp",
    "gemm_out_dtype": "logits",
    "gemm_algorithm": "logits",
    "attention_backend": "cudnn_attention",
}
"""Each pass's case in the corpus: where it applies alone."""
LOW_PRECISION = 2e-2
"""The tolerance of a plan that computes in bf16 (``dtype_promotion``)."""


def _fake_cuda(*shape: int) -> tuple[torch.Tensor, ...]:
    with FakeTensorMode():
        return (torch.empty(*shape, device="cuda", dtype=torch.bfloat16),)


# ------------------------------------------------------------------------------ running


@dataclass(frozen=True)
class Outcome:
    applied: frozenset[str]
    statuses: dict[str, str]
    error: float
    tolerance: float


@pytest.fixture(scope="module", autouse=True)
def _mm_dtype_on_cpu() -> Iterator[None]:
    """``aten.mm.dtype`` / ``bmm.dtype`` have kernels on CUDA only: fp32 accumulation and
    output here."""
    lib = torch.library.Library("aten", "IMPL")

    def mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.mm(a.float(), b.float()).to(out_dtype)

    def bmm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.bmm(a.float(), b.float()).to(out_dtype)

    lib.impl("mm.dtype", mm_dtype, "CPU")
    lib.impl("bmm.dtype", bmm_dtype, "CPU")
    yield
    lib._destroy()
    _captured.cache_clear()
    _run.cache_clear()


def _proposal(kind: str) -> Proposal:
    return Proposal(
        id=f"{kind}-1",
        type=kind,
        ir_level=REGISTRY[kind].level,
        targets=["x"],
        evidence=[Evidence(metric="m", value=1, source="graph.json")],
        fx_steps=["s"],
        impact=Impact(estimated_saving_us=1.0, estimated_speedup=1.1, basis="b"),
        confidence="high",
    )


MODEL_CHANGES = ("dtype_promotion", "memory_layout")
"""Passes a plan applies to the model (``plan.dtype``, ``plan.channels_last``); their graph
forms run at the aten level where a backend is made with them by name (``make_backend``)."""


def plan_for(*kinds: str, graph_forms: bool = False) -> BackendPlan:
    """The plan of ``kinds``' proposals, added in this order; ``graph_forms``: with the graph
    forms of ``MODEL_CHANGES`` in its aten passes instead of its model changes."""
    plan = plan_of([_proposal(k) for k in kinds])
    if not graph_forms:
        return plan
    aten_forms = [k for k in kinds if k in MODEL_CHANGES]
    update = {"dtype": None, "channels_last": False, "aten": [*plan.aten, *aten_forms]}
    return plan.model_copy(update=update)


@functools.cache
def _captured(
    case: str, dtype: str | None, channels_last: bool
) -> tuple[torch.Tensor, dict[str, PassResult], torch.fx.GraphModule, list[Any]]:
    """Eager's output on ``case``, and, after the plan's non-graph changes (what ``build``
    does first), their results and the Dynamo graph and inputs a backend receives."""
    spec = CASES[case]
    assert spec.make is not None
    torch.manual_seed(0)
    reference = spec.make().eval()
    torch.manual_seed(0)
    model = spec.make().eval()  # the same weights
    inputs = spec.inputs()
    with torch.no_grad():
        want = reference(*inputs)
    plan = BackendPlan(dtype=dtype, channels_last=channels_last)
    model, done = apply_model_changes(model, inputs, plan)
    seen: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    ((gm, example_inputs),) = seen
    return want, {r.name: r for r in done}, gm, example_inputs


def _aten(fn: Callable[..., Any], *args: Any) -> torch.fx.GraphModule:
    """``fn`` as inner compile receives it: traced to aten with Inductor's decompositions; the
    constants a functional pass stored on the graph module stay real (``get_attr``)."""
    from torch._inductor.decomposition import select_decomp_table

    with torch.no_grad():
        return make_fx(
            fn,
            decomposition_table=select_decomp_table(),
            tracing_mode="fake",
            _allow_non_fake_inputs=True,
        )(*args)


def _apply(names: Sequence[str], gm: torch.fx.GraphModule, inputs: list[Any]) -> list[PassResult]:
    with torch.no_grad():
        return [APPLY[name](gm, inputs) for name in names]


def _layouts(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    values = [n.meta["val"] for n in gm.graph.output_node().all_input_nodes]
    return [(v.shape, v.stride(), v.dtype) for v in values]


@functools.cache
def _run(
    case: str,
    dtype: str | None,
    channels_last: bool,
    functional: tuple[str, ...],
    aten_passes: tuple[str, ...],
) -> Outcome:
    """The plan on ``case`` as ``build`` runs it: non-graph changes, then the functional
    passes, then the aten passes, each level in the plan's order."""
    spec = CASES[case]
    results: list[PassResult] = []
    if spec.fake is not None:
        gm = _aten(spec.fake, *spec.inputs())
        was = _layouts(gm)
        results += _apply(aten_passes, gm, [])
        error = 0.0 if _layouts(gm) == was else math.inf
    else:
        want, done, dynamo_gm, inputs = _captured(case, dtype, channels_last)
        results += done.values()
        gm = copy.deepcopy(dynamo_gm)
        results += _apply(functional, gm, inputs)
        aten_gm = _aten(gm, *inputs)
        results += _apply(aten_passes, aten_gm, inputs)
        with torch.no_grad():
            (got,) = aten_gm(*inputs)
        error = float(((got.float() - want).abs() / (1 + want.abs())).max())
    for result in results:
        assert result.status != "FAILED", f"{result.name} on {case}: {result.detail}"
    low = dtype is not None or "dtype_promotion" in aten_passes
    return Outcome(
        applied=frozenset(r.name for r in results if r.status == "APPLIED"),
        statuses={r.name: f"{r.status}: {r.detail}" for r in results},
        error=error,
        tolerance=max(spec.tolerance, LOW_PRECISION if low else 0.0),
    )


def run_plan(case: str, plan: BackendPlan) -> Outcome:
    """``plan`` on ``case``, its passes at each level in the order the backend runs them."""
    functional, aten_passes = canonical_order(plan.functional), canonical_order(plan.aten)
    key = (plan.dtype, plan.channels_last, tuple(functional), tuple(aten_passes))
    return _run(case, *key)


def applies_alone(name: str, case: str, graph_forms: bool = False) -> bool:
    return name in run_plan(case, plan_for(name, graph_forms=graph_forms)).applied


# ------------------------------------------------------------------------------ the tests


def test_the_canonical_order_lists_every_graph_pass() -> None:
    assert set(GRAPH_PASSES) == set(HOME) == set(CANONICAL_ORDER)
    assert canonical_order(reversed(GRAPH_PASSES)) == list(CANONICAL_ORDER)
    assert canonical_order(["zeta_user", "gemm_algorithm", "alpha_user", "bn_fold", "bn_fold"]) == [
        "bn_fold",
        "gemm_algorithm",
        "alpha_user",
        "zeta_user",
    ]


ALONE = [
    *[pytest.param(name, False, id=name) for name in GRAPH_PASSES],
    *[pytest.param(name, True, id=f"{name}-graph_form") for name in MODEL_CHANGES],
]


@pytest.mark.parametrize(("name", "graph_forms"), ALONE)
def test_each_pass_applies_alone_on_its_case(name: str, graph_forms: bool) -> None:
    outcome = run_plan(HOME[name], plan_for(name, graph_forms=graph_forms))
    assert name in outcome.applied, outcome.statuses
    assert outcome.error <= outcome.tolerance


PAIRS = [
    *[
        pytest.param(first, second, False, id=f"{first}-{second}")
        for first, second in itertools.permutations(GRAPH_PASSES, 2)
    ],
    *[
        pytest.param(first, second, True, id=f"{first}-{second}-graph_forms")
        for first, second in itertools.permutations(GRAPH_PASSES, 2)
        if {first, second} & set(MODEL_CHANGES)
    ],
]


@pytest.mark.parametrize(("first", "second", "graph_forms"), PAIRS)
def test_a_pair_composes_in_either_order(first: str, second: str, graph_forms: bool) -> None:
    """``first``'s proposal added to the plan before ``second``'s: the same plan as the other
    way round, and on every case where either applies alone, both still apply where they did
    alone, and the output matches eager."""
    plan = plan_for(first, second, graph_forms=graph_forms)
    other = plan_for(second, first, graph_forms=graph_forms)
    if not graph_forms:
        assert (plan.functional, plan.aten) == (other.functional, other.aten)
    alone = {
        (name, case): applies_alone(name, case, graph_forms)
        for name in (first, second)
        for case in CORPUS
    }
    cases = sorted({case for (_, case), applies in alone.items() if applies})
    assert HOME[first] in cases and HOME[second] in cases
    for case in cases:
        outcome = run_plan(case, plan)
        for name in (first, second):
            if alone[name, case]:
                assert name in outcome.applied, (case, outcome.statuses)
        assert outcome.error <= outcome.tolerance, (case, outcome.error, outcome.statuses)


# -------------------------------------------------------------------- with Inductor freezing


@pytest.mark.parametrize(
    "kinds",
    [("bn_fold", "pretranspose_weights"), ("pretranspose_weights", "bn_fold")],
    ids=["bn_fold_first", "freezing_first"],
)
def test_bn_fold_still_folds_on_top_of_frozen_weights(kinds: tuple[str, str]) -> None:
    """Selection's second pass adds bn_fold to a plan that freezes the weights: Inductor's
    freezing rewrites the graph before inner compile (its own conv-bn folding, oneDNN's packed
    convolutions on the CPU), so the aten passes run as freezing starts, where they find what
    they find without it."""
    plan = plan_for(*kinds)
    assert plan.aten == ["bn_fold"] and plan.config_patches == {"freezing": True}
    torch.manual_seed(0)
    model, x = ConvBn().eval(), torch.randn(1, 3, 6, 6)
    with torch.no_grad():
        built = build(model, (x,), plan)
        got, want = built.fn(x), model(x)
    assert [(r.name, r.status, r.matches) for r in built.results] == [("bn_fold", "APPLIED", 2)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_where_two_passes_take_one_gemm_the_fold_wins() -> None:
    """Two passes that match one GEMM cannot both apply there: ``bn_fold`` runs before
    ``gemm_out_dtype``, so the batch norm is folded away (rather than the GEMM writing fp32
    for a batch norm still computed after it), whatever order the rungs were added in."""
    for kinds in [("gemm_out_dtype", "bn_fold"), ("bn_fold", "gemm_out_dtype")]:
        outcome = run_plan("linear_cast_bn", plan_for(*kinds))
        assert outcome.applied == {"bn_fold"}, outcome.statuses
        assert outcome.error <= outcome.tolerance
    assert "gemm_out_dtype" in run_plan("linear_cast_bn", plan_for("gemm_out_dtype")).applied
