"""Typed exceptions. A user's mistake is an ``OpprofError`` with one message that says what was
found, what was expected and what to do; a bug of ours is any other exception and keeps its
traceback."""

from __future__ import annotations

import pytest


class OpprofError(Exception):
    """Base of every error the user can act on."""


class UsageError(OpprofError):
    """An option or ``OPPROF`` dict value is wrong."""


class WorkloadError(OpprofError):
    """The workload file breaks the workload contract (docs/usage.md#a-workload)."""


class ArtifactError(OpprofError):
    """An artifact on disk is missing, truncated, from a newer version or fails validation."""


class StageError(OpprofError):
    """A stage could not produce its artifact (child crashed, timed out, compile failed...)."""


class StageTimedOut(StageError):
    """A stage process ran past the stage's timeout and was stopped."""


class StageBlocked(OpprofError):
    """An earlier stage failed, so this one cannot run."""


class GateFailed(OpprofError):
    """The measured speedup is confidently short of the threshold."""


class OpprofWarning(pytest.PytestWarning):
    """Warnings of pytest-opprof, so ``-W error`` works."""
