"""action.yml and the example workflow: schema, security audit, and a dry run of the steps.

The dry run takes the `run:` scripts out of action.yml and runs them with bash the way a runner
does (`bash --noprofile --norc -eo pipefail`), with `${{ }}` filled in from the inputs and the
earlier steps' outputs, against the fake GitHub server. pytest itself is replaced by a stand-in
that records its arguments and writes a fixture out-dir, so none of this needs the plugin.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import summary
from fake_github import DATA, PR, REPO, ROOT, TOKEN, FakeGitHub, github_env

yaml = pytest.importorskip("yaml", reason="PyYAML reads action.yml: pip install pyyaml")

ACTION = ROOT / "action.yml"
WORKFLOW = ROOT / "ci" / "workflows" / "opprof.yml"
BASE_WORKFLOW = ROOT / "ci" / "workflows" / "opprof-base.yml"  # stores the base branch's runs
SESSION = DATA / "session"
CPU_SESSION = DATA / "cpu_session"  # the CPU fallback: measured, gate not enforced
NOT_ENFORCED = "⚪ CPU fallback: gate not enforced"
MARKER = "<!-- pytest-opprof -->"
COMPARED = DATA / "compared_session"  # against a stored run of main: one workload regressed
RUNS = DATA / "runs"  # stored runs of main (#1, #3), of feature-x (#2), and one of schema 9
TABLE_HEADER = "| Workload | Verdict | vs eager | vs torch.compile | dtype | Δ vs base |"
TABLE_ROWS = (
    "| conv_block | ✅ passed | 1.62× (1.55–1.70); 1.10× at the baseline dtype "
    "| **1.21×** (1.15–1.28); 0.98× at the baseline dtype | → bf16 | — |",
    "| attention | ❌ failed | **0.97×** (0.93–0.99) | 0.91× | same | — |",
    "| mlp\\|wide | ⚠️ error | — | — | — | — |",
)
COMPARED_ROWS = (
    "| conv_block | ✅ passed | 1.62× | **1.21×** (1.15–1.28) | same "
    "| eager +0.4% [−0.9%, +1.8%] · speedup −1.2% [−3.8%, +1.3%] |",
    "| mlp | ❌ regressed | **1.31×** (1.27–1.35) | 1.02× | same "
    "| eager +12.0% [+8.0%, +16.0%] ❌ · speedup −1.5% [−5.0%, +2.0%] |",
    "| new_model | ✅ passed | **1.05×** (1.01–1.09) | — | same | not in the stored run |",
)
EXPRESSION = re.compile(r"\$\{\{\s*(.+?)\s*\}\}")
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")


def load(path: Path) -> dict[Any, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def tool(name: str) -> str:
    """A command-line tool from this Python's environment or PATH, or skip."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install {name})")
    return found


def all_steps(doc: dict[Any, Any]) -> list[dict[str, Any]]:
    if "runs" in doc:
        return list(doc["runs"]["steps"])
    return [step for job in doc["jobs"].values() for step in job.get("steps", [])]


# --- schema and audit ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "schema"),
    [
        (ACTION, "vendor.github-actions"),
        (WORKFLOW, "vendor.github-workflows"),
        (BASE_WORKFLOW, "vendor.github-workflows"),
    ],
    ids=["action", "workflow", "base-workflow"],
)
def test_validates_against_the_github_schema(path: Path, schema: str, tmp_path: Path) -> None:
    exe = tool("check-jsonschema")
    broken = tmp_path / path.name
    broken.write_text(path.read_text().replace("steps:", "stepz:", 1))

    good = subprocess.run(
        [exe, "--builtin-schema", schema, str(path)], capture_output=True, text=True, timeout=120
    )
    bad = subprocess.run(
        [exe, "--builtin-schema", schema, str(broken)], capture_output=True, text=True, timeout=120
    )

    assert good.returncode == 0, good.stdout + good.stderr
    assert "ok -- validation done" in good.stdout
    assert bad.returncode == 1, "the schema check must be able to fail"


def zizmor(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("zizmor"), "--offline", "--strict-collection", "--no-progress", "--color=never"]
        + [str(p) for p in paths],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_zizmor_finds_nothing() -> None:
    result = zizmor(ACTION, WORKFLOW, BASE_WORKFLOW)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "No findings to report" in result.stdout


def test_zizmor_would_catch_an_input_interpolated_into_run(tmp_path: Path) -> None:
    unsafe = tmp_path / "action.yml"
    text = ACTION.read_text()
    unsafe.write_text(
        text.replace('"$PYTHON" -m pip install', "${{ inputs.python }} -m pip install")
    )

    result = zizmor(unsafe)

    assert result.returncode != 0
    assert "template-injection" in result.stdout


# --- structure -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", [ACTION, WORKFLOW, BASE_WORKFLOW], ids=["action", "workflow", "base-workflow"]
)
def test_every_action_used_is_pinned_to_a_full_commit(path: Path) -> None:
    uses = [step["uses"] for step in all_steps(load(path)) if "uses" in step]

    assert uses
    assert [u for u in uses if not PINNED.match(u)] == []


@pytest.mark.parametrize("path", [ACTION, WORKFLOW], ids=["action", "workflow"])
def test_no_expression_is_pasted_into_a_shell_script(path: Path) -> None:
    scripts = [step["run"] for step in all_steps(load(path)) if "run" in step]

    assert scripts
    assert [s for s in scripts if "${{" in s] == []


def test_the_workflow_gives_each_job_least_privilege() -> None:
    workflow = load(WORKFLOW)
    triggers = workflow[True]  # PyYAML reads the key `on` as YAML 1.1's true

    assert workflow["permissions"] == {}
    assert triggers == {"pull_request_target": {"types": ["labeled"]}}
    for name, job in workflow["jobs"].items():
        permissions = job["permissions"]
        writes = {scope for scope, level in permissions.items() if level == "write"}
        steps = job["steps"]
        if "self-hosted" in job["runs-on"]:  # runs the pull request's code
            assert permissions == {"contents": "read"}, name
            assert "github.event.label.name == 'run-gpu-perf'" in job["if"], name
            checkouts = [s for s in steps if s.get("uses", "").startswith("actions/checkout@")]
            assert checkouts, name
            for checkout in checkouts:
                assert checkout["with"]["persist-credentials"] is False, name
                assert checkout["with"]["ref"] == "${{ github.event.pull_request.head.sha }}"
        if writes:  # may write: must not touch the pull request's code
            assert writes == {"pull-requests"}, name
            assert job["runs-on"] == "ubuntu-latest", name
            assert not any("checkout" in s.get("uses", "") or "run" in s for s in steps), name
    comment_jobs = [j for j in workflow["jobs"].values() if j["permissions"].get("pull-requests")]
    assert len(comment_jobs) == 1


def test_pull_requests_restore_the_runs_the_base_branch_stores_and_never_save_any() -> None:
    """A pull request's GPU job runs its code: it may read the base branch's stored runs, and
    nothing of it may become a cache the base branch later reads."""
    base = load(BASE_WORKFLOW)
    [record] = base["jobs"].values()
    uses = [s.get("uses", "") for s in record["steps"]]
    saves = [s for s in record["steps"] if s.get("uses", "").startswith("actions/cache/save@")]
    pr_steps = [s for job in load(WORKFLOW)["jobs"].values() for s in job.get("steps", [])]
    restores = [s for s in pr_steps if s.get("uses", "").startswith("actions/cache/restore@")]

    assert base[True] == {"push": {"branches": ["main"]}, "workflow_dispatch": None}
    assert record["permissions"] == {"contents": "read"}
    assert [u.split("@")[0] for u in uses] == [
        "actions/checkout",
        "actions/cache/restore",
        "OWNER/pytest-opprof",
        "actions/cache/save",
    ]
    [save] = saves
    assert save["if"] == "${{ !cancelled() }}"  # a failed gate's run is stored too
    assert save["with"] == {
        "path": ".opprof-runs",
        "key": "opprof-runs-${{ github.ref_name }}-${{ github.sha }}",
    }
    assert len(restores) == 2  # perf and perf-sharded
    for step in restores:
        assert step["with"]["path"] == ".opprof-runs"
        assert step["with"]["restore-keys"] == (
            "opprof-runs-${{ github.event.pull_request.base.ref }}-"
        )
    assert not any(
        "cache@" in s.get("uses", "") or "cache/save@" in s.get("uses", "") for s in pr_steps
    )


def test_the_shard_matrix_and_the_merge_are_shown() -> None:
    jobs = load(WORKFLOW)["jobs"]
    sharded = jobs["perf-sharded"]
    [merge] = [s["run"] for s in jobs["merge-shards"]["steps"] if "run" in s]

    assert sharded["strategy"]["matrix"]["shard"] == [1, 2]
    [action_step] = [s for s in sharded["steps"] if "pytest-opprof@" in s.get("uses", "")]
    assert action_step["with"]["extra-args"] == "--opprof-shard=${{ matrix.shard }}/2"
    assert "opprof merge shard-*/" in merge


# --- dry run of the action's steps ------------------------------------------------------------

FAKE_PYTHON = """#!{python}
# Stands in for the runner's Python: `-m pytest` records its arguments and "produces" the
# fixture out-dir; anything else (the action's helper scripts) runs on the real Python.
import json, os, shutil, sys
args = sys.argv[1:]
if args[:2] == ["-m", "pytest"]:
    with open(os.environ["FAKE_PYTEST_LOG"], "w") as fh:
        json.dump(args[2:], fh)
    out = next(a.split("=", 1)[1] for a in args if a.startswith("--opprof-out="))
    shutil.copytree(os.environ["FAKE_PYTEST_RESULTS"], out, dirs_exist_ok=True)
    sys.exit(int(os.environ["FAKE_PYTEST_STATUS"]))
os.execv(sys.executable, [sys.executable, *args])
"""


class ActionRun:
    """Runs action.yml's shell steps one by one in a scratch workspace, as a runner would."""

    def __init__(self, tmp_path: Path, env: dict[str, str], **inputs: str) -> None:
        action = load(ACTION)
        self.steps = {step["name"]: step for step in action["runs"]["steps"]}
        self.inputs = {
            name: str(spec.get("default", "")) for name, spec in action["inputs"].items()
        }
        self.inputs["github-token"] = TOKEN
        self.inputs.update(inputs)
        self.outputs: dict[str, dict[str, str]] = {}
        self.workspace = tmp_path / "workspace"
        self.workspace.mkdir()
        self.summary = tmp_path / "step_summary.md"
        self.tmp = tmp_path
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            "GITHUB_ACTION_PATH": str(ROOT),
            "GITHUB_STEP_SUMMARY": str(self.summary),
            **env,
        }

    def expand(self, text: str) -> str:
        def value(match: re.Match[str]) -> str:
            expr = match.group(1)
            if expr.startswith("inputs."):
                return self.inputs[expr.removeprefix("inputs.")]
            scope, step_id, kind, key = expr.split(".")
            assert (scope, kind) == ("steps", "outputs"), expr
            return self.outputs.get(step_id, {}).get(key, "")

        return EXPRESSION.sub(value, text)

    def run(self, name: str) -> subprocess.CompletedProcess[str]:
        step = self.steps[name]
        assert step["shell"] == "bash"
        script = self.tmp / f"step-{len(self.outputs)}.sh"
        script.write_text(step["run"])
        output = self.tmp / f"output-{len(self.outputs)}"
        output.touch()
        env = {**self.env, "GITHUB_OUTPUT": str(output)}
        env.update({key: self.expand(str(v)) for key, v in step.get("env", {}).items()})
        result = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
            cwd=self.workspace,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = output.read_text().splitlines()
        self.outputs[step.get("id", name)] = dict(line.split("=", 1) for line in lines)
        return result


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON.format(python=sys.executable))
    path.chmod(0o755)
    return path


def pr_env(github: FakeGitHub, tmp_path: Path) -> dict[str, str]:
    event = tmp_path / "event.json"
    event.write_text(json.dumps({"pull_request": {"number": PR}}))
    return {
        **github_env(github),
        "GITHUB_EVENT_PATH": str(event),
        "GITHUB_EVENT_NAME": "pull_request",
        "GITHUB_BASE_REF": "main",
        "GITHUB_REF_NAME": f"{PR}/merge",
        "NO_PROXY": "127.0.0.1",
    }


def session_with(tmp_path: Path, source: Path = SESSION, **changes: Any) -> Path:
    """A copy of a fixture out-dir with session.json changed."""
    out = tmp_path / "results"
    shutil.copytree(source, out)
    data = json.loads((out / "session.json").read_text())
    data.update(changes)
    (out / "session.json").write_text(json.dumps(data))
    return out


def test_dry_run_posts_the_table_and_fails_the_job_after_the_comment(
    github: FakeGitHub, tmp_path: Path, fake_python: Path
) -> None:
    env = {
        **pr_env(github, tmp_path),
        "FAKE_PYTEST_LOG": str(tmp_path / "pytest-args.json"),
        "FAKE_PYTEST_RESULTS": str(SESSION),
        "FAKE_PYTEST_STATUS": "1",
    }
    action = ActionRun(
        tmp_path,
        env,
        python=str(fake_python),
        paths="examples/conv_block  examples/attention\nexamples/mlp*",
        **{"min-speedup": "1.2", "baseline": "compile"},
        **{"extra-args": '-n 2 -k "not slow" --opprof-ncu=off'},
    )

    pytest_step = action.run("Run pytest --opprof")
    summary_step = action.run("Write the job summary and outputs")
    comment_step = action.run("Comment on the pull request")
    final_step = action.run("Fail the job when pytest or the speedup gate failed")

    assert pytest_step.returncode == 0, pytest_step.stderr  # captured, not returned
    assert json.loads((tmp_path / "pytest-args.json").read_text()) == [
        "--opprof",
        "examples/conv_block",
        "examples/attention",
        "examples/mlp*",  # not globbed: the plugin gets the path as written
        "--opprof-out=opprof-results",
        "--opprof-min-speedup=1.2",
        "--opprof-baseline=compile",
        "--opprof-device=cuda",
        "--junitxml=opprof-results/junit.xml",
        "--opprof-junit=opprof-results/opprof-junit.xml",
        "--opprof-storage=.opprof-runs",
        "-n",
        "2",
        "-k",
        "not slow",
        "--opprof-ncu=off",
    ]
    assert action.outputs["pytest"] == {"exit-code": "1"}

    assert summary_step.returncode == 0, summary_step.stderr
    out = (action.workspace / "opprof-results").resolve()
    assert action.outputs["summary"] == {
        "report": str(out / "report.md"),
        "speedup-table": str(out / "speedup-table.md"),
        "comment-body": str(out / "comment.md"),
        "passed": "false",
        "gate-enforced": "true",
        "saved-run": "",
    }
    job_summary = action.summary.read_text()
    comment_body = (out / "comment.md").read_text()
    table = (out / "speedup-table.md").read_text()
    assert table.splitlines() == [TABLE_HEADER, "|---|---|---|---|---|---|", *TABLE_ROWS]
    assert table in job_summary
    assert table in comment_body
    assert job_summary.startswith(
        "### pytest-opprof: ❌ speedup gate failed\n\n3 workloads; minimum speedup 1.2×, "
        "baseline `compile`, commit `4f2a9c1e7b3d` on `faster-convs`; pytest exited with "
        "status 1.\n"
    )
    assert (
        "artifact `opprof-results` of [run 42](https://github.com/octo/widgets/actions/runs/42)"
        "; open a trace (`<workload>/profiler_output/*.trace.json`) in "
        "[Perfetto](https://ui.perfetto.dev)"
    ) in job_summary
    assert "<details><summary>Session report" in job_summary
    assert comment_body == f"{MARKER}\n{job_summary}"

    assert comment_step.returncode == 0, comment_step.stderr
    assert comment_step.stdout == f"created comment 1 on {REPO}#{PR}\n"
    assert github.bodies() == [comment_body]

    assert final_step.returncode == 1
    assert "::error title=pytest-opprof::pytest --opprof exited with status 1" in final_step.stdout
    assert TOKEN not in "".join(
        s.stdout + s.stderr for s in (pytest_step, summary_step, comment_step, final_step)
    )


def test_dry_run_of_a_passing_gate_leaves_the_job_green(
    github: FakeGitHub, tmp_path: Path, fake_python: Path
) -> None:
    passing = session_with(tmp_path, gate_passed=True, workloads=[{"name": "conv_block"}])
    env = {
        **pr_env(github, tmp_path),
        "FAKE_PYTEST_LOG": str(tmp_path / "pytest-args.json"),
        "FAKE_PYTEST_RESULTS": str(passing),
        "FAKE_PYTEST_STATUS": "0",
    }
    action = ActionRun(tmp_path, env, python=str(fake_python), **{"out-dir": "perf out"})

    assert action.run("Run pytest --opprof").returncode == 0
    assert action.run("Write the job summary and outputs").returncode == 0
    final = action.run("Fail the job when pytest or the speedup gate failed")

    assert action.outputs["summary"]["passed"] == "true"
    assert action.outputs["summary"]["gate-enforced"] == "true"  # no key: a file from before it
    assert action.summary.read_text().startswith("### pytest-opprof: ✅ speedup gate passed")
    assert (action.workspace / "perf out" / "junit.xml").parent.is_dir()
    assert final.returncode == 0
    assert final.stdout == ""


@pytest.mark.parametrize(
    ("inputs", "device"), [({}, "cuda"), ({"device": "auto"}, "auto"), ({"device": "cpu"}, "cpu")]
)
def test_the_action_measures_on_the_gpu_unless_told_otherwise(
    tmp_path: Path, fake_python: Path, inputs: dict[str, str], device: str
) -> None:
    log = tmp_path / "pytest-args.json"
    env = {
        "FAKE_PYTEST_LOG": str(log),
        "FAKE_PYTEST_RESULTS": str(SESSION),
        "FAKE_PYTEST_STATUS": "0",
    }
    action = ActionRun(tmp_path, env, python=str(fake_python), **inputs)

    assert action.run("Run pytest --opprof").returncode == 0

    assert load(ACTION)["inputs"]["device"]["default"] == "cuda"
    devices = [arg for arg in json.loads(log.read_text()) if "device" in arg]
    assert devices == [f"--opprof-device={device}"]


def test_dry_run_of_a_cpu_fallback_is_neutral_not_green(
    github: FakeGitHub, tmp_path: Path, fake_python: Path
) -> None:
    env = {
        **pr_env(github, tmp_path),
        "FAKE_PYTEST_LOG": str(tmp_path / "pytest-args.json"),
        "FAKE_PYTEST_RESULTS": str(CPU_SESSION),
        "FAKE_PYTEST_STATUS": "0",
    }
    action = ActionRun(tmp_path, env, python=str(fake_python), device="auto")

    assert action.run("Run pytest --opprof").returncode == 0
    assert action.run("Write the job summary and outputs").returncode == 0
    assert action.run("Comment on the pull request").returncode == 0
    final = action.run("Fail the job when pytest or the speedup gate failed")

    job_summary = action.summary.read_text()
    [posted] = github.bodies()
    row = f"| tiny | {NOT_ENFORCED} | — | **1.05×** (0.98–1.12) | same | — |"
    assert job_summary.startswith(f"### pytest-opprof: {NOT_ENFORCED}\n\n1 workload; ")
    assert row in job_summary.splitlines()
    assert posted == f"{MARKER}\n{job_summary}"
    assert "✅" not in posted and "passed" not in posted
    assert action.outputs["summary"]["passed"] == "false"  # no speedup was proven
    assert action.outputs["summary"]["gate-enforced"] == "false"
    assert final.returncode == 0  # pytest passed: the job is not failed, only not green


def test_a_workload_not_enforced_is_neutral_in_a_file_without_the_session_key(
    tmp_path: Path,
) -> None:
    data = json.loads((CPU_SESSION / "session.json").read_text())
    del data["gate_enforced"]
    out = session_with(tmp_path, CPU_SESSION, **data)
    output = tmp_path / "output"

    summary.main([str(out)], env={"GITHUB_OUTPUT": str(output), "GITHUB_STEP_SUMMARY": os.devnull})

    assert {"passed=false", "gate-enforced=false"} <= set(output.read_text().splitlines())
    assert f"### pytest-opprof: {NOT_ENFORCED}" in (out / "comment.md").read_text()


def test_a_failure_beside_a_cpu_fallback_still_fails_the_headline(tmp_path: Path) -> None:
    cpu = json.loads((CPU_SESSION / "session.json").read_text())["workloads"]
    failed = {"name": "attention", "status": "failed", "speedup": 0.9, "enforced": True}
    out = session_with(tmp_path, CPU_SESSION, gate_passed=False, workloads=[*cpu, failed])

    texts = summary.render(out, summary.parse_args([str(out)]), {})

    assert texts["summary"].startswith("### pytest-opprof: ❌ speedup gate failed")
    assert f"| tiny | {NOT_ENFORCED} |" in texts["table"]
    assert "| attention | ❌ failed |" in texts["table"]
    assert texts["passed"] == "false"


def test_the_summary_says_the_plugins_words() -> None:
    schema = pytest.importorskip("pytest_opprof.schema", reason="the plugin is not installed")

    assert summary.CPU_NOT_ENFORCED == schema.CPU_NOT_ENFORCED


def test_comment_only_reads_a_downloaded_out_dir(github: FakeGitHub, tmp_path: Path) -> None:
    downloaded = session_with(tmp_path)
    action = ActionRun(
        tmp_path,
        pr_env(github, tmp_path),
        python=sys.executable,
        **{"comment-only": "true", "out-dir": str(downloaded)},
    )

    assert action.run("Write the job summary and outputs").returncode == 0
    assert action.run("Comment on the pull request").returncode == 0

    assert action.outputs["summary"]["passed"] == "false"  # from session.json's gate_passed
    [posted] = github.bodies()
    assert posted.startswith(
        f"{MARKER}\n### pytest-opprof: ❌ speedup gate failed\n\n3 workloads; commit "
        "`4f2a9c1e7b3d` on `faster-convs`."
    )
    assert TABLE_ROWS[0] in posted


def test_extra_args_that_are_not_shell_words_stop_the_step(
    tmp_path: Path, fake_python: Path
) -> None:
    env = {"FAKE_PYTEST_LOG": str(tmp_path / "log"), "FAKE_PYTEST_RESULTS": str(SESSION)}
    action = ActionRun(tmp_path, env, python=str(fake_python), **{"extra-args": '-k "oops'})

    result = action.run("Run pytest --opprof")

    assert result.returncode == 1
    assert "pytest-opprof: extra-args '-k \"oops' is not shell words: No closing quotation" in (
        result.stderr
    )
    assert not (tmp_path / "log").exists()


def test_the_summary_says_when_there_are_no_results(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    output = tmp_path / "output"
    step_summary = tmp_path / "summary.md"
    env = {"GITHUB_OUTPUT": str(output), "GITHUB_STEP_SUMMARY": str(step_summary)}

    assert summary.main([str(out), "--exit-code=4"], env=env) == 0

    assert "passed=false" in output.read_text().splitlines()
    text = step_summary.read_text()
    assert "❌ speedup gate failed" in text
    assert f"**No results:** `{out.resolve()}/session.json` was not written" in text


def test_the_summary_rejects_an_unknown_session_schema(tmp_path: Path) -> None:
    out = session_with(tmp_path, schema_version="2.0")
    output = tmp_path / "output"

    summary.main([str(out)], env={"GITHUB_OUTPUT": str(output), "GITHUB_STEP_SUMMARY": os.devnull})

    assert "passed=false" in output.read_text().splitlines()
    assert "schema_version '2.0'; this action reads 1.x" in (out / "comment.md").read_text()


# --- the real plugin, on the CPU fallback ------------------------------------------------------


def _plugin_installed() -> bool:
    return any(ep.name == "opprof" for ep in importlib.metadata.entry_points(group="pytest11"))


@pytest.mark.slow
@pytest.mark.skipif(
    not _plugin_installed(), reason="pytest-opprof is not installed (pip install .)"
)
def test_the_action_steps_with_the_real_plugin_on_the_cpu(
    github: FakeGitHub, tmp_path: Path
) -> None:
    workload = tmp_path / "workspace_src" / "tiny.py"
    workload.parent.mkdir()
    shutil.copy(DATA / "tiny_workload.py", workload)
    action = ActionRun(
        tmp_path,
        pr_env(github, tmp_path),
        python=sys.executable,
        paths=str(workload),
        device="cpu",
        **{"extra-args": "-p no:cacheprovider"},
    )

    pytest_step = action.run("Run pytest --opprof")
    summary_step = action.run("Write the job summary and outputs")
    comment_step = action.run("Comment on the pull request")

    assert pytest_step.returncode == 0, pytest_step.stderr
    assert summary_step.returncode == 0, summary_step.stderr
    assert comment_step.returncode == 0, comment_step.stderr
    assert "**No results:**" not in action.summary.read_text(), pytest_step.stdout
    assert "Δ vs base: no stored run of `main` to compare with" not in action.summary.read_text()
    for text in (action.summary.read_text(), github.bodies()[0]):
        assert TABLE_HEADER in text
        assert re.search(rf"^\| tiny\S* \| {NOT_ENFORCED} \|", text, re.MULTILINE), text
        assert "✅" not in text
    assert action.outputs["summary"]["gate-enforced"] == "false"


# --- across commits: the base branch's stored run, and the comment's marker --------------------


def history_run(
    github: FakeGitHub,
    tmp_path: Path,
    fake_python: Path,
    *,
    storage: Path | None,
    results: Path = COMPARED,
    env: dict[str, str] | None = None,
    inputs: dict[str, str] | None = None,
) -> tuple[ActionRun, list[str]]:
    """The action's steps up to the comment, with ``storage`` (a copy of a folder of stored
    runs, or none) in the workspace and these action ``inputs``; returns the run and the
    arguments pytest got."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "pytest-args.json"
    full_env = {
        **pr_env(github, tmp_path),
        "FAKE_PYTEST_LOG": str(log),
        "FAKE_PYTEST_RESULTS": str(results),
        "FAKE_PYTEST_STATUS": "1",
        **(env or {}),
    }
    action = ActionRun(tmp_path, full_env, python=str(fake_python), **(inputs or {}))
    if storage is not None:
        shutil.copytree(storage, action.workspace / ".opprof-runs")
    for step in (
        "Find the base branch's stored run",
        "Run pytest --opprof",
        "Write the job summary and outputs",
        "Comment on the pull request",
    ):
        done = action.run(step)
        assert done.returncode == 0, (step, done.stdout, done.stderr)
    return action, json.loads(log.read_text())


def test_a_pull_request_is_compared_with_its_base_branchs_last_stored_run(
    github: FakeGitHub, tmp_path: Path, fake_python: Path
) -> None:
    action, args = history_run(
        github, tmp_path, fake_python, storage=RUNS, inputs={"compare-fail": "latency:5%"}
    )

    assert action.outputs["base"] == {"run": ".opprof-runs/0003_main.json", "branch": "main"}
    assert args[-3:] == [
        "--opprof-storage=.opprof-runs",
        "--opprof-compare=.opprof-runs/0003_main.json",
        "--opprof-compare-fail=latency:5%",
    ]
    assert not any(a.startswith("--opprof-save") for a in args)  # a pull request saves nothing
    [posted] = github.bodies()
    lines = posted.splitlines()
    assert lines[0] == MARKER
    assert lines[1] == "### pytest-opprof: ❌ speedup gate failed"
    assert "commit `9e8d7c6b5a4f` on `wider-mlp`" in lines[3]
    assert [line for line in lines if line.startswith("| ")][1:] == list(COMPARED_ROWS)
    assert (
        "Δ vs base: this run over stored run `#3 main @ 0a1b2c3`, with 95% CIs; ❌ marks a "
        "change past `--opprof-compare-fail` with certainty."
    ) in lines
    assert (
        "> ⚠️ mlp: the software differs from run #3 main @ 0a1b2c3 (torch 2.11.0+cu128 → "
        "2.12.0+cu128): a change may come from the stack as well as from the code"
    ) in lines


def test_without_a_stored_run_of_the_base_branch_nothing_is_compared(
    github: FakeGitHub, tmp_path: Path, fake_python: Path
) -> None:
    only_feature = tmp_path / "only-feature"
    only_feature.mkdir()
    shutil.copy(RUNS / "0002_feature-x.json", only_feature)

    for storage, name in ((None, "absent"), (only_feature, "other-branch")):
        github.comments[PR] = []
        action, args = history_run(
            github,
            tmp_path / name,
            fake_python,
            storage=storage,
            results=SESSION,
            inputs={"compare-fail": "latency:5%"},
        )
        assert action.outputs["base"] == {"run": "", "branch": "main"}, name
        assert [a for a in args if "compare" in a] == [], name  # no --opprof-compare-fail alone
        [posted] = github.bodies()
        assert (
            "Δ vs base: no stored run of `main` to compare with (restore the base branch's "
            "stored runs into the action's `storage` folder: docs/regressions.md)."
        ) in posted.splitlines(), name
        assert all(row in posted.splitlines() for row in TABLE_ROWS), name  # Δ: —


def test_a_push_saves_its_run_and_compares_with_the_branchs_previous_one(
    tmp_path: Path, fake_python: Path
) -> None:
    env = {
        "FAKE_PYTEST_LOG": str(tmp_path / "pytest-args.json"),
        "FAKE_PYTEST_RESULTS": str(SESSION),
        "FAKE_PYTEST_STATUS": "0",
        "GITHUB_EVENT_NAME": "push",
        "GITHUB_REF_NAME": "main",
    }
    action = ActionRun(tmp_path, env, python=str(fake_python), comment="false")
    shutil.copytree(RUNS, action.workspace / ".opprof-runs")

    assert action.run("Find the base branch's stored run").returncode == 0
    assert action.run("Run pytest --opprof").returncode == 0

    args = json.loads((tmp_path / "pytest-args.json").read_text())
    assert args[-3:] == [
        "--opprof-storage=.opprof-runs",
        "--opprof-save=auto",
        "--opprof-compare=.opprof-runs/0003_main.json",
    ]


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        ({"save-run": "false", "compare-with": "none"}, []),
        ({"save-run": "true"}, ["--opprof-save=auto"]),
        (
            {"save-run": "nightly", "compare-with": "7"},
            ["--opprof-save=nightly", "--opprof-compare=7"],
        ),
    ],
    ids=["off", "always", "named"],
)
def test_the_history_inputs_reach_pytest(
    tmp_path: Path, fake_python: Path, inputs: dict[str, str], expected: list[str]
) -> None:
    log = tmp_path / "pytest-args.json"
    env = {
        "FAKE_PYTEST_LOG": str(log),
        "FAKE_PYTEST_RESULTS": str(SESSION),
        "FAKE_PYTEST_STATUS": "0",
        "GITHUB_EVENT_NAME": "pull_request",
    }
    action = ActionRun(tmp_path, env, python=str(fake_python), storage="perf runs", **inputs)

    assert action.run("Run pytest --opprof").returncode == 0

    args = json.loads(log.read_text())
    assert args[args.index("--opprof-storage=perf runs") + 1 :] == expected


def comment_only(github: FakeGitHub, tmp_path: Path, **inputs: str) -> ActionRun:
    """The comment job of a workflow: it reads a downloaded out-dir (a copy of COMPARED)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    downloaded = session_with(tmp_path, COMPARED)
    action = ActionRun(
        tmp_path,
        pr_env(github, tmp_path),
        python=sys.executable,
        **{"comment-only": "true", "out-dir": str(downloaded), **inputs},
    )
    for step in ("Write the job summary and outputs", "Comment on the pull request"):
        done = action.run(step)
        assert done.returncode == 0, (step, done.stdout, done.stderr)
    return action


def test_two_markers_keep_two_comments(github: FakeGitHub, tmp_path: Path) -> None:
    a100, h200 = "<!-- pytest-opprof a100 -->", "<!-- pytest-opprof h200 -->"
    for i, marker in enumerate((a100, h200, a100, h200)):
        comment_only(github, tmp_path / f"job{i}", **{"comment-marker": marker})

    bodies = github.bodies()
    assert [b.splitlines()[0] for b in bodies] == [a100, h200]
    assert [m for m, _ in github.requests].count("POST") == 2
    assert [m for m, _ in github.requests].count("PATCH") == 2
    assert all("| mlp | ❌ regressed |" in b for b in bodies)


def test_a_marked_comment_by_someone_else_is_left_alone(github: FakeGitHub, tmp_path: Path) -> None:
    forged = f"{MARKER}\n### pytest-opprof: ✅ speedup gate passed (trust me)"
    github.add_comment(PR, forged, login="mallory")

    comment_only(github, tmp_path / "first")
    comment_only(github, tmp_path / "second")

    bodies = github.bodies()
    assert bodies[0] == forged  # never edited
    assert len(bodies) == 2 and bodies[1].startswith(f"{MARKER}\n### pytest-opprof: ❌")
    assert [m for m, _ in github.requests if m != "GET"] == ["POST", "PATCH"]
    assert github.comments[PR][1]["user"]["login"] == "github-actions[bot]"


def test_a_marker_that_is_not_one_html_comment_is_refused(tmp_path: Path) -> None:
    out = session_with(tmp_path)
    result = subprocess.run(
        [sys.executable, str(ROOT / "ci" / "summary.py"), str(out), "--marker=<!-- a --> b -->"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "is not one hidden HTML comment" in result.stderr


def test_the_base_run_script_finds_a_run_the_plugin_stored(tmp_path: Path) -> None:
    history = pytest.importorskip("pytest_opprof.history", reason="the plugin is not installed")
    import stored_runs

    older = history.StoredRun(number=0, created="2026-12-01", device="cpu", branch="main")
    newer = history.StoredRun(number=0, created="2026-12-02", device="cpu", branch="main")
    other = history.StoredRun(number=0, created="2026-12-03", device="cpu", branch="dev")
    paths = [history.save_run(tmp_path, run) for run in (older, newer, other)]

    assert stored_runs.last_run_of(tmp_path, "main") == paths[1]
    assert stored_runs.last_run_of(tmp_path, "release") is None
    assert stored_runs.last_run_of(RUNS, "main") == RUNS / "0003_main.json"  # 0004: schema 9
