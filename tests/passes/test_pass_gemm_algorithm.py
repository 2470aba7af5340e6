"""gemm_algorithm: a large bf16/fp16 ``mm`` runs through ``opprof::tuned_mm``, which times
cuBLASLt's candidate algorithms on a shape's first call and keeps the fastest.

On the CPU the op runs ``torch.mm`` on the widened operands (no cuBLASLt), so these tests check
the rewrite and the numbers; ``devices=("cpu",)`` lets the pass match CPU tensors and
``min_gflop=0`` tiny shapes. On the GPU the real tuning runs (the gpu tests)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import AtenTrace, count

from pytest_opprof.backend import cublaslt
from pytest_opprof.passes import REGISTRY, dtype_promotion, gemm_algorithm

aten = torch.ops.aten
tuned = torch.ops.opprof.tuned_mm.default
CPU = ("cpu",)


def head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.bfloat16(), w.bfloat16())


def _args() -> list[torch.Tensor]:
    return [torch.randn(4, 6, 32), torch.randn(48, 32) / 32**0.5]


def test_registered_at_the_aten_level() -> None:
    assert REGISTRY["gemm_algorithm"].level == "aten"
    assert str(tuned._schema).startswith("opprof::tuned_mm(Tensor a, Tensor b, ScalarType")


def test_a_bf16_mm_runs_through_the_op(aten_graph: AtenTrace) -> None:
    args = _args()
    gm = aten_graph(head, *args)
    before = gm(*args)
    result = gemm_algorithm.apply(gm, args, devices=CPU, min_gflop=0)
    assert (result.status, result.matches) == ("APPLIED", 1)
    assert "[24, 32] @ [32, 48]" in result.detail
    assert count(gm, tuned) == 1 and count(gm, aten.mm) == 0
    out = gm(*args)
    assert out.dtype == torch.bfloat16 and out.shape == before.shape
    torch.testing.assert_close(out, before, rtol=8e-3, atol=8e-3)


def test_the_output_dtype_of_mm_dtype_is_kept(aten_graph: AtenTrace) -> None:
    """After gemm_out_dtype: ``mm.dtype(a, b, float32)`` becomes ``tuned_mm(a, b, float32)``."""

    def wide(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return aten.mm.dtype(x.bfloat16(), w.bfloat16().t(), torch.float32)

    args = [torch.randn(24, 32), torch.randn(48, 32)]
    with torch.library._scoped_library("aten", "IMPL") as lib:
        lib.impl("mm.dtype", lambda a, b, d: torch.mm(a.float(), b.float()).to(d), "CPU")
        gm = aten_graph(wide, *args)
    assert count(gm, aten.mm.dtype) == 1
    result = gemm_algorithm.apply(gm, args, devices=CPU, min_gflop=0)
    assert result.matches == 1 and count(gm, tuned) == 1
    out = gm(*args)
    exact = args[0].bfloat16().float() @ args[1].bfloat16().float().t()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("fn", "min_gflop"),
    [
        (lambda x, w: F.linear(x, w), 0),  # fp32: torch's TF32 setting decides, left alone
        (lambda x, w: torch.bmm(x.bfloat16(), w.bfloat16().expand(4, 48, 32).mT), 0),
        (head, gemm_algorithm.MIN_GFLOP),  # 2 * 24 * 32 * 48 FLOP, far below 1 GFLOP
    ],
    ids=["fp32", "bmm", "small"],
)
def test_no_match_leaves_the_graph(aten_graph: AtenTrace, fn: Any, min_gflop: float) -> None:
    args = _args()
    gm = aten_graph(fn, *args)
    code = gm.code
    result = gemm_algorithm.apply(gm, args, devices=CPU, min_gflop=min_gflop)
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert gm.code == code


def test_a_biased_gemm_is_left_to_cublas(aten_graph: AtenTrace) -> None:
    def biased(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.bfloat16(), w.bfloat16(), torch.ones(48, dtype=torch.bfloat16))

    args = _args()
    gm = aten_graph(biased, *args)
    assert gemm_algorithm.apply(gm, args, devices=CPU, min_gflop=0).matches == 0
    assert count(gm, aten.addmm) == 1


def test_cuda_only_by_default(aten_graph: AtenTrace) -> None:
    args = _args()
    gm = aten_graph(head, *args)
    assert gemm_algorithm.apply(gm, args, min_gflop=0).matches == 0


def test_after_dtype_promotion(aten_graph: AtenTrace) -> None:
    """The fp32 model's GEMMs compute in bf16 once dtype_promotion is in; both are tuned."""

    def two(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, w1), w2)

    args = [torch.randn(2, 5, 16), torch.randn(16, 16) / 4, torch.randn(8, 16) / 4]
    gm = aten_graph(two, *args)
    assert gemm_algorithm.apply(gm, args, devices=CPU, min_gflop=0).matches == 0
    assert dtype_promotion.apply(gm, args).matches == 2
    assert gemm_algorithm.apply(gm, args, devices=CPU, min_gflop=0).matches == 2
    torch.testing.assert_close(gm(*args), two(*args), rtol=1.6e-2, atol=2e-2)


def test_through_inductor_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor calls the op as an extern kernel; its fake implementation gives the shape."""
    from pytest_opprof.backend.compiler import make_backend
    from pytest_opprof.passes.base import PassResult

    def on_cpu(gm: torch.fx.GraphModule, inputs: Any) -> PassResult:
        return gemm_algorithm.apply(gm, inputs, devices=CPU, min_gflop=0)

    spec = dataclasses.replace(REGISTRY["gemm_algorithm"], apply=on_cpu)
    monkeypatch.setitem(REGISTRY, "gemm_algorithm", spec)
    results: list[PassResult] = []
    backend = make_backend(aten=["gemm_algorithm"], results=results)
    args = _args()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(head, backend=backend)(*args)
    torch._dynamo.reset()
    assert [(r.status, r.matches) for r in results] == [("APPLIED", 1)]
    torch.testing.assert_close(got, head(*args), rtol=8e-3, atol=8e-3)


# --------------------------------------------------------------------------- cuBLAS layouts


@pytest.mark.parametrize(
    ("make", "op", "rows", "cols", "ld"),
    [
        (lambda: torch.empty(6, 4), cublaslt._OP_N, 4, 6, 4),  # row-major [6, 4]
        (lambda: torch.empty(4, 6).t(), cublaslt._OP_T, 6, 4, 6),  # nn.Linear's weight.t()
        (lambda: torch.empty(6, 8)[:, :4], cublaslt._OP_N, 4, 6, 8),  # padded rows
        (lambda: torch.empty(1, 4), cublaslt._OP_N, 4, 1, 4),
    ],
    ids=["row_major", "transposed", "padded", "one_row"],
)
def test_operands_as_cublas_reads_them(make: Any, op: int, rows: int, cols: int, ld: int) -> None:
    assert cublaslt._column_major(make()) == cublaslt._Operand(op, rows, cols, ld)


def test_a_strided_operand_is_declined() -> None:
    assert cublaslt._column_major(torch.empty(6, 8)[:, ::2]) is None


def test_the_cpu_runs_torch_mm() -> None:
    a, b = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(7, 3, dtype=torch.bfloat16)
    out = cublaslt.tuned_mm(a, b, torch.float32)
    torch.testing.assert_close(out, a.float() @ b.float())
    assert cublaslt.tuned_mm(a, b, torch.bfloat16).dtype == torch.bfloat16


def test_a_choice_says_what_was_kept() -> None:
    kept = cublaslt.Choice(
        (8192, 512, 32000),
        ("bfloat16", "float32"),
        {-1: 0.536, 0: 0.54, 6: 0.453},
        6,
        {-1: 0.52, 0: 0.53, 6: 0.43},
    )
    assert kept.describe() == (
        "tuned_mm [8192, 512] @ [512, 32000] bfloat16 -> float32: cuBLASLt candidate 6 of 2, "
        "0.4530 ms against torch's 0.5360 ms (in a graph 0.4300 against 0.5200)"
    )
    none = cublaslt.Choice(
        (64, 64, 64), ("bfloat16", "bfloat16"), {-1: 0.010, 0: 0.0101}, None, {-1: 0.011}
    )
    assert "torch's own algorithm kept (0.0100 ms, in a graph 0.0110; best other 0.0101, " in (
        none.describe()
    )
    alone = cublaslt.Choice((64, 64, 64), ("bfloat16", "bfloat16"), {-1: 0.010}, None)
    assert alone.describe().endswith("torch's own algorithm kept (0.0100 ms; no other timed)")


@pytest.mark.parametrize(
    ("times", "graphed", "kept"),
    [
        # faster both ways by 5% or more: the fastest in the graph
        ({-1: 0.52, 3: 0.45, 6: 0.43}, {-1: 0.52, 3: 0.42, 6: 0.44}, 3),
        ({-1: 0.0133, 3: 0.0125}, {-1: 0.0130, 3: 0.0123}, 3),
        # sdpa_attention's QKV GEMM on the H200: 4.8% faster back to back, 2.5% in a graph
        ({-1: 0.0132, 3: 0.0126}, {-1: 0.0123, 3: 0.0120}, None),
        # faster back to back only, or in the graph only
        ({-1: 0.0129, 3: 0.0110}, {-1: 0.0131, 3: 0.0150}, None),
        ({-1: 0.0129, 3: 0.0129}, {-1: 0.0150, 3: 0.0130}, None),
        # never captured: not judged on half its timings
        ({-1: 0.52, 6: 0.43}, {-1: 0.52}, None),
        # torch's own call untimed in a graph: nothing is judged
        ({-1: 0.52, 6: 0.43}, {6: 0.43}, None),
        ({-1: 0.52, 6: 0.43}, {}, None),
    ],
)
def test_a_candidate_must_win_back_to_back_and_in_a_graph(
    times: dict[int, float], graphed: dict[int, float], kept: int | None
) -> None:
    assert cublaslt.keep(times, graphed) == kept


def test_graphed_times_leave_out_what_cannot_be_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call's graph time less the producer's; a call whose capture fails is left out, and
    a producer that cannot be captured leaves nothing to judge in a graph (the op then keeps
    torch's own call), instead of failing the model's call."""
    ms = {"produce": 0.003, "own": 0.016, "fast": 0.015}

    def captured(steps: list[Any], _pool: Any, _side: Any) -> Any:
        name = steps[-1]()
        if name == "broken":
            raise cublaslt.CublasLtError("cublasLtMatmul returned cuBLAS status 13")
        return lambda: name

    monkeypatch.setattr(cublaslt.torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(cublaslt.torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(cublaslt, "_captured", captured)
    monkeypatch.setattr(cublaslt, "_time", lambda replay: ms[replay()])
    calls = {-1: lambda: "own", 0: lambda: "broken", 3: lambda: "fast"}
    got = cublaslt._graphed_times(calls, lambda: "produce")
    assert got == pytest.approx({-1: 0.013, 3: 0.012})

    def uncapturable(_steps: list[Any], _pool: Any, _side: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cublaslt, "_captured", uncapturable)
    assert cublaslt._graphed_times(calls, lambda: "produce") == {}


def test_a_cublaslt_that_cannot_start_leaves_the_gemms_to_torch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A handle or workspace cuBLASLt cannot make: one warning that says what runs instead and
    how to skip the pass; no tuning tried again."""
    import contextlib
    from types import SimpleNamespace

    failing = SimpleNamespace(cublasLtCreate=lambda _handle: 7)
    monkeypatch.setattr(cublaslt, "_libraries", lambda: SimpleNamespace(lt=failing))
    monkeypatch.setattr(cublaslt.torch.cuda, "device", lambda _d: contextlib.nullcontext())
    tuner = cublaslt._Tuner(torch.device("cuda", 0))
    with caplog.at_level("WARNING", logger="pytest_opprof.passes"):
        assert tuner._start() is False
    (record,) = caplog.records
    assert "cublasLtCreate returned cuBLAS status 7" in record.getMessage()
    assert "run torch.mm instead" in record.getMessage()
    assert "OPPROF['skip']" in record.getMessage()
    assert tuner.libs is None and tuner._start() is False


def test_the_stage_log_names_each_tuned_shape_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytest_opprof.stages.common import note_tuned_gemms

    tuner = cublaslt._Tuner(torch.device("cuda", 0))
    monkeypatch.setattr(cublaslt, "_TUNERS", {0: tuner})
    monkeypatch.setattr(cublaslt, "_REPORTED", [0])
    kept = cublaslt.Choice((8192, 512, 32000), ("bfloat16", "float32"), {-1: 0.5, 6: 0.4}, 6)
    tuner.choices.append(kept)
    note_tuned_gemms()
    note_tuned_gemms()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].endswith(kept.describe())


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_t", [True, False], ids=["weight_t", "row_major_b"])
def test_tuned_mm_on_cuda(out_dtype: torch.dtype, weight_t: bool) -> None:
    """The real cuBLASLt call against torch's own, in both operand layouts and both output
    dtypes, eagerly and replayed from a CUDA graph captured after the shape was tuned."""
    torch.manual_seed(0)
    a = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16) / 512**0.5
    b = w.t() if weight_t else w.t().contiguous()
    want = cublaslt.reference_mm(a, b, out_dtype)
    got = cublaslt.tuned_mm(a, b, out_dtype)
    assert got.dtype == out_dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    (choice,) = [c for c in cublaslt.choices() if c.shape == (2048, 512, 4096)][-1:]
    assert -1 in choice.times_ms and -1 in choice.graphed_ms  # torch's own, timed both ways
    assert choice.kept == cublaslt.keep(choice.times_ms, choice.graphed_ms)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cublaslt.tuned_mm(a, b, out_dtype)
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(
        captured.float(), cublaslt.reference_mm(a, b, out_dtype).float(), rtol=1e-2, atol=1e-2
    )


@pytest.mark.gpu
def test_through_the_backend_on_cuda() -> None:
    """A bf16 logits head compiled with gemm_out_dtype and gemm_algorithm at the aten level."""
    from pytest_opprof.backend.compiler import make_backend
    from pytest_opprof.passes.base import PassResult

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(512, 8192, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x.bfloat16()).float()

    torch.manual_seed(0)
    model = Head().cuda().bfloat16().eval()
    x = torch.randn(16, 256, 512, device="cuda")
    results: list[PassResult] = []
    backend = make_backend(aten=["gemm_out_dtype", "gemm_algorithm"], results=results)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        exact = x.bfloat16().float() @ model.proj.weight.float().t()
    assert [(r.name, r.status) for r in results] == [
        ("gemm_out_dtype", "APPLIED"),
        ("gemm_algorithm", "APPLIED"),
    ]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
