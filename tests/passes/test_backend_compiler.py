"""make_backend end to end through Dynamo and Inductor's CPU backend, on tiny models; the
registration and non-graph glue around it."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch._inductor.compile_fx
import torch.fx

from pytest_opprof.backend import compiler
from pytest_opprof.passes import bn_fold
from pytest_opprof.passes.base import ALLOW_TF32, PassResult

BF16: dict[str, Any] = {"rtol": 1.6e-2, "atol": 2e-2}


class ConvBnRelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        mean, var = self.bn.running_mean, self.bn.running_var
        assert mean is not None and var is not None
        with torch.no_grad():  # statistics far from the identity, so a bad fold shows
            mean.normal_()
            var.uniform_(0.5, 2.0)
            self.bn.weight.normal_()
            self.bn.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class AttentionBlock(torch.nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(c // self.heads), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        gelu = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
        return self.out(gelu)


def _statuses(results: list[PassResult]) -> list[tuple[str, str]]:
    return [(r.name, r.status) for r in results]


def test_conv_bn_relu(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = ConvBnRelu().eval(), torch.randn(2, 3, 8, 8)
    seen: list[torch.fx.GraphModule] = []
    real_inner = torch._inductor.compile_fx.compile_fx_inner

    def spy(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        seen.append(gm)
        return real_inner(gm, *args, **kwargs)

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", spy)
    results: list[PassResult] = []
    backend = compiler.make_backend(aten=["bn_fold", "dtype_promotion"], results=results)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        expected = model(x)

    assert _statuses(results) == [("bn_fold", "APPLIED"), ("dtype_promotion", "APPLIED")]
    assert results[0].matches == 1  # folded with the real weights, not the fake inputs
    (aten_gm,) = seen
    convs = [n for n in aten_gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert len(convs) == 1 and convs[0].meta["val"].dtype == torch.bfloat16
    assert not any(n.target is torch.ops.aten.sub.Tensor for n in aten_gm.graph.nodes)
    torch.testing.assert_close(out, expected, **BF16)


def test_attention_block() -> None:
    model, x = AttentionBlock().eval(), torch.randn(2, 5, 16)
    results: list[PassResult] = []
    backend = compiler.make_backend(
        functional=["qkv_fusion", "sdpa_replacement", "activation_substitution"],
        aten=["dtype_promotion"],
        results=results,
    )
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        expected = model(x)
    assert _statuses(results) == [
        ("qkv_fusion", "APPLIED"),
        ("sdpa_replacement", "APPLIED"),
        ("activation_substitution", "APPLIED"),
        ("dtype_promotion", "APPLIED"),
    ]
    assert results[2].matches == 1 and "F.gelu" in results[2].detail
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, **BF16)


def test_tanh_gelu_inside_inductor_is_found_and_left() -> None:
    """At the aten level inside Inductor's inner compile a post-decomposition aten.gelu
    cannot be lowered: the pass says so and leaves the graph."""
    model, x = AttentionBlock().eval(), torch.randn(2, 5, 16)
    results: list[PassResult] = []
    backend = compiler.make_backend(aten=["activation_substitution"], results=results)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        expected = model(x)
    assert _statuses(results) == [("activation_substitution", "NOT_APPLIED")]
    assert results[0].matches == 1 and "has no lowering" in results[0].detail
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_freezing_makes_parameters_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``freezing`` as a patch the parameters reach inner compile as constants, although
    Dynamo (torch >= 2.5) traced them as graph inputs; the aten passes ran before freezing
    rewrote the graph, with the real weights."""
    model, x = ConvBnRelu().eval(), torch.randn(2, 3, 8, 8)
    seen: list[torch.fx.GraphModule] = []
    real_inner = torch._inductor.compile_fx.compile_fx_inner

    def spy(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        seen.append(gm)
        return real_inner(gm, *args, **kwargs)

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", spy)
    results: list[PassResult] = []
    backend = compiler.make_backend(
        aten=["bn_fold"], config_patches={"freezing": True}, results=results
    )
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    (aten_gm,) = seen
    used = [n.name for n in aten_gm.graph.nodes if n.op == "placeholder" and n.users]
    assert len(used) == 1  # only x: the parameters were frozen into constants
    assert any(n.op == "get_attr" for n in aten_gm.graph.nodes)
    # folded by ours before freezing's own patterns could take the batch norm
    assert _statuses(results) == [("bn_fold", "APPLIED")]
    assert results[0].matches == 1
    assert not any(n.target is torch.ops.aten.sub.Tensor for n in aten_gm.graph.nodes)


def test_a_failing_pass_does_not_break_the_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(bn_fold, "_walk_chain", boom)
    model, x = ConvBnRelu().eval(), torch.randn(1, 3, 4, 4)
    results: list[PassResult] = []
    with torch.no_grad():
        out = torch.compile(
            model, backend=compiler.make_backend(aten=["bn_fold"], results=results)
        )(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert results == [PassResult("bn_fold", "FAILED", "RuntimeError: injected")]


def test_make_backend_rejects_what_it_cannot_route() -> None:
    with pytest.raises(KeyError, match="unknown pass 'bnfold'"):
        compiler.make_backend(aten=["bnfold"])
    with pytest.raises(ValueError, match="'cuda_graphs' is a inductor_config pass"):
        compiler.make_backend(aten=["cuda_graphs"])
    with pytest.raises(ValueError, match="apply it with apply_non_graph"):
        compiler.make_backend(functional=["batch_padding"])
    with pytest.raises(ValueError, match="unknown opprof config keys"):
        compiler.make_backend(config_patches={"opprof.turbo": True})


def test_tf32_is_scoped_to_the_compiled_call() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    inside = compiler._with_tf32(lambda: torch.backends.cuda.matmul.allow_tf32)
    assert inside() is True
    assert torch.backends.cuda.matmul.allow_tf32 is False
    compiler.make_backend(config_patches={ALLOW_TF32: True})  # accepted, not Inductor config


def test_register_backend_is_idempotent() -> None:
    name = compiler.register_backend("opprof_test_block", aten=["bn_fold"])
    assert name in torch._dynamo.list_backends()
    assert compiler.register_backend("opprof_test_block", aten=["dtype_promotion"]) == name
    with pytest.raises(ValueError, match="taken by another backend"):
        compiler.register_backend("inductor")


def test_apply_non_graph() -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2)
    )
    x = torch.randn(3, 3, 6, 6)
    with torch.no_grad():
        expected = model(x)
        new_model, inputs, results = compiler.apply_non_graph(
            model, (x,), dtype="bfloat16", channels_last=True, pad_batch_to=4
        )
        out = new_model(x)  # the original input
    assert [r.name for r in results] == ["memory_layout", "dtype_promotion", "batch_padding"]
    assert all(r.status == "APPLIED" for r in results)
    assert inputs[0].is_contiguous(memory_format=torch.channels_last)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **BF16)
    _, _, none = compiler.apply_non_graph(torch.nn.Linear(2, 2), torch.randn(1, 2), dtype="float32")
    assert none == []


def test_aten_custom_pass_uuid_follows_the_passes() -> None:
    a = compiler.aten_custom_pass(["dtype_promotion"])
    b = compiler.aten_custom_pass(["dtype_promotion"])
    c = compiler.aten_custom_pass(["dtype_promotion", "bn_fold"])
    assert a.uuid() == b.uuid() != c.uuid()

    results: list[PassResult] = []
    hook = compiler.aten_custom_pass(["dtype_promotion"], results)

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(a @ b)

    a_in, b_in = torch.randn(8, 16), torch.randn(16, 4) / 4
    # A warm FX graph cache (same uuid) would serve the graph without running the pass.
    with torch._inductor.config.patch(post_grad_custom_post_pass=hook, fx_graph_cache=False):
        out = torch.compile(mm)(a_in, b_in)
    assert _statuses(results) == [("dtype_promotion", "APPLIED")]
    torch.testing.assert_close(out, mm(a_in, b_in), **BF16)


def test_a_compile_off_the_gpu_takes_it_back_for_the_weights_it_folds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A stage process compiles without its share of the GPU (``devicelock.off_gpu``); the
    backend's work on real tensors (Inductor's freezing, the graph passes) takes it back,
    behind any measurer, and lets go again for Inductor's code generation."""
    import dataclasses

    from torch._inductor import freezing

    from pytest_opprof import devicelock

    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    lock = devicelock.join()
    assert lock is not None
    held: list[tuple[str, str | None]] = []

    def spy(where: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            held.append((where, lock.held))
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(freezing, "freeze", spy("freeze", freezing.freeze))
    inner = torch._inductor.compile_fx.compile_fx_inner
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", spy("codegen", inner))
    specs = compiler._graph_specs
    monkeypatch.setattr(
        compiler,
        "_graph_specs",
        lambda names: [dataclasses.replace(s, apply=spy(s.name, s.apply)) for s in specs(names)],
    )
    backend = compiler.make_backend(
        functional=["activation_substitution"],
        aten=["dtype_promotion"],
        config_patches={"freezing": True},
    )
    model, x = ConvBnRelu().eval(), torch.randn(2, 3, 8, 8)
    try:
        with torch.no_grad(), devicelock.off_gpu(lambda: None):
            out = torch.compile(model, backend=backend)(x)
            assert lock.held is None and lock.aside
        assert lock.held == "shared"
    finally:
        torch._dynamo.reset()
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)
    assert held == [
        ("activation_substitution", "shared"),
        ("dtype_promotion", "shared"),  # as freezing starts, on the graph it then freezes
        ("freeze", "shared"),
        ("codegen", None),
    ]
    assert freezing.freeze.__name__ == "wrapped"  # the backend's own wrapper is gone
    torch.testing.assert_close(out, model(x), **BF16)


def test_a_cache_hit_on_folded_weights_computes_with_its_own_model_s_weights(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folded weights are keyed by shape, not value (``passes.base.register_constant``): a
    second model of the same shapes with other weights is served the first one's compiled
    graph by the FX graph cache, and computes with its own weights. Keyed by value, the same
    hit would have needed the same weights. Sixteen channels: Inductor inlines a bias of
    eight or fewer into the code, and keys that by value still."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(2, 3, 8, 8)

    def compiled(model: torch.nn.Module) -> tuple[torch.Tensor, int, int]:
        torch._dynamo.reset()
        counters.clear()
        results: list[PassResult] = []
        backend = compiler.make_backend(aten=["bn_fold"], results=results)
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=True):
            out = torch.compile(model, backend=backend)(x)
        assert _statuses(results) == [("bn_fold", "APPLIED")]
        inductor = counters["inductor"]
        return out, inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]

    def wide(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        bn = torch.nn.BatchNorm2d(16)
        with torch.no_grad():  # statistics far from the identity, so a stale fold shows
            bn.running_mean.normal_()  # type: ignore[union-attr]
            bn.running_var.uniform_(0.5, 2.0)  # type: ignore[union-attr]
        conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        return torch.nn.Sequential(conv, bn, torch.nn.ReLU()).eval()

    first, second = wide(1), wide(2)
    out, hits, misses = compiled(first)
    assert (hits, misses) == (0, 1)
    torch.testing.assert_close(out, first(x), rtol=1e-4, atol=1e-5)
    out, hits, misses = compiled(second)
    assert (hits, misses) == (1, 0)
    with torch.no_grad():
        torch.testing.assert_close(out, second(x), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(out, first(x), rtol=1e-2, atol=1e-2)
    torch._dynamo.reset()
