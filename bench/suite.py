"""The whole suite as CI runs it, timed on a clean clone: `git clone` of a commit, then `CI=true bash .ci/run`.

    .venv/bin/python bench/suite.py [--rev HEAD] [--shared ../shared] [--keep]

Clones REV into a temp folder (with a link to the shared folder beside it, as CI has it), runs .ci/run there with
`PYTEST_ARGS=--durations=0`, stamps each line of its output with the time it came, and prints the install and lint
time (up to the first pytest session), each pytest part's closing line and the whole. The figures are appended to
bench/results/suite.jsonl (bench/figures.py); the log is kept beside the clone with --keep, for
`bench/suite_durations.py LOG`. Nothing else should run on the machine meanwhile: the suite is bound by its CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import figures
from suite_durations import CLOSING

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rev", default="HEAD", help="the commit to clone (default: HEAD; uncommitted changes are not in it)"
    )
    parser.add_argument(
        "--shared", type=Path, default=ROOT.parent / "shared", help="the folder CI has beside the clone"
    )
    parser.add_argument("--keep", action="store_true", help="keep the clone and its log")
    parser.add_argument("--no-record", action="store_true", help="print the figures without recording them")
    args = parser.parse_args()
    rev = subprocess.run(
        ["git", "rev-parse", "--short=7", args.rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix="imagelake-suite-"))
    clone = folder / "main"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "--quiet", rev], cwd=clone, check=True)
    if args.shared.is_dir():
        (folder / "shared").symlink_to(args.shared.resolve())
    env = {**os.environ, "CI": "true", "PYTEST_ARGS": "--durations=0"}
    env.pop("VIRTUAL_ENV", None)
    log = folder / "ci.log"
    started = time.monotonic()
    first_session = None
    closing: list[tuple[str, float]] = []
    with (
        log.open("w") as out,
        subprocess.Popen(
            ["bash", ".ci/run"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as run,
    ):
        for line in run.stdout:
            out.write(line)
            if first_session is None and "test session starts" in line:
                first_session = time.monotonic() - started
            if match := CLOSING.match(line.strip()):
                closing.append((match.group(1), float(match.group(2))))
                print(line.rstrip(), flush=True)
    total = time.monotonic() - started
    print(f"{rev}: .ci/run exited {run.returncode} after {total / 60:.1f} min; log {log}")
    figures_found: dict[str, float | int] = {"in_all_min": round(total / 60, 1)}
    if first_session is not None:
        figures_found["install_and_lint_min"] = round(first_session / 60, 1)
    for name, (_, seconds) in zip(("first_part_min", "alone_part_min"), closing, strict=False):
        figures_found[name] = round(seconds / 60, 1)
    counts = [re.search(r"(\d+) passed", text) for text, _ in closing]
    figures_found["passed"] = sum(int(found.group(1)) for found in counts if found)
    print(figures_found)
    if run.returncode == 0 and not args.no_record:
        figures.record(
            "suite",
            "the whole suite on a clean clone, install and lint included",
            "CI=true bash .ci/run",
            figures_found,
            commit=rev,
        )
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
