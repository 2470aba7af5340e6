"""A local stand-in for the GitHub REST API's issue comments, and paths the CI tests share."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parents[2]
CI_DIR = ROOT / "ci"
DATA = Path(__file__).resolve().parent / "data"

TOKEN = "ghs_TESTtoken0123456789SECRETabcdef"
REPO = "octo/widgets"
PR = 7

_LIST = re.compile(r"^/repos/(?P<repo>[^/]+/[^/]+)/issues/(?P<pr>\d+)/comments$")
_ONE = re.compile(r"^/repos/(?P<repo>[^/]+/[^/]+)/issues/comments/(?P<id>\d+)$")


@dataclass
class Failure:
    """An answer the fake gives instead of the real one, to the next matching request."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=lambda: {"message": "Server Error"})
    method: str | None = None  # None: any method


@dataclass
class FakeGitHub:
    """The state behind the server: comments per pull request, injected failures, a request log."""

    url: str = ""
    token: str = TOKEN
    repo: str = REPO
    comments: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    next_link_base: str | None = None  # rewrite Link: next to another origin
    _next_id: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_comment(self, pr: int, body: str, login: str = "someone") -> int:
        with self.lock:
            comment_id = self._next_id
            self._next_id += 1
            self.comments.setdefault(pr, []).append(
                {"id": comment_id, "body": body, "user": {"login": login}}
            )
            return comment_id

    def bodies(self, pr: int = PR) -> list[str]:
        return [c["body"] for c in self.comments.get(pr, [])]

    def handle(
        self, method: str, raw_path: str, headers: Any, payload: Any
    ) -> tuple[int, dict[str, str], Any]:
        parts = urlsplit(raw_path)
        with self.lock:
            self.requests.append((method, raw_path))
            for i, failure in enumerate(self.failures):
                if failure.method in (None, method):
                    del self.failures[i]
                    return failure.status, failure.headers, failure.body
        if headers.get("Authorization") != f"Bearer {self.token}":
            return 401, {}, {"message": "Bad credentials"}
        listing, one = _LIST.match(parts.path), _ONE.match(parts.path)
        if listing and listing["repo"] == self.repo:
            pr = int(listing["pr"])
            if pr not in self.comments:
                return 404, {}, {"message": "Not Found"}
            if method == "GET":
                return self._page(pr, parts.path, parse_qs(parts.query))
            if method == "POST":
                comment_id = self.add_comment(pr, payload["body"], login="github-actions[bot]")
                return 201, {}, self._find(comment_id)
        if one and one["repo"] == self.repo and method == "PATCH":
            comment = self._find(int(one["id"]))
            if comment is None:
                return 404, {}, {"message": "Not Found"}
            comment["body"] = payload["body"]
            return 200, {}, comment
        return 404, {}, {"message": "Not Found"}

    def _find(self, comment_id: int) -> dict[str, Any] | None:
        for comments in self.comments.values():
            for comment in comments:
                if comment["id"] == comment_id:
                    return comment
        return None

    def _page(
        self, pr: int, path: str, query: dict[str, list[str]]
    ) -> tuple[int, dict[str, str], Any]:
        per_page = min(int(query.get("per_page", ["30"])[0]), 100)
        page = int(query.get("page", ["1"])[0])
        items = self.comments[pr]
        last = max(1, -(-len(items) // per_page))
        links = []
        base = self.next_link_base or self.url
        if page < last:
            links.append(f'<{base}{path}?per_page={per_page}&page={page + 1}>; rel="next"')
        links.append(f'<{self.url}{path}?per_page={per_page}&page={last}>; rel="last"')
        chunk = items[(page - 1) * per_page : page * per_page]
        return 200, {"Link": ", ".join(links)}, chunk


class _Handler(BaseHTTPRequestHandler):
    fake: FakeGitHub

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        payload = json.loads(self.rfile.read(length)) if length else None
        status, headers, body = self.fake.handle(self.command, self.path, self.headers, payload)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = _serve

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the tests assert on the scripts' output, not the server's."""


def github_env(fake: FakeGitHub, **extra: str) -> dict[str, str]:
    """The environment a job gives the comment script, pointed at the fake."""
    env = {
        "GITHUB_API_URL": fake.url,
        "GITHUB_TOKEN": TOKEN,
        "GITHUB_REPOSITORY": REPO,
        "GITHUB_SERVER_URL": "https://github.com",
        "GITHUB_RUN_ID": "42",
    }
    env.update(extra)
    return env


@contextmanager
def serve() -> Iterator[FakeGitHub]:
    """A running fake GitHub with pull request #7 (no comments yet) in octo/widgets."""
    fake = FakeGitHub()
    fake.comments[PR] = []
    handler = type("Handler", (_Handler,), {"fake": fake})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
