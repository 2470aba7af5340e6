"""Probe: does a GEMM that applies its activation in cuBLASLt's epilogue beat Inductor's
extern GEMM plus a fused pointwise kernel, inside a CUDA graph?

``aten._addmm_activation(bias, a, b, use_gelu=...)`` runs bias + ReLU or bias + tanh-GELU in the
GEMM's epilogue (cuBLASLt); Inductor keeps it as an extern call (``make_fallback``), where
``addmm`` + activation becomes an extern GEMM and one more pointwise kernel. Each variant is a
``--layers``-deep chain of Linear + activation + Linear blocks in bf16 (gpt2's MLP and
mlp_activations' first layer by default), compiled by Inductor, replayed as one CUDA graph,
timed with CUDA events and its kernels named. One JSON line per variant.

    python benchmarks/epilogue_probe.py > epilogue_probe.jsonl
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn.functional as F
from sdpa_probe import graphed, measured, setup

SHAPES = {  # name: (rows, width, hidden, activation)
    "gpt2_mlp": (512, 768, 3072, "gelu_tanh"),
    "mlp_relu": (256, 512, 2048, "relu"),
    # embedding_projection's exact GELU: the epilogue's GELU is the tanh form, so the fused
    # variant computes a (slightly) different function; rel_err shows by how much.
    "embedding_mlp": (8192, 512, 2048, "gelu"),
}


class Mlp(torch.nn.Module):
    def __init__(self, width: int, hidden: int, act: str, epilogue: bool) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)
        self.act, self.epilogue = act, epilogue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.epilogue:
            h = torch.ops.aten._addmm_activation(
                self.up.bias, x, self.up.weight.t(), use_gelu=self.act.startswith("gelu")
            )
        elif self.act == "relu":
            h = F.relu(self.up(x))
        elif self.act == "gelu":
            h = F.gelu(self.up(x))
        else:
            h = F.gelu(self.up(x), approximate="tanh")
        return x + self.down(h)


def main() -> None:
    args = setup()
    chosen = args.shapes.split(",") if args.shapes else list(SHAPES)
    if unknown := [c for c in chosen if c not in SHAPES]:
        known = ", ".join(SHAPES)
        raise SystemExit(f"--shapes: no shape {', '.join(unknown)}; choose from {known}")
    for shape in chosen:
        rows, width, hidden, act = SHAPES[shape]
        torch.manual_seed(0)
        plain = Mlp(width, hidden, act, False).cuda().to(torch.bfloat16).eval()
        fused = Mlp(width, hidden, act, True).cuda().to(torch.bfloat16).eval()
        fused.load_state_dict(plain.state_dict())
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            reference = plain.float()(x.float())
            plain.to(torch.bfloat16)
        for name, model in (("addmm+pointwise", plain), ("addmm_activation", fused)):
            for mode in ("eager", "inductor"):
                row: dict[str, Any] = {"shape": shape, "variant": name, "mode": mode}
                try:
                    with torch.no_grad():
                        torch._dynamo.reset()
                        fn = torch.compile(model, fullgraph=True) if mode == "inductor" else model
                        err = (fn(x).float() - reference).norm() / reference.norm()
                        g, _ = graphed(fn, x, args.layers)
                        row.update(rel_err=float(err), **measured(g, args))
                except Exception as exc:  # one variant's failure is its row
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
