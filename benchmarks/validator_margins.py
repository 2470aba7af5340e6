"""The validator's margins on the examples: how far inside its limit each example's honest bf16
model compiled by Inductor lands, and how far past it tampered ones do (a skipped
sub-computation, a scaled output, a few wrong elements). Runs on the GPU where there is one,
else on the CPU fallback; writes one JSON table.

    python benchmarks/validator_margins.py [--out margins.json] [--batch N] [NAME ...]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytest_opprof.numerics import anti_cheat_checks  # noqa: E402
from pytest_opprof.passes.dtype_promotion import apply_model  # noqa: E402
from pytest_opprof.tolerances import tolerance_for  # noqa: E402
from pytest_opprof.workload import load  # noqa: E402

EXAMPLES = ROOT / "examples"


def _attention_as_mean_over_time(self: Any, x: torch.Tensor) -> torch.Tensor:
    """sdpa_attention's forward with the attention skipped: the mean of the values over time."""
    b, t, d = x.shape
    h = self.norm_in(x)
    v = self.v_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
    attn = v.mean(dim=2, keepdim=True).expand_as(v).transpose(1, 2).reshape(b, t, d)
    return self.norm_out(x + self.out_proj(attn))


class _Tampered(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, change: Callable[[Any], Any]) -> None:
        super().__init__()
        self.inner, self.change = inner, change

    def forward(self, *args: Any) -> Any:
        return self.change(self.inner(*args))


def _few_wrong(out: torch.Tensor) -> torch.Tensor:
    flat = out.clone().flatten()
    flat[:: max(1, flat.numel() // 10)] += flat.float().pow(2).mean().sqrt().to(flat.dtype)
    return flat.view_as(out)


def _compiled_bf16(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Any:
    low, _, result = apply_model(copy.deepcopy(model), inputs, dtype="bfloat16")
    if result.status != "APPLIED":
        raise RuntimeError(result.detail)
    torch._dynamo.reset()
    fn = torch.compile(low)
    with torch.no_grad():
        fn(*inputs)
    return fn


def margins(name: str, device: str, batch: int | None) -> list[dict[str, Any]]:
    w = load(EXAMPLES / name / f"{name}.py", device)
    model = w.model
    inputs = tuple(t[:batch] if batch else t for t in w.inputs)
    rtol, atol = tolerance_for("bfloat16")
    cases: dict[str, torch.nn.Module] = {"honest": model}
    if name == "sdpa_attention":
        cheat = copy.deepcopy(model)
        cheat.forward = types.MethodType(_attention_as_mean_over_time, cheat)  # type: ignore[method-assign]
        cases["attention skipped"] = cheat
    cases["output x1.01"] = _Tampered(copy.deepcopy(model), lambda o: o * 1.01)
    cases["10 wrong elements"] = _Tampered(copy.deepcopy(model), _few_wrong)
    rows = []
    for case, m in cases.items():
        t0 = time.perf_counter()
        fn = _compiled_bf16(m, inputs)
        numerics, checks = anti_cheat_checks(
            model, fn, inputs, dtype="bfloat16", rtol=rtol, atol=atol
        )
        limit = numerics.rel_limit or numerics.rtol
        rows.append(
            {
                "workload": name,
                "device": device,
                "case": case,
                "ok": numerics.ok,
                "rel_err": numerics.rel_err,
                "rel_limit": limit,
                "eager_bf16_rel_err": numerics.reference_rel_err,
                "share_of_limit": numerics.rel_err / limit,
                "elements_over": numerics.elements_over,
                "detail": checks["equivalent"].detail,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", default=sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    )
    parser.add_argument("--out", type=Path, default=Path("validator_margins.json"))
    parser.add_argument("--batch", type=int, default=None, help="first N of the batch only")
    ns = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [r for n in ns.names for r in margins(n, device, ns.batch)]
    ns.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
