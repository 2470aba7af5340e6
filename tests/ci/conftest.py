"""Fixtures of the CI tests: the fake GitHub server, and imports of the scripts under ci/."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# The scripts run as `python ci/<script>.py` and import each other as top-level modules; the
# tests import them (and fake_github) the same way, whatever pytest's import mode.
for path in (HERE.parents[1] / "ci", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from fake_github import FakeGitHub, serve  # noqa: E402


@pytest.fixture
def github() -> Iterator[FakeGitHub]:
    """A running fake GitHub with pull request #7 (no comments yet) in octo/widgets."""
    with serve() as fake:
        yield fake


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib honours proxy variables; the fake server is on loopback."""
    for name in (
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
