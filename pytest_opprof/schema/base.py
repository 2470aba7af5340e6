"""The base of every artifact model, and the atomic writes and validating reads of the files.

``Model`` forbids unknown fields; ``Artifact`` is a file on disk with a ``schema_version`` whose
major must match ours. ``write_artifact`` / ``write_text_atomic`` write through a temp file and a
rename; ``read_artifact`` turns every problem into an ``ArtifactError`` naming file and field.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from pytest_opprof.errors import ArtifactError


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Artifact(Model):
    """Base of the files on disk: a ``schema_version`` whose major must match ours."""

    SCHEMA_VERSION: ClassVar[str] = "1.0"
    schema_version: str = ""

    def model_post_init(self, context: Any, /) -> None:
        if not self.schema_version:
            self.schema_version = self.SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _same_major(cls, value: str) -> str:
        if not value:
            return value
        major, _, _ = value.partition(".")
        ours, _, _ = cls.SCHEMA_VERSION.partition(".")
        if not major.isdigit():
            raise ValueError(f"schema_version {value!r} is not MAJOR.MINOR")
        if int(major) > int(ours):
            raise ValueError(
                f"schema_version {value} is newer than this pytest-opprof reads "
                f"({cls.SCHEMA_VERSION}); upgrade pytest-opprof or re-run the stage"
            )
        if int(major) < int(ours):
            raise ValueError(
                f"schema_version {value} is older than {cls.SCHEMA_VERSION}; re-run the stage "
                "to rewrite it"
            )
        return value


# ------------------------------------------------------------------------------------- I/O

A = TypeVar("A", bound=BaseModel)


def write_artifact(path: Path, artifact: BaseModel) -> Path:
    """Write ``artifact`` as JSON atomically: a temp file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = artifact.model_dump_json(indent=2)
    write_text_atomic(path, text + "\n")
    return path


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def first_error(exc: ValidationError) -> tuple[str, str, int]:
    """The first problem pydantic found: its dotted location, its message, and how many more."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    return where, first["msg"], exc.error_count() - 1


def read_artifact(path: Path, model: type[A]) -> A:
    """Read and validate; any problem is an ``ArtifactError`` naming the file and the field. A
    ``.gz`` file is read through gzip (archived results keep their profiles so)."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            text = gzip.decompress(path.read_bytes()).decode("utf-8")
        else:
            text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(
            f"{path}: not found; run the stage that writes it first (a plain pytest --opprof "
            "run, or opprof optimize WORKLOAD, runs every stage)"
        ) from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ArtifactError(
            f"{path}: cannot be read ({why}); check its permissions, or delete it and re-run "
            "the stage that writes it"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArtifactError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "the file is truncated or was edited by hand — delete it and re-run the stage"
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where, msg, others = first_error(exc)
        more = f" (and {others} more)" if others else ""
        raise ArtifactError(
            f"{path}: field '{where}': {msg}{more}; delete the file and re-run the "
            "stage that writes it"
        ) from None
