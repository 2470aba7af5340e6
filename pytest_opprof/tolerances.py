"""Numerical tolerances per compute dtype (pure Python: the parent and the child share them)."""

from __future__ import annotations

from typing import Any

# Relative L2 error allowed per compute dtype: about two units of the dtype's rounding for a
# network's worth of accumulation. fp32 leaves room for reassociation by Inductor.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-5),
    "bfloat16": (1.6e-2, 1e-3),
    "float16": (4e-3, 1e-4),
    # fp32 tensors whose convolutions or matmuls run on TF32 tensor cores (cuDNN's default for
    # convolutions): TF32 keeps fp16's 10 mantissa bits, so two fp32 programs that differ only
    # in their weights' rounding (BN folded in, say) differ at fp16's level.
    "tensorfloat32": (4e-3, 1e-4),
}

TF32 = "tensorfloat32"


def tolerance_for(
    dtype: str | None, overrides: dict[str, Any] | None = None
) -> tuple[float, float]:
    rtol, atol = TOLERANCES.get(dtype or "float32", TOLERANCES["float32"])
    overrides = overrides or {}
    return float(overrides.get("rtol", rtol)), float(overrides.get("atol", atol))


def numerics_dtype(dtype: str | None, *, tf32: bool) -> str:
    """The dtype whose tolerance a result is held to: ``dtype``, or TF32's where an fp32
    program runs convolutions or matmuls on TF32 tensor cores."""
    if dtype in (None, "float32") and tf32:
        return TF32
    return dtype or "float32"
