"""ci/post_comment.py against a local server that answers like GitHub's issue-comments API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import post_comment
import pytest
from fake_github import CI_DIR, PR, REPO, TOKEN, Failure, FakeGitHub, github_env

SCRIPT = CI_DIR / "post_comment.py"
MARKER = "<!-- pytest-opprof -->"


def body_file(tmp_path: Path, text: str, name: str = "comment.md") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def run_script(fake: FakeGitHub, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The script as the action runs it: a separate process, configured by the environment."""
    full_env = {"PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1", **github_env(fake), **env}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


class Sleeps(list[float]):
    """An injected ``sleep`` that records instead of waiting."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def call(fake: FakeGitHub, *args: str, sleeps: Sleeps | None = None, now: float = 1e9) -> int:
    return post_comment.main(
        list(args),
        env=github_env(fake),
        sleep=Sleeps() if sleeps is None else sleeps,
        now=lambda: now,
    )


def test_running_twice_leaves_one_comment_with_the_second_body(
    github: FakeGitHub, tmp_path: Path
) -> None:
    github.add_comment(PR, "LGTM", login="reviewer")
    first = run_script(github, str(body_file(tmp_path, "first report", "a.md")), f"--pr={PR}")
    second = run_script(github, str(body_file(tmp_path, "second report", "b.md")), f"--pr={PR}")

    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    assert first.stdout.startswith(f"created comment 2 on {REPO}#{PR}")
    assert second.stdout.startswith(f"updated comment 2 on {REPO}#{PR}")
    assert github.bodies() == ["LGTM", f"{MARKER}\nsecond report"]
    assert [m for m, _ in github.requests] == ["GET", "POST", "GET", "PATCH"]
    assert TOKEN not in first.stdout + first.stderr + second.stdout + second.stderr


def test_marker_comment_on_page_two_is_updated(github: FakeGitHub, tmp_path: Path) -> None:
    for i in range(130):
        github.add_comment(PR, f"chatter {i}")
    ours = github.add_comment(PR, f"{MARKER}\nold report", login="github-actions[bot]")
    github.add_comment(PR, "after")

    assert call(github, str(body_file(tmp_path, "new report")), f"--pr={PR}") == 0

    gets = [path for method, path in github.requests if method == "GET"]
    assert gets == [
        f"/repos/{REPO}/issues/{PR}/comments?per_page=100",
        f"/repos/{REPO}/issues/{PR}/comments?per_page=100&page=2",
    ]
    assert ("PATCH", f"/repos/{REPO}/issues/comments/{ours}") in github.requests
    assert len(github.bodies()) == 132
    assert github.bodies()[130] == f"{MARKER}\nnew report"


def test_a_quoted_marker_is_not_taken_for_ours(github: FakeGitHub, tmp_path: Path) -> None:
    github.add_comment(PR, f"> {MARKER}\n> the bot said this", login="reviewer")

    assert call(github, str(body_file(tmp_path, "report")), f"--pr={PR}") == 0

    assert github.bodies() == [f"> {MARKER}\n> the bot said this", f"{MARKER}\nreport"]


def test_pr_number_comes_from_the_event_payload(github: FakeGitHub, tmp_path: Path) -> None:
    event = tmp_path / "event.json"
    event.write_text(json.dumps({"pull_request": {"number": PR}}))
    issue_event = tmp_path / "issue_event.json"
    issue_event.write_text(json.dumps({"issue": {"number": PR, "pull_request": {}}}))

    body = str(body_file(tmp_path, "from the event"))
    assert run_script(github, body, GITHUB_EVENT_PATH=str(event)).returncode == 0
    assert run_script(github, body, GITHUB_EVENT_PATH=str(issue_event)).returncode == 0

    assert github.bodies() == [f"{MARKER}\nfrom the event"]


def test_an_event_without_a_pull_request_says_to_pass_pr(
    github: FakeGitHub, tmp_path: Path
) -> None:
    event = tmp_path / "push.json"
    event.write_text(json.dumps({"ref": "refs/heads/main"}))

    result = run_script(github, str(body_file(tmp_path, "x")), GITHUB_EVENT_PATH=str(event))

    assert result.returncode == 1
    assert "pass --pr N" in result.stderr
    assert github.requests == []


def test_server_errors_are_retried_with_backoff(github: FakeGitHub, tmp_path: Path) -> None:
    github.failures += [Failure(500), Failure(502, method="GET"), Failure(503, method="POST")]
    sleeps = Sleeps()

    assert call(github, str(body_file(tmp_path, "report")), f"--pr={PR}", sleeps=sleeps) == 0

    assert sleeps == [1.0, 2.0, 1.0]  # doubling per call, restarting for the next call
    assert github.bodies() == [f"{MARKER}\nreport"]


def test_server_errors_that_persist_fail_with_one_line(
    github: FakeGitHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    github.failures += [Failure(500) for _ in range(post_comment.MAX_ATTEMPTS)]
    sleeps = Sleeps()

    assert call(github, str(body_file(tmp_path, "report")), f"--pr={PR}", sleeps=sleeps) == 1

    assert sleeps == [1.0, 2.0, 4.0, 8.0, 16.0]
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: GET ")
    assert "still failing after 6 attempts: HTTP 500" in err[-1]
    assert "re-run the job later" in err[-1]
    assert github.bodies() == []


def test_retry_after_is_honoured(github: FakeGitHub, tmp_path: Path) -> None:
    github.failures.append(Failure(429, {"Retry-After": "7"}, {"message": "slow down"}))
    sleeps = Sleeps()

    assert call(github, str(body_file(tmp_path, "report")), f"--pr={PR}", sleeps=sleeps) == 0

    assert sleeps == [7.0]
    assert github.bodies() == [f"{MARKER}\nreport"]


def test_secondary_rate_limit_403_with_retry_after_is_retried(
    github: FakeGitHub, tmp_path: Path
) -> None:
    github.failures.append(
        Failure(403, {"Retry-After": "3"}, {"message": "secondary rate limit"}, method="POST")
    )
    sleeps = Sleeps()

    assert call(github, str(body_file(tmp_path, "report")), f"--pr={PR}", sleeps=sleeps) == 0

    assert sleeps == [3.0]
    assert github.bodies() == [f"{MARKER}\nreport"]


def test_rate_limit_reset_is_waited_for_and_capped(github: FakeGitHub, tmp_path: Path) -> None:
    now = 1_700_000_000.0
    spent = {"X-RateLimit-Remaining": "0"}
    github.failures += [
        Failure(403, {**spent, "X-RateLimit-Reset": str(int(now) + 20)}, {"message": "limit"}),
        Failure(403, {**spent, "X-RateLimit-Reset": str(int(now) + 3600)}, {"message": "limit"}),
    ]
    sleeps = Sleeps()

    code = call(github, str(body_file(tmp_path, "r")), f"--pr={PR}", sleeps=sleeps, now=now)

    assert code == 0
    assert sleeps == [21.0, post_comment.MAX_SLEEP_S]  # reset + 1 s; an hour is capped
    assert github.bodies() == [f"{MARKER}\nr"]


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        pytest.param(
            {"GITHUB_TOKEN": "ghs_wrongWRONGwrong"},
            "401 Unauthorized): set GITHUB_TOKEN",
            id="401-bad-token",
        ),
        pytest.param(
            {"failure": Failure(403, {}, {"message": "Resource not accessible by integration"})},
            "403 Forbidden: Resource not accessible by integration): give the job "
            "'permissions: pull-requests: write'",
            id="403-no-permission",
        ),
        pytest.param(
            {"GITHUB_REPOSITORY": "octo/nowhere"},
            "404 Not Found) for octo/nowhere#7",
            id="404-repository",
        ),
        pytest.param({"pr": "999"}, "404 Not Found) for octo/widgets#999", id="404-pr"),
    ],
)
def test_client_errors_fail_at_once_with_what_to_fix(
    github: FakeGitHub, tmp_path: Path, setup: dict[str, object], expected: str
) -> None:
    failure = setup.pop("failure", None)
    if isinstance(failure, Failure):
        github.failures.append(failure)
    pr = str(setup.pop("pr", PR))
    env = {k: str(v) for k, v in setup.items()}

    result = run_script(github, str(body_file(tmp_path, "report")), f"--pr={pr}", **env)

    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    assert lines[0].startswith("error: ")
    assert expected in lines[0]
    assert len(github.requests) == 1  # not retried
    assert TOKEN not in result.stderr


def test_errors_are_annotations_inside_actions(github: FakeGitHub, tmp_path: Path) -> None:
    result = run_script(github, str(body_file(tmp_path, "r")), "--pr=999", GITHUB_ACTIONS="true")

    assert result.returncode == 1
    assert result.stderr.startswith("::error title=pytest-opprof comment::")


def test_the_token_never_appears_in_any_output(
    github: FakeGitHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = str(body_file(tmp_path, "report"))
    # A server that echoes the credentials back in its error message.
    github.failures.append(Failure(422, {}, {"message": f"bad header Bearer {TOKEN}"}))
    assert call(github, body, f"--pr={PR}") == 1
    github.failures += [Failure(500) for _ in range(post_comment.MAX_ATTEMPTS)]
    assert call(github, body, f"--pr={PR}") == 1
    assert call(github, body, f"--pr={PR}") == 0
    assert call(github, body, f"--pr={PR}", "--dry-run") == 0
    client = post_comment.GitHubClient(api_url=github.url, token=post_comment.Secret(TOKEN))
    print(repr(client), client)

    out, err = capsys.readouterr()
    assert TOKEN not in out + err
    assert "bad header Bearer ***" in err
    assert "Secret('***')" in out


def test_a_next_link_to_another_host_does_not_get_the_token(
    github: FakeGitHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(101):
        github.add_comment(PR, f"chatter {i}")
    github.next_link_base = "http://127.0.0.2:9"

    assert call(github, str(body_file(tmp_path, "r")), f"--pr={PR}") == 1

    assert "refusing to send the token to 'http://127.0.0.2:9/" in capsys.readouterr().err
    assert len(github.requests) == 1


def test_a_dropped_connection_is_retried(tmp_path: Path) -> None:
    env = {"GITHUB_API_URL": "http://127.0.0.1:9", "GITHUB_TOKEN": TOKEN, "GITHUB_REPOSITORY": REPO}
    sleeps = Sleeps()

    code = post_comment.main(
        [str(body_file(tmp_path, "r")), f"--pr={PR}"], env=env, sleep=sleeps, now=lambda: 0.0
    )

    assert code == 1
    assert len(sleeps) == post_comment.MAX_ATTEMPTS - 1


def test_a_long_body_is_truncated_with_a_link_to_the_artifacts(
    github: FakeGitHub, tmp_path: Path
) -> None:
    long = "| w | 1.00× |\n" * 6000  # 84,000 characters
    result = run_script(github, str(body_file(tmp_path, long)), f"--pr={PR}")

    assert result.returncode == 0, result.stderr
    assert "(truncated)" in result.stdout
    [posted] = github.bodies()
    assert len(posted) <= post_comment.MAX_BODY_CHARS
    assert posted.startswith(f"{MARKER}\n| w | 1.00× |\n")
    assert posted.rstrip().endswith(
        "[the run's artifacts](https://github.com/octo/widgets/actions/runs/42)."
    )
    assert "**Report truncated**" in posted


def test_truncation_closes_an_open_code_block_and_details() -> None:
    body = "<details><summary>s</summary>\n\n```\n" + "x" * 500
    cut = post_comment.truncate(body, 300, "https://example.test/runs/1")

    assert len(cut) <= 300
    assert cut.count("```") == 2
    assert cut.count("</details>") == 1
    assert cut.index("</details>") < cut.index("**Report truncated**")
    assert post_comment.truncate("short", 300, None) == "short"


def test_dry_run_sends_nothing_and_needs_no_token(github: FakeGitHub, tmp_path: Path) -> None:
    result = run_script(
        github, str(body_file(tmp_path, "the table")), f"--pr={PR}", "--dry-run", GITHUB_TOKEN=""
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        f"dry run: would create or update the comment marked {MARKER} on {REPO}#{PR} via "
        f"{github.url} ("
    )
    assert result.stdout.rstrip().endswith(f"{MARKER}\nthe table")
    assert github.requests == []


def test_a_missing_token_or_body_file_is_a_clear_error(github: FakeGitHub, tmp_path: Path) -> None:
    no_token = run_script(github, str(body_file(tmp_path, "r")), f"--pr={PR}", GITHUB_TOKEN="")
    no_body = run_script(github, str(tmp_path / "missing.md"), f"--pr={PR}")

    assert no_token.returncode == no_body.returncode == 1
    assert no_token.stderr == "error: GITHUB_TOKEN is empty: pass the action's github-token input\n"
    assert no_body.stderr.startswith("error: cannot read the comment body ")
    assert github.requests == []


def test_only_a_marked_comment_by_the_bot_is_edited(github: FakeGitHub, tmp_path: Path) -> None:
    """Anyone can write the marker: a marked comment by someone else is never edited."""
    forged = github.add_comment(PR, f"{MARKER}\nall green, merge it", login="mallory")
    body = str(body_file(tmp_path, "report"))

    assert call(github, body, f"--pr={PR}") == 0
    assert call(github, body, f"--pr={PR}") == 0

    assert github.bodies() == [f"{MARKER}\nall green, merge it", f"{MARKER}\nreport"]
    assert ("PATCH", f"/repos/{REPO}/issues/comments/{forged}") not in github.requests
    assert [m for m, _ in github.requests if m != "GET"] == ["POST", "PATCH"]


def test_a_token_of_another_login_edits_its_own_comment(github: FakeGitHub, tmp_path: Path) -> None:
    ours = github.add_comment(PR, f"{MARKER}\nold", login="perf-bot[bot]")

    code = call(github, str(body_file(tmp_path, "new")), f"--pr={PR}", "--author=perf-bot[bot]")

    assert code == 0
    assert ("PATCH", f"/repos/{REPO}/issues/comments/{ours}") in github.requests
    assert github.bodies() == [f"{MARKER}\nnew"]


def test_two_markers_are_two_comments_even_where_one_is_the_others_prefix(
    github: FakeGitHub, tmp_path: Path
) -> None:
    a100 = "<!-- pytest-opprof a100 -->"
    body = str(body_file(tmp_path, "report"))

    assert call(github, body, f"--pr={PR}", f"--marker={a100}") == 0
    assert call(github, body, f"--pr={PR}") == 0  # the default marker: not a100's comment
    assert call(github, body, f"--pr={PR}", f"--marker={a100}") == 0

    assert github.bodies() == [f"{a100}\nreport", f"{MARKER}\nreport"]
    assert post_comment.is_marked(f"{MARKER} extra\nx", MARKER) is False


@pytest.mark.parametrize("marker", ["pytest-opprof", "<!-- a --> <b>", "<!--x-->", "<!-- -->"])
def test_a_marker_must_be_one_hidden_comment(
    github: FakeGitHub, tmp_path: Path, marker: str
) -> None:
    result = run_script(github, str(body_file(tmp_path, "r")), f"--pr={PR}", f"--marker={marker}")

    assert result.returncode == 1
    assert "is not one hidden HTML comment" in result.stderr
    assert github.requests == []
