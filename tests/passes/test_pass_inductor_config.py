"""The Inductor-config passes return keys this torch's ``torch._inductor.config`` knows."""

from __future__ import annotations

import logging

import pytest
from torch._inductor import config

from pytest_opprof.passes import REGISTRY
from pytest_opprof.passes.base import ALLOW_TF32, supported_config


def test_each_key_exists_in_this_torch() -> None:
    known = config.get_config_copy()
    for name in ("pretranspose_weights", "cuda_graphs", "algorithm_selection"):
        patches = REGISTRY[name].apply()
        assert patches, name
        assert all(k in known for k in patches), (name, patches)


def test_values() -> None:
    assert REGISTRY["pretranspose_weights"].apply() == {"freezing": True}
    assert REGISTRY["cuda_graphs"].apply() == {"triton.cudagraphs": True}
    assert REGISTRY["algorithm_selection"].apply() == {
        "max_autotune_gemm": True,
        "coordinate_descent_tuning": True,
    }
    assert REGISTRY["algorithm_selection"].apply(allow_tf32=True, max_autotune_gemm=False) == {
        "max_autotune_gemm": False,
        "coordinate_descent_tuning": True,
        ALLOW_TF32: True,
    }


def test_unknown_keys_are_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pytest_opprof.passes"):
        kept = supported_config({"freezing": True, "no_such_knob": 1, ALLOW_TF32: True})
    assert kept == {"freezing": True, ALLOW_TF32: True}
    (record,) = [r for r in caplog.records if r.name == "pytest_opprof.passes"]
    assert "'no_such_knob' is not an Inductor config key" in record.getMessage()
