"""A local HTTP server that speaks enough of the Anthropic Messages API for the SDK.

``POST /v1/messages`` records the request (path, headers, JSON body) and answers with the next
queued ``Reply`` (else the default one): a ``message`` whose content is one ``tool_use`` block,
an error body with any status (529 overloaded, 401, ...), raw bytes, or a delay past the
client's timeout. The SDK reaches it through ``ANTHROPIC_BASE_URL``.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    status: int = 200
    body: Any = None
    raw: bytes | None = None
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def tool_message(tool_input: Any, *, stop_reason: str = "tool_use") -> dict[str, Any]:
    """A Messages API answer whose content is one ``submit_proposals`` call."""
    return message([tool_use(tool_input)], stop_reason=stop_reason)


def tool_use(tool_input: Any, name: str = "submit_proposals") -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_01Fake", "name": name, "input": tool_input}


def message(content: list[dict[str, Any]], *, stop_reason: str = "tool_use") -> dict[str, Any]:
    return {
        "id": "msg_01Fake",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": 1200, "output_tokens": 300},
    }


def error_body(kind: str, text: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": text}}


class FakeMessagesAPI:
    """Start with ``start()``, point ``ANTHROPIC_BASE_URL`` at ``url``, ``stop()`` at the end."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.replies: deque[Reply] = deque()
        self.default = Reply(body=tool_message({"proposals": []}))
        self.release = threading.Event()  # ends a delayed reply early at teardown
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def queue(self, reply: Reply) -> None:
        self.replies.append(reply)

    def start(self) -> FakeMessagesAPI:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    body = {"_unparsed": raw.decode("utf-8", "replace")}
                api.requests.append(
                    Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
                reply = api.replies.popleft() if api.replies else api.default
                if self.path.split("?")[0] != "/v1/messages":
                    reply = Reply(status=404, body=error_body("not_found_error", self.path))
                if reply.delay_s and api.release.wait(reply.delay_s):
                    return  # released at teardown: the client is long gone
                payload = reply.raw if reply.raw is not None else json.dumps(reply.body).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(payload)))
                    self.send_header("request-id", "req_01Fake")
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and closed the connection

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep the test output clean

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
