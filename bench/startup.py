"""What a flow run pays before it works, this tree against another checkout, side by side.

    .venv/bin/python bench/startup.py [--against DIR] [--runs 3] [--keep DIR]

Three figures per checkout, each the median of RUNS fresh processes (min and max beside it), the checkouts taken in
turn so that a busier minute falls on both:
  import    `python -c "import imagelake.flows.pipeline"`: what every deployment's flow run and `imagelake run` import
            first; and which of torch, torchvision, pytorch_lightning, ray, mlflow and matplotlib it loaded;
  help      `imagelake --help`;
  rerun     `imagelake run` on a source whose every stage's result is stored (unchanged data, the default model:
            MobileNetV2 from its ImageNet weights), with Prefect's temporary server as a user without one gets;
  history   `imagelake history` of the model that run registered (a registry command: no flow, no server).
With --cluster, a fourth:
  cluster   `make cluster-up`'s start of the local cluster (Spark, two Ray nodes, PostgreSQL, MLflow and Prefect
            servers, each waited for until it answers), in a fresh folder; stopped again after each start (not counted).
Before the reruns each checkout makes its stored results with one run of its own (not counted; 32 px, one epoch).
Then the ratio of this tree's median to the other's. DIR: e.g. `git worktree add /tmp/old COMMIT`, imported as
imagelake through bench/checkout.py (the installed packages are this tree's).
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
from figures import record  # bench/figures.py: the figures as data in bench/results/

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "torchvision", "pytorch_lightning", "ray", "mlflow", "matplotlib")
IMPORT = (
    "import json, sys\n"
    "import imagelake.flows.pipeline as p\n"
    f"print(json.dumps({{'loaded': [m for m in {HEAVY!r} if m in sys.modules], 'file': p.__file__}}))\n"
)
CLUSTER = (
    "import json, os, sys, tempfile, time\n"
    "from pathlib import Path\n"
    "from imagelake.infra.local import cluster\n"
    "root = Path(tempfile.mkdtemp(prefix='imagelake-cluster-')); os.chmod(root, 0o711)\n"
    "started = time.perf_counter(); cluster.up(root, cluster.Ports.free()); seconds = time.perf_counter() - started\n"
    "cluster.down(root)\n"
    "print(json.dumps({'up': seconds, 'file': cluster.__file__}))\n"
)
CLI = "import sys; from imagelake.flows.cli import app; sys.argv[0] = 'imagelake'; app()"
MODEL = "startup-digits"
RUN_SETTINGS = ("image_size=32", "max_epochs=1", "num_workers=1", "batch_size=16", f"model_name={MODEL}")


def timed(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} failed in {cwd}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return seconds, done.stdout


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without a Prefect API (a temporary server, as for a user without one) or a model override."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "IMAGELAKE_"))}
    return {**env, **extra}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another checkout (a git worktree), run side by side")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cluster", action="store_true", help="also time the local cluster's start")
    parser.add_argument("--keep", type=Path, help="a folder for the sources and workspaces (default: a temp folder)")
    parser.add_argument("--no-record", action="store_true", help="print the figures without recording them")
    args = parser.parse_args()

    root = args.keep or Path(tempfile.mkdtemp(prefix="imagelake-startup-"))
    trees = {"this tree": REPO}
    if args.against:
        trees = {"against": args.against.resolve(), **trees}
    envs = {name: clean_env({}) for name in trees}
    if args.against:
        envs["against"] = checkout.environ(checkout.import_path(trees["against"]), envs["against"])
    source = root / "source"
    if not source.exists():
        subprocess.run(
            [sys.executable, "-c", CLI, "demo-data", str(source), "--size", "32", "--per-label", "8"],
            env=envs["this tree"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
    run = {
        name: [sys.executable, "-c", CLI, "run", "--source", str(source)]
        + [
            arg
            for setting in (*RUN_SETTINGS, f"workspace={root / name.replace(' ', '-')}")
            for arg in ("--set", setting)
        ]
        for name in trees
    }
    history = {
        name: [
            sys.executable,
            "-c",
            CLI,
            "history",
            "--model",
            MODEL,
            "--set",
            f"workspace={root / name.replace(' ', '-')}",
        ]
        for name in trees
    }
    for name, path in trees.items():  # each checkout's stored results, made once
        seconds, _ = timed(run[name], envs[name], path)
        print(f"{name}: first run (makes the stored results where missing) {seconds:.1f} s", flush=True)

    measures = ["import", "help", "rerun", "history", *(["cluster"] if args.cluster else [])]
    figures: dict[str, dict[str, list[float]]] = {name: {m: [] for m in measures} for name in trees}
    loaded: dict[str, list[str]] = {}
    for _ in range(args.runs):
        for name, path in trees.items():
            seconds, out = timed([sys.executable, "-c", IMPORT], envs[name], path)
            facts = json.loads(out.strip().splitlines()[-1])
            if not os.path.realpath(facts["file"]).startswith(str(path)):
                sys.exit(f"{name}: imported {facts['file']}, not the checkout's code")
            figures[name]["import"].append(seconds)
            loaded[name] = facts["loaded"]
            figures[name]["help"].append(timed([sys.executable, "-c", CLI, "--help"], envs[name], path)[0])
            figures[name]["rerun"].append(timed(run[name], envs[name], path)[0])
            figures[name]["history"].append(timed(history[name], envs[name], path)[0])
            if args.cluster:
                out = timed([sys.executable, "-c", CLUSTER], envs[name], path)[1]
                facts = json.loads(out.strip().splitlines()[-1])
                if not os.path.realpath(facts["file"]).startswith(str(path)):
                    sys.exit(f"{name}: started the cluster of {facts['file']}, not the checkout's")
                figures[name]["cluster"].append(facts["up"])

    names = list(trees)
    print(
        f"\n{'seconds (median, min-max)':30}"
        + "".join(f"{name:>24}" for name in names)
        + ("   ratio" * (len(names) > 1))
    )
    for measure in measures:
        cells = []
        for name in names:
            values = figures[name][measure]
            cells.append(f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})")
        medians = {name: statistics.median(figures[name][measure]) for name in names}
        ratio = f"   {medians['this tree'] / medians['against']:.2f}" if len(names) > 1 else ""
        print(f"{measure:30}" + "".join(f"{cell:>24}" for cell in cells) + ratio)
    for name in names:
        print(f"{name}: import loaded {', '.join(loaded[name]) or 'none of ' + ', '.join(HEAVY)}")
    if not args.no_record:
        names_of = {"import": "import_pipeline_s", "help": "help_s", "rerun": "unchanged_run_s", "history": "history_s"}
        mine = {names_of.get(m, f"{m}_start_s"): round(statistics.median(figures["this tree"][m]), 2) for m in measures}
        against = {m: round(statistics.median(figures["against"][m]), 2) for m in measures} if args.against else None
        record(
            "startup",
            f"what a flow run pays before it works, in fresh processes (median of {args.runs})",
            f".venv/bin/python bench/startup.py{' --against WORKTREE' if args.against else ''} --runs {args.runs}",
            mine,
            note=f"against {args.against.name}: {against}" if against else "",
        )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
