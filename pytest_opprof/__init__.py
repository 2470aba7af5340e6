"""pytest-opprof: GPU optimization of PyTorch models as a test that can pass or fail.

Importing this package imports no torch; the pipeline imports it inside the stages.
"""

from __future__ import annotations

__version__ = "0.1.0"

STAGES: tuple[str, ...] = ("capture", "propose", "backend", "validate", "recapture", "report")
"""The six stages, in order. The pytest item of ``report`` is named ``speedup``."""

ITEM_NAMES: dict[str, str] = {stage: stage for stage in STAGES} | {"report": "speedup"}
