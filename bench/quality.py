"""Model quality on three data sets, each next to two plain baselines on the same split: `imagelake run` with the
default settings in fresh workspaces.

    .venv/bin/python bench/quality.py [--sets digits,photos,stamps] [--runs 3] [--first-seed 1] [--same-seed] [--ref
    GIT_REF] [--set NAME=VALUE ...]

Data sets:
- digits: the demo (`make run`'s): scikit-learn's 1,797 handwritten digits as 64 px PNGs, 10 labels;
- photos: random crops of scikit-learn's two sample photos (china, flower) as JPEGs of 300-1,600 px, 2 labels;
- stamps: Debian's tuxpaint-stamps-default (`make stamps` installs it), hand-made drawings filed by topic: the PNG
  and SVG files of every topic with at least 30 PNGs, labelled by topic. SVG files are vector drawings, not images
  imagelake reads: the run lists them (image_extensions gains .svg for this set) and quarantines them with a reason.

Each run is the CLI a user types, in a new workspace (new table, cache and MLflow store). Printed per run: the test
accuracy, the run's own baseline (logistic regression on 32 px thumbnails, fitted by the training stage), gradient
boosting on the same thumbnails of the same cached split (fitted here), the model's margin over the better of the two,
the epochs, the files quarantined and the wall time; then the median of each per data set. Run k uses seed=k
(--same-seed: the default seed every time). With --ref, the same runs are made with the code of that git revision (a
worktree, the same virtual environment, its code imported as imagelake through bench/checkout.py) first, as the
baseline side by side.
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

import checkout  # bench/checkout.py: a checkout's code under the name imagelake
from figures import add_record_option, invoked, record

REPO = Path(__file__).resolve().parent.parent
STAMPS = Path("/usr/share/tuxpaint/stamps")
MIN_PNGS = 30


def write_stamps(out: Path) -> int:
    """OUT/<topic>/<file>: the PNG and SVG stamps of every topic with at least MIN_PNGS PNGs (names made unique by
    their subfolders); returns how many files were copied."""
    copied = 0
    for topic in sorted(p for p in STAMPS.iterdir() if p.is_dir()):
        files = sorted(f for f in topic.rglob("*") if f.suffix.lower() in (".png", ".svg"))
        if sum(f.suffix.lower() == ".png" for f in files) < MIN_PNGS:
            continue
        (out / topic.name).mkdir(parents=True, exist_ok=True)
        for file in files:
            shutil.copyfile(file, out / topic.name / "-".join(file.relative_to(topic).parts))
            copied += 1
    return copied


def gradient_boosting(summary: dict) -> float:
    """Test accuracy of gradient boosting on 32 px thumbnails of the run's own cached train and test splits."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    from imagelake.tasks.registry.baseline import thumbnails

    cache = summary["cache_dir"].removeprefix("file://")
    split = {name: f"{cache}/{name}-v{summary['delta_version']}.json" for name in ("train", "test")}
    size, counts = summary["dataset_card"]["image_size"], summary["split_counts"]
    train_x, train_y = thumbnails(split["train"], size, counts["train"], 20_000, 0)
    test_x, test_y = thumbnails(split["test"], size, counts["test"], 20_000, 1)
    model = HistGradientBoostingClassifier(max_iter=200, random_state=0).fit(train_x, train_y)
    return float((model.predict(test_x) == test_y).mean())


def code_env(code: Path) -> dict[str, str]:
    """A run's environment: no IMAGELAKE_ settings of this shell, and the code under test first on the import path, as
    imagelake, ahead of the editable install (bench/checkout.py)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("IMAGELAKE_")}
    return checkout.environ(checkout.import_path(code), env)


def one_run(code: Path, source: Path, workspace: Path, extra: list[str]) -> dict:
    """One `imagelake run` in a fresh workspace: its summary's figures, the gradient boosting baseline and the wall
    time."""
    command = [
        sys.executable,
        "-m",
        "imagelake.flows.cli",
        "run",
        "--source",
        str(source),
        "--set",
        f"workspace={workspace}",
        "--json",
        *extra,
    ]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=code, env=code_env(code), capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"imagelake run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    try:
        boosted = gradient_boosting(summary)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    return {
        "test": summary["test_accuracy"],
        "lr": summary.get("baseline_accuracy"),
        "gb": boosted,
        "epochs": summary["epochs_run"],
        "wall": wall,
        "quarantined": summary.get("quarantined") or {},
    }


def line(name: str, index: int, seed: str, result: dict) -> str:
    floors = [value for value in (result["lr"], result["gb"]) if value is not None]
    lr = "   -  " if result["lr"] is None else f"{result['lr']:.3f}"
    quarantined = ", ".join(f"{reason} {count}" for reason, count in sorted(result["quarantined"].items())) or "none"
    return (
        f"  {name:7} run {index:2} ({seed}): test {result['test']:.3f}  logistic {lr}  boosting {result['gb']:.3f}  "
        f"margin {result['test'] - max(floors):+.3f}  {result['epochs']:3} epochs  {result['wall']:5.0f} s  "
        f"quarantined: {quarantined}"
    )


def median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results if r[key] is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="digits,photos,stamps", help="comma-separated: digits, photos, stamps")
    parser.add_argument("--runs", type=int, default=3, help="runs per data set and code version")
    parser.add_argument("--ref", help="also run this git revision's code first, as the baseline")
    parser.add_argument(
        "--same-seed", action="store_true", help="every run with the default seed (shows determinism), not seeds 1..N"
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=1,
        help="the first run's seed (runs use FIRST..FIRST+N-1), to extend an earlier series",
    )
    parser.add_argument(
        "--set", action="append", default=[], help="a setting for every run, NAME=VALUE (default: none, the defaults)"
    )
    add_record_option(parser)
    args = parser.parse_args()
    wanted = [name.strip() for name in args.sets.split(",") if name.strip()]
    if "stamps" in wanted and not STAMPS.is_dir():
        sys.exit(
            f"{STAMPS} is missing: `make stamps` installs Debian's tuxpaint-stamps-default (or leave stamps "
            "out of --sets)"
        )
    scratch = Path(tempfile.mkdtemp(prefix="imagelake-quality-"))
    try:
        from imagelake.flows.demo_data import write_digits, write_photos

        sources: dict[str, tuple[Path, list[str]]] = {}
        for name in wanted:
            folder = scratch / name
            count = {"digits": write_digits, "photos": write_photos, "stamps": write_stamps}[name](folder)
            extra = ["--set", 'image_extensions=[".png",".svg"]'] if name == "stamps" else []
            sources[name] = (folder, extra)
            print(f"{name}: {count} files in {folder}", flush=True)
        versions = [("this checkout", REPO)]
        if args.ref:
            worktree = scratch / "baseline-code"
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(worktree), args.ref],
                cwd=REPO,
                check=True,
                capture_output=True,
            )
            versions.insert(0, (f"baseline {args.ref}", worktree))
        table = []
        try:
            for _, code in versions:  # the module the runs start, from the code under test
                checkout.verify_module(code, code_env(code), "imagelake.flows.cli", cwd=code)
            for label, code in versions:
                print(f"{label}:", flush=True)
                for name, (folder, extra) in sources.items():
                    results = []
                    for index in range(args.first_seed, args.first_seed + args.runs):
                        seed = [] if args.same_seed else ["--set", f"seed={index}"]
                        settings = [*seed, *extra, *(item for pair in args.set for item in ("--set", pair))]
                        results.append(one_run(code, folder, scratch / f"{name}-{index}", settings))
                        print(
                            line(name, index, "default seed" if args.same_seed else f"seed {index}", results[-1]),
                            flush=True,
                        )
                    table.append((label, name, results))
        finally:
            if args.ref:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(scratch / "baseline-code")],
                    cwd=REPO,
                    capture_output=True,
                )
                checkout.forget(scratch / "baseline-code")
        print(
            "\n| code | data set | runs | test accuracy (median, min-max) | logistic regression | gradient "
            "boosting | margin over the better | wall s |"
        )
        print("|---|---|---:|---|---:|---:|---:|---:|")
        for label, name, results in table:
            tests = [r["test"] for r in results]
            lr, gb = median(results, "lr") if any(r["lr"] is not None for r in results) else None, median(results, "gb")
            better = max(value for value in (lr, gb) if value is not None)
            print(
                f"| {label} | {name} | {len(results)} | {statistics.median(tests):.3f} "
                f"({min(tests):.3f}-{max(tests):.3f}) | "
                f"{'-' if lr is None else f'{lr:.3f}'} | {gb:.3f} | {statistics.median(tests) - better:+.3f} "
                f"| {median(results, 'wall'):.0f} |"
            )
        if args.no_record or args.same_seed or args.set:
            print("no record: a trial, or settings other than the defaults (records hold the defaults' quality)")
            return
        for label, name, results in table:
            if label != "this checkout":
                continue
            tests = [r["test"] for r in results]
            lr = median(results, "lr") if any(r["lr"] is not None for r in results) else None
            gb = median(results, "gb")
            better = max(value for value in (lr, gb) if value is not None)
            record(
                f"quality_{name}",
                f"test accuracy of `imagelake run` with the defaults on {name}, {len(results)} seeds, beside two "
                "plain baselines on the same split",
                invoked(),
                {
                    "test_accuracy_median": round(statistics.median(tests), 3),
                    "test_accuracy_min": round(min(tests), 3),
                    "test_accuracy_max": round(max(tests), 3),
                    **({} if lr is None else {"logistic_regression": round(lr, 3)}),
                    "gradient_boosting": round(gb, 3),
                    "margin_over_better": round(statistics.median(tests) - better, 3),
                    "wall_s_median": round(median(results, "wall")),
                },
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
