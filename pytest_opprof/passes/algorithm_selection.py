"""algorithm_selection (Inductor config): let Inductor benchmark GEMM/conv implementations
(``max_autotune_gemm``: Triton templates vs cuBLAS / cuDNN) and tune the launch parameters of its
generated kernels (``coordinate_descent_tuning``), and optionally allow TF32 for fp32 matmuls.

TF32 is not Inductor config but a process-wide backend flag
(``torch.backends.cuda.matmul.allow_tf32`` / ``torch.backends.cudnn.allow_tf32``). It is
returned under the ``opprof.allow_tf32`` key, which ``make_backend`` consumes: it sets the flags
only while the compiled graph is compiled and run, so a baseline measured in the same process
keeps the user's setting.
"""

from __future__ import annotations

from typing import Any

from pytest_opprof.passes.base import ALLOW_TF32, supported_config


def config_patches(
    *,
    max_autotune_gemm: bool = True,
    coordinate_descent_tuning: bool = True,
    allow_tf32: bool = False,
    **_: Any,
) -> dict[str, Any]:
    patches: dict[str, Any] = {
        "max_autotune_gemm": max_autotune_gemm,
        "coordinate_descent_tuning": coordinate_descent_tuning,
    }
    if allow_tf32:
        patches[ALLOW_TF32] = True
    return supported_config(patches)
