"""Gate against the compiled model only.

We deploy with ``torch.compile``: a speedup over eager that the compiled model already has is
no win for us, so the gate compares against ``torch.compile`` whatever ``--opprof-baseline``
says (the plugin's default is ``best``, the faster of eager and compile). A workload can still
choose with ``OPPROF = {"baseline": "eager"}``.
"""

from __future__ import annotations


def pytest_opprof_select_baseline(workload, timing):
    if "baseline" in workload.overrides:
        return None  # the workload's own choice: the plugin's default implements it
    return "compile"
