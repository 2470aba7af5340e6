from __future__ import annotations

import subprocess
import sys


def test_importing_the_plugin_imports_no_torch() -> None:
    code = (
        "import sys, pytest_opprof.plugin, pytest_opprof.session, pytest_opprof.report, "
        "pytest_opprof.cli\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
