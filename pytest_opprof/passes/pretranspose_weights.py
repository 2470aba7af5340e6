"""pretranspose_weights (Inductor config): turn on Inductor freezing, which makes the
parameters constants, pre-transposes / pre-packs GEMM and convolution weights once, and
constant-folds everything that depends only on them.

Freezing only applies without autograd (``torch.no_grad()`` / ``inference_mode``). With Dynamo
inlining built-in nn modules (torch >= 2.5), parameters reach the backend as graph inputs unless
freezing was already on while Dynamo traced; ``make_backend`` turns such inputs back into graph
constants itself when this patch is present, so the patch works when given per backend.
"""

from __future__ import annotations

from typing import Any

from pytest_opprof.passes.base import supported_config


def config_patches(**_: Any) -> dict[str, Any]:
    return supported_config({"freezing": True})
