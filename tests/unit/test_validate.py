"""The checks a backend cannot fool (DESIGN §2.4): each cheat fails the check named for it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pytest_opprof.validate import anti_cheat_checks, compare

torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
TEMPLATE = (torch.randn(5, 8),)


def _cached() -> Callable[[torch.Tensor], torch.Tensor]:
    memo: list[torch.Tensor] = []

    def run(x: torch.Tensor) -> torch.Tensor:
        if not memo:
            memo.append(MODEL(x))
        return memo[0]

    return run


def _stateful() -> Callable[[torch.Tensor], torch.Tensor]:
    calls = [0]

    def run(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return MODEL(x) * (1.0 + 1e-3 * calls[0])

    return run


CHEATS: dict[str, tuple[Callable[[], Callable[..., torch.Tensor]], str]] = {
    "scaled output": (lambda: lambda x: MODEL(x) * 1.01, "equivalent"),
    "constant output": (lambda: lambda x: torch.full((x.shape[0], 4), 0.5), "not_constant"),
    "cached output": (_cached, "depends_on_input"),
    "dropped layer": (
        lambda: lambda x: MODEL[2](MODEL[1](x[:, :8] @ torch.ones(8, 16))),
        "equivalent",
    ),
    "state between calls": (_stateful, "stateless"),
    "nan": (lambda: lambda x: MODEL(x) + float("nan"), "finite"),
}


@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_each_cheat_fails_its_check(cheat: str) -> None:
    make, check = CHEATS[cheat]
    numerics, checks = anti_cheat_checks(
        MODEL, make(), TEMPLATE, dtype="float32", rtol=1e-4, atol=1e-5
    )
    assert checks[check].status == "fail", checks
    assert not numerics.ok or check != "equivalent"


def test_an_honest_backend_passes_every_check() -> None:
    numerics, checks = anti_cheat_checks(
        MODEL,
        torch.compile(MODEL, backend="eager"),
        TEMPLATE,
        dtype="float32",
        rtol=1e-4,
        atol=1e-5,
    )
    assert numerics.ok and numerics.rel_err < 1e-6
    assert {k: v.status for k, v in checks.items()} == {
        "finite": "pass",
        "not_constant": "pass",
        "depends_on_input": "pass",
        "stateless": "pass",
        "equivalent": "pass",
    }


def test_compare_relative_error_and_shape_mismatch() -> None:
    a = torch.ones(4)
    n = compare(a, a * 1.001, dtype="bfloat16", rtol=1.6e-2, atol=1e-3)
    assert n.ok and n.rel_err == pytest.approx(1e-3, rel=1e-3)
    assert not compare(a, torch.ones(5), dtype=None, rtol=1e-4, atol=0).ok
    assert not compare((a, a), (a,), dtype=None, rtol=1e-4, atol=0).ok
