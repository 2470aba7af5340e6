"""Find the last stored run of a branch in a folder of pytest-opprof's stored runs.

The action compares a pull request with the latest run its base branch stored
(``--opprof-save``, restored into the ``storage`` folder from a cache or an artifact): this
prints that run's file, the one with the highest number whose ``branch`` is the one asked for,
or nothing where there is none (the comment then says so; the job is not failed for it).

    python ci/stored_runs.py STORAGE --branch main [--github-output]

With ``--github-output`` it sets ``run`` (the file, or empty) and ``branch`` in
``$GITHUB_OUTPUT``. A file that is not a stored run of schema 1.x is skipped with a note on
stderr. Standard library only, like the other scripts: it runs on whatever Python the runner
has, before pytest-opprof is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

RUN_FILE = re.compile(r"^(\d{4,})(?:_[A-Za-z0-9._-]+)?\.json$")


def last_run_of(storage: Path, branch: str) -> Path | None:
    """The stored run of ``branch`` with the highest number in ``storage``."""
    found: tuple[int, Path] | None = None
    if not storage.is_dir():
        return None
    for path in storage.iterdir():
        match = RUN_FILE.match(path.name)
        if not match or not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            print(f"stored_runs: skipping {path}: not readable JSON ({err})", file=sys.stderr)
            continue
        if not isinstance(data, dict) or str(data.get("schema_version", "")).split(".")[0] != "1":
            print(f"stored_runs: skipping {path}: not a stored run of schema 1.x", file=sys.stderr)
            continue
        number = int(match[1])
        if data.get("branch") == branch and (found is None or number > found[0]):
            found = (number, path)
    return found[1] if found else None


def main(argv: list[str] | None = None, env: dict[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("storage", type=Path, help="the folder of stored runs")
    parser.add_argument("--branch", required=True, help="the branch whose last run is wanted")
    parser.add_argument("--github-output", action="store_true", help="set run and branch")
    args = parser.parse_args(argv)
    env = dict(os.environ) if env is None else env
    run = last_run_of(args.storage, args.branch) if args.branch else None
    if run is not None:
        print(run)
    else:
        print(f"stored_runs: no stored run of {args.branch!r} in {args.storage}", file=sys.stderr)
    if args.github_output and env.get("GITHUB_OUTPUT"):
        with open(env["GITHUB_OUTPUT"], "a", encoding="utf-8") as fh:
            for key, value in (("run", str(run or "")), ("branch", args.branch)):
                if "\n" in value:
                    raise SystemExit(f"stored_runs: {key} must be one line, got {value!r}")
                fh.write(f"{key}={value}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
