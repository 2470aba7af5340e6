"""A persistent Triton GEMM that reads bf16/fp16 through TMA and writes a wider output: what
``gemm_probe.py`` sets beside cuBLAS for embedding_projection's fp32 logits.

cuBLAS writes an fp32 result from bf16 inputs (``aten.mm.dtype``) one tile at a time: a CTA
loads its K slices, multiplies, and only then stores its tile, so with a short K (a projection
from a 512-wide hidden state to a 32000-wide vocabulary: eight 64-deep slices per tile) the
output store, twice the bytes of a bf16 one, is not hidden behind any math. Here CTAs walk the
tiles in a grouped order (``OCC`` per SM, or one per tile); the K loop of the next tile is
pipelined across the tile boundary (``flatten``), optionally warp-specialized (``WS``), and
each store is an asynchronous TMA store, so one tile's fp32 write may overlap the next tile's
loads and tensor-core work. The accumulator is stored in column slices (``SPLIT``) to keep the
shared-memory staging of a 128 x 256 fp32 tile small.

It did not pay on the H200 (Triton 3.6, torch 2.11; benchmarks/results/h200-2026-12-02/probes):
the best of its configurations wrote the [8192, 32000] fp32 logits in 0.615 ms inside a CUDA
graph (128 x 256 x 64 tiles, 4 store slices, one CTA per SM; warp specialization changed
nothing on sm_90), where cuBLAS took 0.525 ms; writing bf16 it took 0.478 ms. So the pipeline
keeps cuBLAS, and this kernel stays a probe. Hopper (sm_90) and later; needs Triton, and TMA's
16-byte aligned rows (K a multiple of 8 for bf16 in, N of 4 for fp32 out).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SMEM_BYTES = 220 * 1024  # of the H100/H200's 227 KB per block, some left for barriers


def configs(warp_specialize: bool = False) -> list[triton.Config]:
    """The tile shapes the autotuner tries: tall enough tiles for wgmma, the output stored in
    1, 2 or 4 column slices, one or two CTAs per SM walking the tiles (``OCC``; 0: one CTA
    per tile, as cuBLAS launches), the tile loop warp-specialized or software-pipelined."""
    out = []
    for bm, bn, warps in ((128, 256, 8), (128, 128, 8), (256, 128, 8), (128, 128, 4)):
        for bk in (64, 128):
            for stages in (2, 3, 4):
                for split in (1, 2, 4):
                    loads = stages * (bm + bn) * bk * 2
                    epilogue = bm * (bn // split) * 4
                    if bn // split < 32 or loads + epilogue > SMEM_BYTES:
                        continue
                    occupancies = (1, 2, 0) if 2 * (loads + epilogue) <= SMEM_BYTES else (1, 0)
                    for occ in occupancies:
                        meta = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "SPLIT": split}
                        meta |= {"OCC": occ, "WS": warp_specialize}
                        out.append(
                            triton.Config(
                                meta, num_stages=stages, num_warps=warps, pre_hook=_block_shapes
                            )
                        )
    return out


def _block_shapes(nargs: dict[str, Any]) -> None:
    """Point each descriptor's box at the config's tile (the autotuner calls this per config)."""
    bm, bn, bk, split = nargs["BM"], nargs["BN"], nargs["BK"], nargs["SPLIT"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn // split]


@triton.jit
def _tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile ``tile``'s (row, column) block in grouped order: GROUP_M row blocks share each
    column block of B while it is in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    within = tile % per_group
    return first_m + within % rows, within // rows


@triton.autotune(configs=configs(), key=["M", "N", "K", "out_bytes"])
@triton.jit
def _mm_kernel(
    a_desc,
    b_desc,
    c_desc,
    M,
    N,
    K,
    out_bytes,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr,
    OCC: tl.constexpr,
    WS: tl.constexpr,
):
    first = tl.program_id(0)
    step = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    # The epilogue's tile index runs one behind the loop's own, so the pipeliner sees no value
    # shared between a tile's prologue and the previous tile's epilogue.
    done = first - step
    for tile in tl.range(first, tiles_m * tiles_n, step, flatten=True, warp_specialize=WS):
        pm, pn = _tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(k_steps):
            a = a_desc.load([pm * BM, k * BK])
            b = b_desc.load([pn * BN, k * BK])
            acc = tl.dot(a, b.T, acc)
        done += step
        pm, pn = _tile(done, tiles_m, tiles_n, GROUP_M)
        row, col = pm * BM, pn * BN
        out = acc.to(c_desc.dtype)
        if SPLIT == 1:
            c_desc.store([row, col], out)
        elif SPLIT == 2:
            left, right = tl.split(tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1)))
            c_desc.store([row, col], left)
            c_desc.store([row, col + BN // 2], right)
        else:
            halves = tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            ll, lr = tl.split(tl.permute(tl.reshape(left, (BM, 2, BN // 4)), (0, 2, 1)))
            rl, rr = tl.split(tl.permute(tl.reshape(right, (BM, 2, BN // 4)), (0, 2, 1)))
            c_desc.store([row, col], ll)
            c_desc.store([row, col + BN // 4], lr)
            c_desc.store([row, col + BN // 2], rl)
            c_desc.store([row, col + 3 * BN // 4], rr)


@functools.cache
def _sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def autotuned(warp_specialize: bool) -> Any:
    """The kernel under its own autotuner over ``configs(warp_specialize)``."""
    return triton.autotune(configs=configs(warp_specialize), key=["M", "N", "K", "out_bytes"])(
        _mm_kernel.fn
    )


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, tuner: Any = None) -> torch.Tensor:
    """``a @ b`` accumulated in fp32 and written as ``out_dtype``; ``b`` is read as the
    (N, K) matrix it transposes where it already is one (an ``nn.Linear`` weight), copied
    into that layout otherwise."""
    m, k = a.shape
    n = b.shape[1]
    bt = b.t()
    if not bt.is_contiguous():
        bt = bt.contiguous()
    a = a if a.is_contiguous() else a.contiguous()
    c = torch.empty((m, n), device=a.device, dtype=out_dtype)
    placeholder = [8, 8]  # replaced per config by _block_shapes
    a_desc = TensorDescriptor.from_tensor(a, placeholder)
    b_desc = TensorDescriptor.from_tensor(bt, placeholder)
    c_desc = TensorDescriptor.from_tensor(c, placeholder)
    sms = _sms(a.device.index if a.device.index is not None else torch.cuda.current_device())

    def grid(meta: dict[str, Any]) -> tuple[int]:
        tiles = triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"])
        return (min(meta["OCC"] * sms, tiles) if meta["OCC"] else tiles,)

    kernel = _mm_kernel if tuner is None else tuner
    kernel[grid](a_desc, b_desc, c_desc, m, n, k, c.element_size())
    return c
