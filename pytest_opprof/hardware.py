"""The hardware table: each GPU's figures (SM count, dense tensor-core and FP32 peaks, memory
bandwidth and size, L2, per-SM limits, tensor-core tiles, each with its source), loaded once and
looked up by the name the device reports.

Pure Python (no torch). The table is ``pytest_opprof/data/hardware.json``, read through
``importlib.resources`` so an installed wheel finds it; ``knowledge/hardware.md`` is rendered
from it. Every number is in base units (FLOP/s, bytes/s, bytes, Hz) and every tensor-core peak is
dense — never the 2:4-sparsity figure that datasheets print in large type. ``knowledge``
re-exports these names and holds the models over them (the roofline, the bottleneck thresholds).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# ---------------------------------------------------------------------------------- models


class FrozenModel(BaseModel):
    """The base of the table's models (and the roofline's point): immutable, no extra field."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceRef(FrozenModel):
    """Where a figure comes from: the document, its URL and the table that holds it."""

    url: str
    document: str
    table: str


class PeakFlops(FrozenModel):
    """Peak arithmetic rates in FLOP/s. Tensor-core rates are dense with FP32 accumulate."""

    basis: Literal["dense"] = Field(
        description="always 'dense': 2:4 structured-sparsity figures are never stored"
    )
    bf16: float = Field(gt=0, description="BF16 tensor-core, dense, FP32 accumulate")
    fp16: float = Field(gt=0, description="FP16 tensor-core, dense, FP32 accumulate")
    tf32: float = Field(gt=0, description="TF32 tensor-core, dense")
    fp32: float = Field(gt=0, description="FP32 on the CUDA cores (FMA = 2 FLOP), no tensor cores")
    fp8: float | None = Field(
        default=None, gt=0, description="FP8 tensor-core, dense; None where the GPU has none"
    )

    @model_validator(mode="after")
    def _ordered(self) -> PeakFlops:
        # A table that breaks this order mixed sparse and dense figures or swapped columns.
        if not self.bf16 >= self.tf32 >= self.fp32:
            raise ValueError(
                f"expected bf16 >= tf32 >= fp32, got {self.bf16:.4g} / {self.tf32:.4g} / "
                f"{self.fp32:.4g}"
            )
        if self.fp8 is not None and self.fp8 < self.bf16:
            raise ValueError(f"fp8 peak {self.fp8:.4g} is below the bf16 peak {self.bf16:.4g}")
        return self


class TensorCoreTile(FrozenModel):
    """The matrix-instruction shape and the dimension multiples that keep GEMMs on tensor cores."""

    instruction: str
    mma_shape_bf16: tuple[int, int, int] = Field(description="(M, N, K) of one bf16 MMA")
    min_dim_multiple: dict[str, int] = Field(
        description="per dtype: GEMM dims must be multiples of this for the tensor-core path"
    )
    preferred_dim_multiple: dict[str, int] = Field(
        description="per dtype: multiples of 128 bytes, the most efficient loads"
    )
    m_tile_rows: int = Field(description="row granularity of one tensor-core tile (64 on Hopper)")
    notes: str


class GpuSpec(FrozenModel):
    """One GPU of the hardware table, in base units."""

    key: str
    name: str
    architecture: str
    compute_capability: tuple[int, int]
    name_patterns: tuple[str, ...] = Field(
        description="regular expressions searched case-insensitively in the device name"
    )
    sm_count: int = Field(gt=0)
    boost_clock_hz: float = Field(gt=0)
    peak_flops: PeakFlops
    memory_bandwidth_bytes_per_s: float = Field(gt=0)
    memory_bytes: int = Field(gt=0)
    memory_type: str
    l2_bytes: int = Field(gt=0)
    shared_memory_per_sm_bytes: int = Field(gt=0)
    max_threads_per_sm: int = Field(gt=0)
    registers_per_sm: int = Field(gt=0, description="32-bit registers")
    tensor_core_tile: TensorCoreTile
    source: tuple[SourceRef, ...] = Field(min_length=1)
    notes: tuple[str, ...] = ()
    derived_fields: tuple[str, ...] = Field(
        default=(), description="fields computed from other figures rather than quoted"
    )

    @model_validator(mode="after")
    def _patterns_compile(self) -> GpuSpec:
        for pattern in self.name_patterns:
            re.compile(pattern, re.IGNORECASE)
        return self


class HardwareTable(FrozenModel):
    """The whole file: ordered entries (most specific first) and the no-information fallback."""

    schema_version: str
    description: str
    units: dict[str, str]
    peak_basis: str
    capacity_convention: str
    matching: str
    gpus: tuple[GpuSpec, ...] = Field(min_length=1)
    generic: GpuSpec

    @model_validator(mode="after")
    def _unique_keys(self) -> HardwareTable:
        keys = [g.key for g in self.gpus] + [self.generic.key]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"duplicate GPU keys: {duplicates}")
        return self


class GpuMatch(FrozenModel):
    """What ``lookup_gpu`` found: the figures to use and whether they are the device's own."""

    spec: GpuSpec
    exact: bool
    note: str = Field(description="why the figures are approximate; empty for an exact match")


# --------------------------------------------------------------------------------- loading


def hardware_json_text() -> str:
    """The shipped table as text (the package copy, found the same way from a wheel)."""
    resource = resources.files("pytest_opprof").joinpath("data", "hardware.json")
    return resource.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def load_hardware_table_model() -> HardwareTable:
    """Parse and validate the shipped table once per process."""
    return HardwareTable.model_validate(json.loads(hardware_json_text()))


def load_hardware_table() -> list[GpuSpec]:
    """Every GPU of the table, in matching order (most specific name first)."""
    return list(load_hardware_table_model().gpus)


def generic_gpu() -> GpuSpec:
    """The conservative entry used when nothing about the device is known."""
    return load_hardware_table_model().generic


# ---------------------------------------------------------------------------------- lookup

_CPU_NAME = re.compile(r"^\s*cpu\b", re.IGNORECASE)


def lookup_gpu(
    device_name: str,
    sm_count: int | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> GpuMatch | None:
    """Find the table entry for the name ``torch.cuda.get_device_name()`` reports.

    Returns ``None`` for ``"cpu"``: the CPU fallback has no roofline here, and callers must not
    quietly judge CPU timings against a GPU's peaks. An unknown GPU falls back to the entry with
    the same (else the nearest) compute capability and the closest SM count, with compute peaks
    scaled to the reported SM count; with neither known, to the generic entry. The note says so.
    """
    if _CPU_NAME.match(device_name):
        return None
    name = device_name.strip()
    cc = tuple(compute_capability) if compute_capability is not None else None
    for spec in load_hardware_table():
        if any(re.search(p, name, re.IGNORECASE) for p in spec.name_patterns):
            return _named_match(spec, name, sm_count, cc)
    return _fallback_match(name, sm_count, cc)


def _named_match(
    spec: GpuSpec, name: str, sm_count: int | None, cc: tuple[int, ...] | None
) -> GpuMatch:
    if sm_count is not None and sm_count > 0 and sm_count != spec.sm_count:
        # A MIG slice or a cut-down part under the same marketing name: the name's figures
        # would overstate its peaks by the SM ratio.
        partition = "mig" in name.lower()
        scaled = _scaled(spec, sm_count, bandwidth_too=partition)
        what = "compute peaks and bandwidth" if partition else "compute peaks"
        note = (
            f"'{name}' matches {spec.name} by name but reports {sm_count} SMs (the table has "
            f"{spec.sm_count}): using {spec.name}'s figures with {what} scaled by "
            f"{sm_count}/{spec.sm_count}"
        )
        return GpuMatch(spec=scaled, exact=False, note=note)
    if cc is not None and cc != spec.compute_capability:
        note = (
            f"'{name}' matches {spec.name} by name but reports compute capability "
            f"{_cc(cc)} (the table has {_cc(spec.compute_capability)}): using its figures "
            "as an approximation"
        )
        return GpuMatch(spec=spec, exact=False, note=note)
    return GpuMatch(spec=spec, exact=True, note="")


def _fallback_match(name: str, sm_count: int | None, cc: tuple[int, ...] | None) -> GpuMatch:
    label = name or "<no name>"
    table = load_hardware_table()
    if cc is None and sm_count is None:
        spec = generic_gpu()
        note = (
            f"unknown GPU '{label}' and no compute capability or SM count: using {spec.name}'s "
            "figures as an approximation; roofline percentages against it are rough"
        )
        return GpuMatch(spec=spec, exact=False, note=note)
    candidates = table
    basis: list[str] = []
    if cc is not None:
        same = [g for g in table if g.compute_capability == cc]
        major = [g for g in table if g.compute_capability[0] == cc[0]]
        if same:
            candidates, reason = same, f"same compute capability {_cc(cc)}"
        elif major:
            candidates, reason = major, f"same major compute capability {cc[0]}.x"
        else:
            nearest = min(abs(_cc_number(g.compute_capability) - _cc_number(cc)) for g in table)
            candidates = [
                g
                for g in table
                if abs(_cc_number(g.compute_capability) - _cc_number(cc)) == nearest
            ]
            reason = f"nearest compute capability to {_cc(cc)}"
        basis.append(reason)
    if sm_count is not None and sm_count > 0:
        chosen = min(candidates, key=lambda g: abs(g.sm_count - sm_count))
        basis.append(f"closest SM count to {sm_count}")
    else:
        chosen = candidates[0]
    spec = chosen
    scaled_note = ""
    if sm_count is not None and sm_count > 0 and sm_count != chosen.sm_count:
        spec = _scaled(chosen, sm_count, bandwidth_too=False)
        scaled_note = f"; compute peaks scaled by {sm_count}/{chosen.sm_count} SMs"
    note = (
        f"unknown GPU '{label}': using {chosen.name}'s figures as an approximation "
        f"({', '.join(basis)}){scaled_note}"
    )
    return GpuMatch(spec=spec, exact=False, note=note)


def _scaled(spec: GpuSpec, sm_count: int, *, bandwidth_too: bool) -> GpuSpec:
    ratio = sm_count / spec.sm_count
    pf = spec.peak_flops
    peaks = pf.model_copy(
        update={
            "bf16": pf.bf16 * ratio,
            "fp16": pf.fp16 * ratio,
            "tf32": pf.tf32 * ratio,
            "fp32": pf.fp32 * ratio,
            "fp8": None if pf.fp8 is None else pf.fp8 * ratio,
        }
    )
    bandwidth = spec.memory_bandwidth_bytes_per_s * (ratio if bandwidth_too else 1.0)
    return spec.model_copy(
        update={
            "name": f"{spec.name} (scaled to {sm_count} SMs)",
            "sm_count": sm_count,
            "peak_flops": peaks,
            "memory_bandwidth_bytes_per_s": bandwidth,
        }
    )


def _cc(cc: Iterable[int]) -> str:
    return ".".join(str(part) for part in cc)


def _cc_number(cc: tuple[int, ...]) -> int:
    return cc[0] * 10 + cc[1]
