"""The checks a backend cannot fool (DESIGN §2.4): each cheat fails the check named for it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pytest_opprof.numerics import anti_cheat_checks, check_numerics

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


def test_relative_error_and_structure() -> None:
    a = torch.linspace(1.0, 2.0, 64)
    n = check_numerics(a, a * 1.001, dtype="bfloat16", rtol=1.6e-2, atol=1e-3)
    assert n.ok and n.rel_err == pytest.approx(1e-3, rel=1e-3)
    assert not check_numerics(a, torch.ones(5), dtype=None, rtol=1e-4, atol=0).ok
    assert not check_numerics((a, a), (a,), dtype=None, rtol=1e-4, atol=0).ok


def test_a_small_absolute_error_no_longer_excuses_a_large_relative_one() -> None:
    """Before: ``rel <= rtol or max_abs <= atol`` passed a ±0.9e-3 perturbation of an output
    whose RMS is 3.7e-3 (17% relative error) on bf16's atol of 1e-3."""
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(4096, generator=gen) * 3.7e-3
    sign = torch.randint(0, 2, (4096,), generator=gen) * 2 - 1
    n = check_numerics(want, want + 0.9e-3 * sign, dtype="bfloat16", rtol=1.6e-2, atol=1e-3)
    assert not n.ok and n.max_abs_err <= 1e-3 and n.rel_err > 0.2
    assert n.failed is not None and n.failed.startswith("relative error 2.")


def test_a_few_wrong_elements_fail_the_elementwise_bound() -> None:
    """Ten elements of 100,000 off by the output's scale: 1% relative error in L2, inside
    bf16's 1.6e-2 (before: passed), but far past ``atol + limit * |ref|`` where they sit."""
    want = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    got = want.clone()
    got[:10] += 1.0
    n = check_numerics(want, got, dtype="bfloat16", rtol=1.6e-2, atol=1e-3)
    assert n.rel_err < 1.6e-2
    assert not n.ok and n.elements_over == 10
    assert n.failed is not None and n.failed.startswith("elementwise: 10 of 100000 elements")


@pytest.mark.parametrize(
    ("got", "words"),
    [
        (lambda w: w.to(torch.float64), "dtype: the output is torch.float64"),
        (lambda w: w.to(torch.bfloat16), "dtype: the output is torch.bfloat16"),
        (lambda w: w.to("meta"), "device: the output is on meta"),
    ],
)
def test_output_dtype_and_device_match_the_baselines(
    got: Callable[[torch.Tensor], torch.Tensor], words: str
) -> None:
    want = torch.randn(8, 4)
    n = check_numerics(want, got(want), dtype="bfloat16", rtol=1.6e-2, atol=1e-3)
    assert not n.ok and n.failed is not None and n.failed.startswith(words)


def test_a_same_precision_reference_narrows_the_limit() -> None:
    """Eager at bf16 off by 1e-4 relative: a backend is held to 2x that, not to 1.6e-2."""
    want = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    noise = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    reference = want + 1e-4 * noise
    honest = want + 1.5e-4 * noise.flip(0)
    cheat = want + 5e-3 * noise.flip(0)
    kw = {"dtype": "bfloat16", "rtol": 1.6e-2, "atol": 1e-3, "reference": reference}
    ok = check_numerics(want, honest, **kw)  # type: ignore[arg-type]
    assert ok.ok and ok.rel_limit == pytest.approx(2e-4, rel=0.05)
    assert ok.reference_rel_err == pytest.approx(1e-4, rel=0.05)
    bad = check_numerics(want, cheat, **kw)  # type: ignore[arg-type]
    assert not bad.ok and bad.failed is not None and "2x eager's own bfloat16 error" in bad.failed
    # without the reference, the blanket bf16 tolerance lets the cheat through
    assert check_numerics(want, cheat, dtype="bfloat16", rtol=1.6e-2, atol=1e-3).ok
