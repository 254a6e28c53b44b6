"""A search against the defaults on real drawings: `imagelake run` with the default settings, then `imagelake tune
--promote` on the same data in the same workspace, side by side.

    .venv/bin/python bench/tune.py [--trials 8] [--time-budget S] [--set NAME=VALUE ...] [--keep DIR]

The data: Debian's tuxpaint-stamps-default (`make stamps`), labelled by topic, as bench/quality.py reads them. Both
commands are the CLI a user types, in one fresh workspace: the search reuses the run's data stages (the same cache,
so the same train, validation and test splits), runs TRIALS trials of the default space (docs/training.md) under ASHA,
then trains its best settings and promotes them through the gate, which tests both models on the same test split.
Printed: the search's table, then the defaults' and the best settings' test accuracy, the gain, and the wall time of
each command. --set applies to both.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import add_record_option, invoked, record
from quality import STAMPS, write_stamps  # bench/quality.py: the stamps as OUT/<topic>/<file>

REPO = Path(__file__).resolve().parent.parent
STAMP_FILES = ["--set", 'image_extensions=[".png",".svg"]']


def imagelake(args: list[str]) -> tuple[dict, float, str]:
    """One `imagelake` command: its --json summary, its wall time and its printed lines."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "imagelake.flows.cli", *args, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=4 * 3600,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"imagelake {args[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]), wall, "\n".join(lines[:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--time-budget", type=float, help="seconds, as imagelake tune's")
    parser.add_argument("--set", action="append", default=[], help="NAME=VALUE for both commands")
    parser.add_argument("--keep", help="keep the workspace in this folder (default: a temporary one, removed)")
    add_record_option(parser)
    args = parser.parse_args()
    if not STAMPS.is_dir():
        sys.exit(f"{STAMPS} is missing: `make stamps` installs Debian's tuxpaint-stamps-default")
    root = Path(args.keep or tempfile.mkdtemp(prefix="imagelake-tune-bench-"))
    try:
        source, workspace = root / "stamps", root / "ws"
        print(f"stamps: {write_stamps(source)} files of {len(list(source.iterdir()))} topics in {source}")
        common = ["--source", str(source), "--set", f"workspace={workspace}", *STAMP_FILES]
        common += [arg for pair in args.set for arg in ("--set", pair)]
        run, run_wall, _ = imagelake(["run", *common])
        print(f"defaults: test accuracy {run['test_accuracy']:.3f}, {run['epochs_run']} epochs, {run_wall:.0f} s")
        budget = ["--time-budget", str(args.time_budget)] if args.time_budget else []
        tune, tune_wall, printed = imagelake(["tune", *common, "--trials", str(args.trials), "--promote", *budget])
        print(printed)
        promoted = tune["promoted"] or {}
        best = promoted.get("test_accuracy")
        print()
        print(f"{'':24} {'test accuracy':>14} {'wall':>8}")
        print(f"{'defaults (imagelake run)':24} {run['test_accuracy']:14.3f} {run_wall:7.0f}s")
        shown = "-" if best is None else f"{best:.3f}"
        print(f"{'search + best, trained':24} {shown:>14} {tune_wall:7.0f}s")
        if best is not None:
            print(
                f"gain {best - run['test_accuracy']:+.3f} in test accuracy for {tune_wall / run_wall:.1f} times the "
                f"wall time ({len(tune['trials'])} trials, search alone {tune['seconds']:.0f} s); gate: "
                f"{promoted['decision']}"
            )
        if not args.no_record:
            figures = {
                "defaults_test_accuracy": round(run["test_accuracy"], 3),
                "defaults_wall_s": round(run_wall),
                "search_wall_s": round(tune["seconds"]),
                "search_and_train_wall_s": round(tune_wall),
                **({} if best is None else {"search_best_test_accuracy": round(best, 3)}),
            }
            what = f"`imagelake tune` ({len(tune['trials'])} trials) against `imagelake run`'s defaults on the stamps"
            record("tune_stamps", what, invoked(), figures, note=f"settings: {args.set}" if args.set else "")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
