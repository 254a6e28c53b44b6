"""What a warm start buys: a full retrain and a warm-started fine-tune on the same grown data, from the same champion.

    .venv/bin/python bench/warm_start.py [--warm-epochs 2] [--keep DIR] [--set NAME=VALUE ...]

Writes the demo digits (1,797 PNGs) and splits them into two halves by a stable hash of the file name (each half
has every label). Run 1: `imagelake run` on half A, from scratch; its model becomes the champion. Then half B is
added to the source, and the workspace is copied twice, so both next runs start from the same table and champion:
(a) a full retrain from scratch (the settings' max_epochs), (b) `warm_start=true` with --warm-epochs epochs.
Each run is its own process, as a scheduled run is. Printed: each run's test accuracy (the candidate's, on the same
test split), its epochs, the seconds Lightning's fit took (`fit_seconds`: the training itself) and the train stage's
seconds as the run reports them (`stage_seconds`: Ray's start-up included), then warm minus full accuracy and warm
over full seconds of both.

The copies share run 1's folder for what MLflow records by absolute path (run 1's artifacts, the champion's model
among them): it stays in place, read only, until the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from figures import add_record_option, keep  # noqa: E402 - bench/figures.py

from imagelake.flows.demo_data import write_digits  # noqa: E402

IMAGELAKE = str(Path(sys.executable).with_name("imagelake"))


def half_of(name: str) -> str:
    """A or B, by a stable hash of the file name: the same split on every machine and run."""
    return "AB"[hashlib.sha256(name.encode()).digest()[0] % 2]


def split_halves(digits: Path, halves: Path) -> dict[str, dict[str, int]]:
    """Copy DIGITS/<label>/<file> to HALVES/<A|B>/<label>/<file>; return the images per half and label."""
    counts: dict[str, dict[str, int]] = {"A": {}, "B": {}}
    for png in sorted(digits.glob("*/*.png")):
        half, label = half_of(png.name), png.parent.name
        target = halves / half / label
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, target / png.name)
        counts[half][label] = counts[half].get(label, 0) + 1
    labels = {png.parent.name for png in digits.glob("*/*.png")}
    missing = {half: sorted(labels - set(found)) for half, found in counts.items() if labels - set(found)}
    if missing:
        sys.exit(f"a half lacks labels {missing}: the hash split must give both halves every label")
    return counts


def add_half(half: Path, source: Path) -> None:
    shutil.copytree(half, source, dirs_exist_ok=True)


def run(source: Path, workspace: Path, settings: list[str]) -> dict:
    """One `imagelake run` in its own process; its --json summary, with the wall time."""
    started = time.perf_counter()
    done = subprocess.run(
        [
            IMAGELAKE,
            "run",
            "--source",
            str(source),
            "--json",
            *[a for s in [f"workspace={workspace}", *settings] for a in ("--set", s)],
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("IMAGELAKE_")},
    )
    if done.returncode:
        sys.exit(f"imagelake run failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    summary["wall"] = time.perf_counter() - started
    return summary


def row(name: str, summary: dict) -> str:
    return (
        f"{name:<22} {summary['test_accuracy']:>8.4f} {summary['epochs_run']:>6} "
        f"{summary['fit_seconds']:>7.1f} {summary['stage_seconds']['train']:>9.1f} "
        f"{summary['wall']:>7.1f}  {summary['warm_started_from']:>9}  v{summary['model_version']} -> "
        f"{summary['model_alias']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-epochs", type=int, default=2, help="max_epochs of the warm-started run (default 2)")
    parser.add_argument("--keep", type=Path, help="work in this folder and leave it (default: a temp folder, removed)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE", help="a setting for every run"
    )
    add_record_option(parser)
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="imagelake-warm-"))
    source = root / "source"
    try:
        write_digits(root / "digits", size=64)
        counts = split_halves(root / "digits", root / "halves")
        print(
            f"halves: A {sum(counts['A'].values())} images, B {sum(counts['B'].values())} images, 10 labels each",
            flush=True,
        )
        add_half(root / "halves" / "A", source)
        first = run(source, root / "ws-1", args.overrides)
        print(row("1: half A, scratch", first), flush=True)
        add_half(root / "halves" / "B", source)
        for name in ("full", "warm"):
            shutil.copytree(root / "ws-1", root / f"ws-{name}")
        full = run(source, root / "ws-full", args.overrides)
        warm = run(source, root / "ws-warm", [*args.overrides, "warm_start=true", f"max_epochs={args.warm_epochs}"])
        if warm["warm_started_from"] != first["model_version"]:
            sys.exit(
                f"the warm run did not start from the champion v{first['model_version']}: warm_started_from "
                f"{warm['warm_started_from']}"
            )
        settings = ", ".join(args.overrides) or "default settings"
        print(
            f"\ndemo digits, {settings}, {os.cpu_count()} cores; fit = Lightning's fit on rank 0; train = "
            "the train stage (Ray start-up included)"
        )
        print(
            f"{'run':<22} {'test acc':>8} {'epochs':>6} {'fit s':>7} {'train s':>9} {'wall s':>7}  "
            f"{'warm from':>9}  model"
        )
        print(row("1: half A, scratch", first))
        print(row("2a: A+B, full retrain", full))
        print(row("2b: A+B, warm start", warm))
        print(
            f"\nwarm - full test accuracy: {warm['test_accuracy'] - full['test_accuracy']:+.4f}; "
            f"warm / full fit seconds: {warm['fit_seconds'] / full['fit_seconds']:.3f}; "
            f"warm / full train stage seconds: {warm['stage_seconds']['train'] / full['stage_seconds']['train']:.3f} "
            f"({warm['epochs_run']} vs {full['epochs_run']} epochs)"
        )
        keep(
            args,
            "warm_start",
            "the demo's digits grown from half to all: a warm start from the champion against a full retrain",
            {
                "full_test_accuracy": round(full["test_accuracy"], 4),
                "warm_test_accuracy": round(warm["test_accuracy"], 4),
                "warm_of_full_fit_ratio": round(warm["fit_seconds"] / full["fit_seconds"], 3),
                "warm_of_full_train_stage_ratio": round(
                    warm["stage_seconds"]["train"] / full["stage_seconds"]["train"], 3
                ),
            },
            note=f"settings: {settings}",
        )
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
