"""activation_substitution on the tanh GELU as people write it: on the Dynamo graph (where the
pipeline runs it) and on aten graphs."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import AtenTrace, DynamoCapture, count, targets

from pytest_opprof.passes import activation_substitution

aten = torch.ops.aten
C = math.sqrt(2.0 / math.pi)


def gelu_pow(x: torch.Tensor) -> torch.Tensor:  # GPT-2's NewGELU
    return 0.5 * x * (1.0 + torch.tanh(C * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_cubed_by_hand(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (torch.tanh((x + x * x * x * 0.044715) * 0.7978845608) + 1)


def gelu_outer_half_last(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (x * (1 + torch.tanh(0.79788456 * (0.044715 * x**3 + x))))


def gelu_method_pow(x: torch.Tensor) -> torch.Tensor:  # examples/gpt2, x.pow(3) as a method
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


FORMS = [gelu_pow, gelu_cubed_by_hand, gelu_outer_half_last, gelu_method_pow]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_replaces_tanh_gelu(aten_graph: AtenTrace, form: Callable[..., torch.Tensor]) -> None:
    x = torch.randn(4, 16) * 3

    def block(x: torch.Tensor) -> torch.Tensor:
        return form(x * 2.0) - 1.0  # something before and after, left as it was

    gm = aten_graph(block, x)
    result = activation_substitution.apply(gm, [x])

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert count(gm, aten.gelu) == 1 and count(gm, aten.tanh, aten.pow) == 0
    (gelu,) = [n for n in gm.graph.nodes if n.target is aten.gelu.default]
    assert gelu.kwargs == {"approximate": "tanh"}
    torch.testing.assert_close(gm(x), block(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gm(x), F.gelu(x * 2.0, approximate="tanh") - 1.0)


def test_two_activations(aten_graph: AtenTrace) -> None:
    x = torch.randn(8)
    gm = aten_graph(lambda x: gelu_pow(x) + gelu_cubed_by_hand(x + 1), x)
    assert activation_substitution.apply(gm, [x]).matches == 2
    torch.testing.assert_close(gm(x), gelu_pow(x) + gelu_cubed_by_hand(x + 1))


def _erf_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def _wrong_constant(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(C * (x + 0.05 * torch.pow(x, 3.0))))


def _tanh_read_twice(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(C * (x + 0.044715 * torch.pow(x, 3.0)))
    return 0.5 * x * (1.0 + t) + t


@pytest.mark.parametrize("fn", [_erf_gelu, _wrong_constant, _tanh_read_twice])
def test_leaves_graph_alone_without_the_pattern(
    aten_graph: AtenTrace, fn: Callable[..., torch.Tensor]
) -> None:
    x = torch.randn(8)
    gm = aten_graph(fn, x)
    code = gm.code
    result = activation_substitution.apply(gm, [x])
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert gm.code == code


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_replaces_tanh_gelu_on_the_dynamo_graph(
    dynamo_graph: DynamoCapture, form: Callable[..., torch.Tensor]
) -> None:
    lin = torch.nn.Linear(16, 16)

    def block(x: torch.Tensor) -> torch.Tensor:
        return form(lin(x)) - 1.0

    x = torch.randn(4, 16) * 3
    gm, inputs = dynamo_graph(block, x)
    with torch.no_grad():
        expected = block(x)

    result = activation_substitution.apply(gm, inputs)

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert "F.gelu" in result.detail
    found = list(targets(gm))
    assert found.count(F.gelu) == 1
    assert not {torch.tanh, "tanh", "pow", torch.pow} & set(found)
    (gelu,) = [n for n in gm.graph.nodes if n.target is F.gelu]
    assert gelu.kwargs == {"approximate": "tanh"} and "example_value" in gelu.meta
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [_erf_gelu, _wrong_constant, _tanh_read_twice])
def test_leaves_the_dynamo_graph_alone_without_the_pattern(
    dynamo_graph: DynamoCapture, fn: Callable[..., torch.Tensor]
) -> None:
    gm, inputs = dynamo_graph(fn, torch.randn(8))
    code = gm.code
    result = activation_substitution.apply(gm, inputs)
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert gm.code == code


def test_on_the_gpt2_example(dynamo_graph: DynamoCapture) -> None:
    """examples/gpt2 as Dynamo hands it to a backend: twelve GELUs, each replaced."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "gpt2" / "gpt2.py"
    spec = importlib.util.spec_from_file_location("gpt2_example", path)
    assert spec is not None and spec.loader is not None
    gpt2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt2)
    model = gpt2.GPT2Model(gpt2.GPT2Config()).eval()
    ids = torch.randint(0, gpt2.GPT2Config.vocab_size, (1, 16))
    with torch.no_grad():
        expected = model(ids)
        gm, inputs = dynamo_graph(model, ids)
        result = activation_substitution.apply(gm, inputs)
        assert (result.status, result.matches) == ("APPLIED", 12)
        assert list(targets(gm)).count(F.gelu) == 12
        torch.testing.assert_close(gm(*inputs)[0], expected, rtol=1e-4, atol=1e-4)
