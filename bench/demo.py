"""The demo as `make run` runs it: cold runs in fresh workspaces, one per seed, then a warm run on the same data.

    .venv/bin/python bench/demo.py [--seeds 42 0 1 2] [--set NAME=VALUE ...] [--keep DIR]

Each cold run is `imagelake run --config infra/demo.yaml` on the demo digits (made once, as `make demo-data` makes
them) in a workspace and a Prefect home of its own, with no Prefect API set: as a user's first `make run`, Spark's and
Ray's start-up included. The seeds are by default the one `make run` trains with (infra/demo.yaml's, else the
settings' default, 42), then 0, 1 and 2: the first cold run is `make run` itself. `--set` overrides the demo's
settings (to try a candidate). Printed per run: wall seconds, test accuracy, the baseline's and the margin; then the
medians (min-max). Recorded: the median cold run, the warm run, the median and the lowest test accuracy and margin
over the seeds.
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

from figures import add_record_option, keep  # bench/figures.py: the figures as data in bench/results/

REPO = Path(__file__).resolve().parent.parent
CLI = "import sys; from imagelake.flows.cli import app; sys.argv[0] = 'imagelake'; app()"
CONFIG = REPO / "infra" / "demo.yaml"


def clean_env(prefect_home: Path) -> dict[str, str]:
    """This environment without a Prefect API or imagelake settings, with a fresh Prefect home: a user's first run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "IMAGELAKE_"))}
    return {**env, "PREFECT_HOME": str(prefect_home)}


def run(source: Path, workspace: Path, prefect_home: Path, overrides: list[str]) -> tuple[float, dict, str]:
    """One `imagelake run --json` of the demo: its wall seconds, its summary and its console."""
    command = [sys.executable, "-c", CLI, "run", "--source", str(source), "--config", str(CONFIG), "--json"]
    for setting in (f"workspace={workspace}", *overrides):
        command += ["--set", setting]
    prefect_home.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    done = subprocess.run(command, env=clean_env(prefect_home), cwd=REPO, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    console = done.stdout + done.stderr
    if done.returncode != 0:
        sys.exit(f"imagelake run failed ({done.returncode}) in {workspace}:\n{console[-4000:]}")
    return seconds, json.loads(done.stdout.strip().splitlines()[-1]), console


def spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def demo_seed() -> int:
    """The seed `make run` trains with: infra/demo.yaml's, else the settings' default."""
    from imagelake.infra.settings import load_settings

    return load_settings(CONFIG).seed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seeds", type=int, nargs="+", help="one cold run per seed (default: make run's own seed, then 0, 1 and 2)"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm run")
    parser.add_argument("--keep", type=Path, help="a folder for the data and workspaces (default: a temp folder)")
    add_record_option(parser)
    args = parser.parse_args()
    args.seeds = args.seeds or list(dict.fromkeys([demo_seed(), 0, 1, 2]))

    root = args.keep or Path(tempfile.mkdtemp(prefix="imagelake-demo-"))
    source = root / "demo-digits"
    if not source.exists():
        subprocess.run([sys.executable, "-c", CLI, "demo-data", str(source)], cwd=REPO, check=True, capture_output=True)
    cold: list[float] = []
    accuracy: list[float] = []
    margins: list[float] = []
    noisy: list[str] = []
    for seed in args.seeds:
        name = f"seed-{seed}-{'-'.join(args.overrides) or 'demo'}".replace("/", "_")
        workspace, home = root / name / "workspace", root / name / "prefect-home"
        shutil.rmtree(root / name, ignore_errors=True)
        seconds, summary, console = run(source, workspace, home, [*args.overrides, f"seed={seed}"])
        (root / name / "console.txt").write_text(console)
        baseline = summary.get("baseline_accuracy")
        cold.append(seconds)
        accuracy.append(summary["test_accuracy"])
        margins.append(summary["test_accuracy"] - baseline if baseline is not None else float("nan"))
        noisy += [line for line in console.splitlines() if any(w in line for w in ("Traceback", "ERROR", "WARN"))]
        print(
            f"seed {seed}: cold {seconds:.1f} s, test accuracy {summary['test_accuracy']:.4f}, baseline "
            f"{baseline if baseline is None else round(baseline, 4)}, margin {margins[-1]:+.4f}, epochs "
            f"{summary.get('epochs_run')}",
            flush=True,
        )
    warm = None
    if not args.no_warm:
        warm, _, _ = run(source, workspace, home, [*args.overrides, f"seed={args.seeds[-1]}"])
        print(f"warm run (seed {args.seeds[-1]}, unchanged data): {warm:.1f} s")
    print(f"\nsettings: {CONFIG.relative_to(REPO)} {' '.join(args.overrides)}")
    print(f"cold run s      {spread(cold, 1)}")
    print(f"test accuracy   {spread(accuracy, 4)}")
    print(f"margin          {spread(margins, 4)}")
    print(f"console lines with Traceback, ERROR or WARN: {len(noisy)}" + "".join(f"\n  {line}" for line in noisy[:5]))
    figures = {
        "cold_run_s": round(statistics.median(cold), 1),
        "test_accuracy": round(statistics.median(accuracy), 4),
        "lowest_test_accuracy": round(min(accuracy), 4),
        "margin_over_baseline": round(statistics.median(margins), 4),
        "lowest_margin": round(min(margins), 4),
        "noisy_console_lines": len(noisy),
    }
    if warm is not None:
        figures["warm_run_s"] = round(warm, 1)
    keep(
        args,
        "demo",
        f"make run on the demo digits: cold runs in fresh workspaces (median of {len(args.seeds)} seeds), then a "
        "warm one on the same data",
        figures,
        note=f"overrides: {' '.join(args.overrides)}" if args.overrides else "",
    )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
