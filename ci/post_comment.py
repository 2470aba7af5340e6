"""Create or update the one pull-request comment that carries the pytest-opprof report.

The comment is found by a hidden marker (``<!-- pytest-opprof -->``, or the action's
``comment-marker``) on the first line of its body, across every page of the pull request's
comments, and edited in place, so a pull request gets one report that follows its latest run
instead of one comment per push; two matrix jobs with two markers keep two comments. Anyone can
write the marker, so only a comment by the bot that posts (``--author``, default
``github-actions[bot]``, the login of the job's ``GITHUB_TOKEN``) is ever edited: a marked
comment by anyone else is left alone and a new one created.

Standard library only: the action runs this on self-hosted runners whose Python we do not
control. The token is read from ``GITHUB_TOKEN`` and is never printed, not even in errors.

    python ci/post_comment.py opprof-results/comment.md [--pr N] [--marker M] [--author LOGIN]
        [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

MARKER = "<!-- pytest-opprof -->"
BOT = "github-actions[bot]"
"""The login of the comments a job's ``GITHUB_TOKEN`` writes."""
_MARKER_FORM = re.compile(r"<!-- [\w .:/@+=-]{1,100} -->")
# GitHub rejects a comment body over 65536 characters ("Body is too long").
MAX_BODY_CHARS = 65536
DEFAULT_API_URL = "https://api.github.com"
PER_PAGE = 100
MAX_ATTEMPTS = 6
MAX_SLEEP_S = 60.0
BACKOFF_BASE_S = 1.0
TIMEOUT_S = 30.0

_NEXT_LINK = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')


class CommentError(Exception):
    """A failure the user fixes; its message is the one line printed before exiting 1."""


class Secret:
    """A string that never shows itself in a repr, a str or a traceback's locals."""

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def redact(self, text: str) -> str:
        return text.replace(self._value, "***") if self._value else text

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8")) if self.body else None

    def message(self) -> str:
        """GitHub's own explanation of an error, or the start of the body."""
        try:
            data = self.json()
        except ValueError:
            return self.body[:200].decode("utf-8", "replace")
        if isinstance(data, dict) and "message" in data:
            return str(data["message"])
        return ""


@dataclass
class Target:
    """Where the comment goes."""

    api_url: str
    repo: str
    pr: int

    @property
    def comments_url(self) -> str:
        return f"{self.api_url}/repos/{self.repo}/issues/{self.pr}/comments"

    def comment_url(self, comment_id: int) -> str:
        return f"{self.api_url}/repos/{self.repo}/issues/comments/{comment_id}"


def rate_limit_wait(resp: Response, now: float) -> float | None:
    """Seconds GitHub asks us to wait, or None when the response is not a rate limit.

    Primary limits answer 403/429 with ``X-RateLimit-Remaining: 0`` and a reset epoch;
    secondary limits answer 403/429 with ``Retry-After``; a bare 429 is a limit too.
    """
    if resp.status not in (403, 429):
        return None
    retry_after = resp.headers.get("retry-after")
    if retry_after is not None:
        try:
            return max(0.0, float(retry_after))
        except ValueError:
            return 0.0
    if resp.headers.get("x-ratelimit-remaining") == "0":
        reset = resp.headers.get("x-ratelimit-reset")
        try:
            return max(0.0, float(reset) - now + 1.0) if reset is not None else 0.0
        except ValueError:
            return 0.0
    return 0.0 if resp.status == 429 else None


@dataclass
class GitHubClient:
    """A few REST calls with retries; ``sleep`` and ``now`` are injectable for tests."""

    api_url: str
    token: Secret
    sleep: Callable[[float], None] = time.sleep
    now: Callable[[], float] = time.time
    max_attempts: int = MAX_ATTEMPTS
    max_sleep: float = MAX_SLEEP_S
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr))

    def _send(self, method: str, url: str, payload: dict[str, Any] | None) -> Response:
        data = json.dumps(payload).encode("utf-8") if payload is not None else None
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Accept", "application/vnd.github+json")
        request.add_header("X-GitHub-Api-Version", "2022-11-28")
        request.add_header("User-Agent", "pytest-opprof-ci")
        request.add_header("Authorization", f"Bearer {self.token.reveal()}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as raw:
                headers = {k.lower(): v for k, v in raw.headers.items()}
                return Response(raw.status, headers, raw.read())
        except urllib.error.HTTPError as err:
            with err:
                headers = {k.lower(): v for k, v in err.headers.items()}
                return Response(err.code, headers, err.read())

    def request(self, method: str, url: str, payload: dict[str, Any] | None = None) -> Response:
        """Send one call; retry 5xx, rate limits and dropped connections with backoff."""
        if not url.startswith(self.api_url + "/"):
            # A Link header pointing elsewhere must not receive the token.
            raise CommentError(f"refusing to send the token to {url!r}: not under {self.api_url}")
        path = urllib.parse.urlsplit(url).path
        for attempt in range(1, self.max_attempts + 1):
            backoff = min(self.max_sleep, BACKOFF_BASE_S * 2 ** (attempt - 1))
            try:
                resp = self._send(method, url, payload)
            except (urllib.error.URLError, OSError) as err:
                reason = f"connection failed ({self.token.redact(str(err))})"
                wait = backoff
            else:
                limited = rate_limit_wait(resp, self.now())
                if resp.status >= 500:
                    reason, wait = f"HTTP {resp.status}", backoff
                elif limited is not None:
                    reason, wait = f"rate limited (HTTP {resp.status})", max(limited, backoff)
                else:
                    return resp
            if attempt == self.max_attempts:
                raise CommentError(
                    f"{method} {path} still failing after {attempt} attempts: {reason}; "
                    "GitHub may be degraded or the token's rate limit spent — re-run the job later"
                )
            wait = min(wait, self.max_sleep)
            self.log(
                f"{method} {path}: {reason}; retrying in {wait:g}s ({attempt}/{self.max_attempts})"
            )
            self.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover


def explain(resp: Response, method: str, target: Target) -> CommentError:
    """One line that says what went wrong and what to change."""
    where = f"{target.repo}#{target.pr}"
    if resp.status == 401:
        return CommentError(
            "GitHub rejected the token (401 Unauthorized): set GITHUB_TOKEN (the action's "
            "github-token input) to a valid token"
        )
    if resp.status == 403:
        return CommentError(
            f"the token may not comment on {where} (403 Forbidden: {resp.message()}): give the "
            "job 'permissions: pull-requests: write'; for pull requests from forks post from a "
            "pull_request_target job that runs no PR code (see ci/workflows/opprof.yml)"
        )
    if resp.status == 404:
        return CommentError(
            f"{method} found nothing (404 Not Found) for {where} at {target.api_url}: check "
            "GITHUB_REPOSITORY, the pull request number and that the token can see the repository"
        )
    return CommentError(f"{method} {where} failed: HTTP {resp.status}: {resp.message()}")


def iter_comments(client: GitHubClient, target: Target) -> Iterator[dict[str, Any]]:
    """Every comment of the pull request, following ``Link: rel="next"`` across pages."""
    url: str | None = f"{target.comments_url}?per_page={PER_PAGE}"
    while url is not None:
        resp = client.request("GET", url)
        if resp.status != 200:
            raise explain(resp, "GET", target)
        page = resp.json()
        if not isinstance(page, list):
            raise CommentError(
                f"GET {target.comments_url} returned {type(page).__name__}, not a list"
            )
        yield from page
        match = _NEXT_LINK.search(resp.headers.get("link", ""))
        url = match.group(1) if match else None


def check_marker(marker: str) -> str:
    """A marker is one hidden HTML comment: ``<!-- words -->``."""
    if not _MARKER_FORM.fullmatch(marker):
        raise CommentError(
            f"comment marker {marker!r} is not one hidden HTML comment like "
            "'<!-- pytest-opprof a100 -->' (letters, digits, spaces and . : / @ + = - _ inside)"
        )
    return marker


def is_marked(body: str, marker: str) -> bool:
    """The body's first line is the marker ("starts with", not "contains": someone quoting our
    comment must not have theirs rewritten; the whole line: one marker is not another's
    prefix)."""
    return body.lstrip().split("\n", 1)[0].rstrip() == marker


def find_marked(client: GitHubClient, target: Target, marker: str, author: str = BOT) -> int | None:
    """Id of the first comment by ``author`` whose first line is the marker."""
    for comment in iter_comments(client, target):
        login = (comment.get("user") or {}).get("login")
        if login == author and is_marked(str(comment.get("body") or ""), marker):
            return int(comment["id"])
    return None


def truncate(body: str, limit: int, artifacts_url: str | None) -> str:
    """Cut ``body`` to ``limit`` characters, ending with a note that points at the artifacts."""
    if len(body) <= limit:
        return body
    where = f"[the run's artifacts]({artifacts_url})" if artifacts_url else "the run's artifacts"
    note = (
        "\n\n---\n**Report truncated** to fit GitHub's comment limit; "
        f"the full report is in {where}.\n"
    )
    kept = body[: max(0, limit - len(note) - 16)]
    if kept.count("```") % 2:  # cut inside a code block: close it so the note renders
        kept += "\n```"
    if kept.count("<details") > kept.count("</details>"):
        kept += "\n</details>"
    return (kept + note)[:limit]


def with_marker(body: str, marker: str) -> str:
    return body if is_marked(body, marker) else f"{marker}\n{body}"


def pr_number(explicit: int | None, event_path: str | None) -> int:
    """The pull request number: ``--pr``, else the event's pull_request or issue."""
    if explicit is not None:
        return explicit
    if not event_path:
        raise CommentError("no pull request number: pass --pr N or run in a pull_request event")
    try:
        with open(event_path, encoding="utf-8") as fh:
            event = json.load(fh)
    except (OSError, ValueError) as err:
        raise CommentError(
            f"cannot read the event payload GITHUB_EVENT_PATH={event_path}: {err}"
        ) from None
    for key in ("pull_request", "issue"):
        number = (event.get(key) or {}).get("number")
        if isinstance(number, int):
            return number
    raise CommentError(
        f"the event at {event_path} is not about a pull request (no pull_request.number or "
        "issue.number): pass --pr N, or comment only on pull_request events"
    )


def artifacts_url(env: dict[str, str]) -> str | None:
    server = env.get("GITHUB_SERVER_URL", "https://github.com").rstrip("/")
    repo, run_id = env.get("GITHUB_REPOSITORY"), env.get("GITHUB_RUN_ID")
    return f"{server}/{repo}/actions/runs/{run_id}" if repo and run_id else None


def upsert(
    client: GitHubClient, target: Target, body: str, marker: str, author: str = BOT
) -> tuple[str, int]:
    """Update the marked comment or create it; returns ("updated" | "created", comment id)."""
    existing = find_marked(client, target, marker, author)
    if existing is not None:
        resp = client.request("PATCH", target.comment_url(existing), {"body": body})
        action = "updated"
    else:
        resp = client.request("POST", target.comments_url, {"body": body})
        action = "created"
    if resp.status not in (200, 201):
        raise explain(resp, "PATCH" if existing is not None else "POST", target)
    return action, int(resp.json()["id"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("body_file", help="Markdown file with the comment body")
    parser.add_argument("--pr", type=int, help="pull request number (default: from the event)")
    parser.add_argument("--marker", default=MARKER, help=f"hidden marker (default: {MARKER})")
    parser.add_argument(
        "--author",
        default=BOT,
        help=f"login whose marked comment may be edited (default: {BOT}, GITHUB_TOKEN's)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be done; no HTTP")
    return parser.parse_args(argv)


def run(
    args: argparse.Namespace, env: dict[str, str], client_factory: Callable[..., GitHubClient]
) -> str:
    check_marker(args.marker)
    repo = env.get("GITHUB_REPOSITORY", "")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise CommentError(f"GITHUB_REPOSITORY must be 'owner/name', got {repo!r}")
    target = Target(
        api_url=env.get("GITHUB_API_URL", DEFAULT_API_URL).rstrip("/"),
        repo=repo,
        pr=pr_number(args.pr, env.get("GITHUB_EVENT_PATH")),
    )
    try:
        with open(args.body_file, encoding="utf-8") as fh:
            raw = fh.read()
    except OSError as err:
        raise CommentError(
            f"cannot read the comment body {args.body_file}: {err.strerror}"
        ) from None
    marked = with_marker(raw, args.marker)
    body = truncate(marked, MAX_BODY_CHARS, artifacts_url(env))
    cut = " (truncated)" if body != marked else ""
    if args.dry_run:
        return (
            f"dry run: would create or update the comment marked {args.marker} on "
            f"{target.repo}#{target.pr} via {target.api_url} ({len(body)} chars{cut}):\n{body}"
        )
    token = env.get("GITHUB_TOKEN", "")
    if not token:
        raise CommentError("GITHUB_TOKEN is empty: pass the action's github-token input")
    client = client_factory(api_url=target.api_url, token=Secret(token))
    action, comment_id = upsert(client, target, body, args.marker, args.author or BOT)
    return f"{action} comment {comment_id} on {target.repo}#{target.pr}{cut}"


def main(
    argv: list[str] | None = None,
    *,
    env: dict[str, str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    now: Callable[[], float] = time.time,
) -> int:
    args = parse_args(argv)
    env = dict(os.environ) if env is None else env
    secret = Secret(env.get("GITHUB_TOKEN", ""))

    def factory(**kwargs: Any) -> GitHubClient:
        return GitHubClient(sleep=sleep, now=now, **kwargs)

    try:
        print(secret.redact(run(args, env, factory)))
    except CommentError as err:
        prefix = "::error title=pytest-opprof comment::" if env.get("GITHUB_ACTIONS") else "error: "
        print(prefix + secret.redact(str(err)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
