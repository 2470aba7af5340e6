"""Probe: what ``opprof::tuned_mm`` keeps for three bf16 GEMMs, with both of its timings.

sdpa_attention's fused QKV projection ([4096, 512] @ [512, 1536], bf16 out), a
[8192, 512] @ [512, 2048] one (bf16 out) and embedding_projection's logits ([8192, 512] @
[512, 32000], fp32 out), each checked against torch's own call, then the op's choice and its
per-candidate times back to back and replayed from a CUDA graph (``cublaslt.Choice``).

    python benchmarks/tuned_mm_choices.py
"""

from __future__ import annotations

import torch

from pytest_opprof.backend import cublaslt

SHAPES = [
    (4096, 512, 1536, torch.bfloat16),
    (8192, 512, 2048, torch.bfloat16),
    (8192, 512, 32000, torch.float32),
]


def main() -> None:
    torch.manual_seed(0)
    for m, k, n, out_dtype in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        got = cublaslt.tuned_mm(a, w.t(), out_dtype)
        want = cublaslt.reference_mm(a, w.t(), out_dtype)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        choice = cublaslt.choices()[-1]
        print(choice.describe())
        print("  back to back", {i: round(t, 4) for i, t in choice.times_ms.items()})
        print("  in a graph  ", {i: round(t, 4) for i, t in choice.graphed_ms.items()})


if __name__ == "__main__":
    main()
