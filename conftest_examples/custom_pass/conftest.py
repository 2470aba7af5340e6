"""A custom pass and the rule that proposes it, from a conftest: no change to pytest-opprof.

Copy this file and ``opprof_linear_fold.py`` beside your workloads, then run
``pytest --opprof``. For a workload whose graph has a linear feeding another linear directly,
the rule below proposes ``linear_chain_fold``; measured selection keeps it when the folded
variant is faster; validation classifies it APPLIED / NOT_APPLIED / FAILED like the built-in
passes; the report shows the proposal (source: hook), its evidence and its status; and the
generated ``<stem>_optimized.py`` imports ``opprof_linear_fold`` and registers the pass itself.
"""

from __future__ import annotations

from pytest_opprof.schema import Evidence, Impact, Proposal

LINEAR = "torch._C._nn.linear"  # how graph.json writes nn.Linear / F.linear


def pytest_opprof_register_passes(registry):
    # Named by "module:function", so that the child processes that build and validate the
    # backend (and the generated file) can import it; as a string it is not imported here,
    # which keeps torch out of pytest's own process. The module sits beside this conftest,
    # whose folder is on sys.path (pytest's default import mode).
    registry.add(
        "linear_chain_fold",
        "opprof_linear_fold:apply",
        level="functional",
        description="a linear feeding another linear directly, folded into one linear",
    )


def pytest_opprof_propose(profile, graph, optimizations):
    """Propose ``linear_chain_fold`` where the FX graph has linear → linear with nothing in
    between, with the graph nodes and the measured share of linear time as evidence."""
    if graph is None:
        return []
    found = []
    for index, nodes in enumerate(graph.graphs):
        linears = {n.name: n for n in nodes if n.op == "call_function" and n.target == LINEAR}
        readers = {}
        for n in nodes:
            for arg in n.args:
                readers[arg] = readers.get(arg, 0) + 1
        for n in linears.values():
            inner = n.args[0] if n.args else None
            if inner in linears and readers.get(inner) == 1:
                found.append((index, inner, n.name))
    if not found:
        return []
    timeline = profile.timelines[0]
    share = max(
        (a.share for a in timeline.aggregated if a.name in ("aten::linear", "aten::addmm")),
        default=0.0,
    )
    iteration_us = profile.timing.variants["eager"].median_ms * 1000.0
    # a chain of n linears becomes one GEMM: n - 1 of every n GEMMs disappear
    saving = iteration_us * share * len(found) / (len(found) + 1)
    evidence = [
        Evidence(
            metric="linear feeds linear",
            value=f"{inner} -> {outer}",
            source=f"graph.json:graphs[{index}][{outer}].args[0]",
        )
        for index, inner, outer in found
    ]
    evidence.append(
        Evidence(
            metric="aten::linear share of operator time",
            value=round(share, 6),
            unit="fraction",
            source=f"profile.json:timelines[0].aggregated[aten::linear].share ({timeline.label})",
        )
    )
    return [
        Proposal(
            id="linear_chain_fold-1",
            type="linear_chain_fold",
            ir_level="functional",
            targets=list(
                dict.fromkeys(name for _, inner, outer in found for name in (inner, outer))
            ),
            evidence=evidence,
            fx_steps=[
                "functional level: match linear(linear(x, W1, b1), W2, b2) whose inner output "
                "has no other user and whose weights are compile-time constants",
                "fold once, in float64: W = W2 @ W1, b = W2 @ b1 + b2",
                "replace both with linear(x, W, b); graph.lint(); recompile",
            ],
            impact=Impact(
                estimated_saving_us=round(saving, 1),
                estimated_speedup=round(iteration_us / max(iteration_us - saving, 1e-9), 3),
                basis="one GEMM of each chained pair disappears: the pair's share of the eager "
                "iteration (timing.variants.eager.median_ms) × linear share, halved",
            ),
            confidence="high" if share > 0.3 else "medium",
            rationale="the chained linears compute one affine map; folding them halves the GEMMs",
        )
    ]
