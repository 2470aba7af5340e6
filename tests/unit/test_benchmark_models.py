"""The real-model suite of benchmarks/models: every workload keeps the examples' contract, and
its architecture runs forward on the CPU at test size (each file's ``tiny()``, described in
benchmarks/models/README.md), so a broken model fails here rather than on a GPU call."""

from __future__ import annotations

import importlib.util
import inspect
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pytest_opprof.workload import discover

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "benchmarks" / "models"
FOLDERS = sorted(p for p in MODELS.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
"""Every workload folder of the suite, each holding ``<name>/<name>.py``."""


def _load(folder: Path) -> ModuleType:
    """Import the model file by path, under a name of its own so that no module is shadowed."""
    path = folder / f"{folder.name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_model_{folder.name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_suite_has_six_architectures_or_more() -> None:
    assert len(FOLDERS) >= 6, [p.name for p in FOLDERS]


def test_the_readme_lists_every_workload() -> None:
    readme = (MODELS / "README.md").read_text(encoding="utf-8")
    assert [p.name for p in FOLDERS if f"[`{p.name}`]" not in readme] == []


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_a_workload_of_the_pipeline_built_on_cuda(folder: Path) -> None:
    """One ``<name>.py`` per folder, named after it (the artifacts' folder and the benchmark's
    packing both go by that name); the pipeline's discovery finds its entry point, which
    builds on "cuda" in eval mode as the examples do."""
    assert sorted(p.name for p in folder.glob("*.py")) == [f"{folder.name}.py"]
    assert discover(folder / f"{folder.name}.py") is not None
    module = _load(folder)
    assert callable(module.get_model_and_input)
    source = inspect.getsource(module.get_model_and_input)
    assert '.to("cuda").eval()' in source
    assert 'device="cuda"' in source
    assert (module.__doc__ or "").strip(), "a module docstring says what the model is"


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_the_architecture_runs_forward_at_test_size(folder: Path) -> None:
    torch.manual_seed(0)
    model, x, shape = _load(folder).tiny()
    assert isinstance(model, torch.nn.Module) and isinstance(x, torch.Tensor)
    assert [n or "(root)" for n, m in model.named_modules() if m.training] == []
    with torch.no_grad():
        out = model(x)
    assert isinstance(out, torch.Tensor)
    assert tuple(out.shape) == shape
    assert bool(torch.isfinite(out).all())


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash to parse the entry point")
def test_the_entry_point_parses_and_resolves_the_suite() -> None:
    script = ROOT / "benchmarks" / "gpu_session.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text(encoding="utf-8")
    assert "benchmarks/models/$n" in text and "models)" in text and "examples)" in text
    # the benchmark's own stage timeout, before the caller's arguments, which may override it
    command = text[text.index("python3 -m pytest") :]
    assert 0 < command.index("--opprof-timeout=") < command.index('"${extra[@]}"')
