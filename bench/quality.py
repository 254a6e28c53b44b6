"""Model quality, run after run: `imagelake run` with the default settings in fresh workspaces, on the demo digits and on real photos.

    .venv/bin/python bench/quality.py [--runs 5] [--photo-runs 1] [--same-seed] [--ref GIT_REF [--ref-runs N]] [--set NAME=VALUE ...]

Each run is the CLI a user types, in a new workspace (new table, cache, MLflow store): its test
accuracy, best val accuracy, epochs and wall time are printed, then the min, median and max.
Run k uses `seed=k`: the same seed gives the same model (training is deterministic), so only
other seeds say whether a good model was luck. --same-seed repeats the default seed instead.
The photo set is random crops of scikit-learn's two sample photos (china, flower) as JPEGs of
300-1,600 px (`imagelake demo-data --photos`). With --ref, the same runs are then made with the code
of that git revision (a worktree, the same virtual environment), side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_run(code: Path, source: Path, workspace: Path, extra: list[str]) -> dict:
    """One `imagelake run` in a fresh workspace; its summary plus the wall time."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("IMAGELAKE_")}
    env["PYTHONPATH"] = str(code)  # the code under test, ahead of the editable install
    cli = "flows.cli" if (code / "flows" / "cli.py").exists() else "infra.cli"  # infra/cli.py in older checkouts
    command = [sys.executable, "-m", cli, "run", "--source", str(source), "--set", f"workspace={workspace}", "--json", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"imagelake run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(workspace, ignore_errors=True)
    return {"test": summary["test_accuracy"], "val": summary["val_accuracy"], "epochs": summary["epochs_run"], "wall": wall}


def runs(name: str, code: Path, source: Path, count: int, extra: list[str], scratch: Path, same_seed: bool) -> list[dict]:
    results = []
    for index in range(count):
        seed = [] if same_seed else ["--set", f"seed={index + 1}"]
        result = one_run(code, source, scratch / f"{name}-{index}", [*seed, *extra])
        results.append(result)
        print(
            f"  {name:6} run {index + 1:2} ({'default seed' if same_seed else f'seed {index + 1}'}): test accuracy {result['test']:.3f}  "
            f"val {result['val']:.3f}  {result['epochs']} epochs  {result['wall']:.0f} s",
            flush=True,
        )
    return results


def spread(name: str, results: list[dict], key: str, threshold: float | None = None) -> str:
    values = [r[key] for r in results]
    digits = 3 if key == "test" else 0
    line = f"{name:24} {key:5} min {min(values):.{digits}f}  median {statistics.median(values):.{digits}f}  max {max(values):.{digits}f}"
    if threshold is not None:
        line += f"  ({sum(v >= threshold for v in values)}/{len(values)} >= {threshold})"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="demo-digit runs per code version")
    parser.add_argument("--photo-runs", type=int, default=1, help="photo-set runs per code version")
    parser.add_argument("--ref", help="also run this git revision's code first, as the baseline")
    parser.add_argument("--ref-runs", type=int, help="demo-digit runs of the baseline (default: --runs)")
    parser.add_argument("--same-seed", action="store_true", help="every run with the default seed (shows determinism), not seeds 1..N")
    parser.add_argument("--set", action="append", default=[], help="a setting for every run, NAME=VALUE (default: none, the defaults)")
    args = parser.parse_args()
    extra = [item for pair in args.set for item in ("--set", pair)]
    scratch = Path(tempfile.mkdtemp(prefix="imagelake-quality-"))
    try:
        digits, photos = scratch / "digits", scratch / "photos"
        from flows.demo_data import write_digits, write_photos

        write_digits(digits)  # what `make run` uses: 1,797 digits, 64 px PNGs
        write_photos(photos)  # 300 photos of 2 classes
        versions = [("this checkout", REPO)]
        if args.ref:
            worktree = scratch / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.ref], cwd=REPO, check=True, capture_output=True)
            versions.append((f"baseline {args.ref}", worktree))
        table = []
        try:
            for label, code in versions:
                print(f"{label}:", flush=True)
                count = args.runs if code == REPO or args.ref_runs is None else args.ref_runs
                if args.photo_runs:
                    table.append((f"{label} photos", runs("photos", code, photos, args.photo_runs, extra, scratch, args.same_seed)))
                table.append((f"{label} digits", runs("digits", code, digits, count, extra, scratch, args.same_seed)))
        finally:
            if args.ref:
                subprocess.run(["git", "worktree", "remove", "--force", str(scratch / "baseline")], cwd=REPO, capture_output=True)
        print()
        for name, results in table:
            print(spread(name, results, "test", 0.97 if "digits" in name else 0.95))
            print(spread(name, results, "wall"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
