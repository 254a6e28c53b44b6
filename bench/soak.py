"""A soak: many consecutive small `imagelake run`s on a growing folder, against long-lived servers.

    .venv/bin/python bench/soak.py [--runs 50] [--start 300] [--growth 0.02] [--retention-hours 0.05] [--out
    bench/results/soak] [--keep DIR]

The servers of `make cluster-up` without Spark and Ray (infra/local/cluster.py, compute=False: PostgreSQL, the MLflow
server with basic authentication, the Prefect server) stay up throughout. The source starts with --start demo digits
(PNGs, every label) and gains --growth of its size in new digits before each run after the first. Each run is
`imagelake run ... --json` in its own process, as a scheduled run is (32 px, 1 epoch, one worker), with
workspace_retention_hours --retention-hours (3 minutes: the last few runs' staging, stage results and checkpoints).

After each run: its wall seconds; the disk used by the workspace's staging, stage results, cache, tables and
checkpoints, and by the servers' folder (PostgreSQL's data, MLflow's artifacts); and, summed over the servers'
processes, their resident memory, open files and number. Written: soak.csv (a row per run) and soak.png (run time,
disk, server memory by run) in --out, and printed: the 50th run's time over the 5th's, and each server figure's
growth from run 5 to the last.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
from figures import add_record_option, invoked, record  # noqa: E402 - bench/figures.py

from imagelake.flows.demo_data import write_digits  # noqa: E402
from imagelake.infra.local import cluster as servers  # noqa: E402

IMAGELAKE = str(Path(sys.executable).with_name("imagelake"))
SMALL = ("image_size=32", "max_epochs=1", "batch_size=16", "num_workers=1")
FOLDERS = ("staging", "prefect-results", "cache", "tables", "ray_results")


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def server_figures(root: Path) -> dict[str, float]:
    """Resident memory (MiB), open files and processes, summed over the servers' processes."""
    memory = files = count = 0
    for process in servers.running(root):
        try:
            memory += process.memory_info().rss
            files += process.num_fds()
            count += 1
        except psutil.Error:
            continue
    return {"server_rss_mib": round(memory / 2**20, 1), "server_open_files": files, "server_processes": count}


def grow(pool: list[Path], source: Path, used: int, target: int) -> int:
    """Copy pool files USED..TARGET into SOURCE (keeping the label folder); return the new count."""
    for path in pool[used:target]:
        (source / path.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, source / path.parent.name / path.name)
    return target


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], out: Path) -> None:
    from matplotlib.figure import Figure

    runs = [row["run"] for row in rows]
    figure = Figure(figsize=(12, 3.6))
    seconds, disk, memory = figure.subplots(1, 3)
    seconds.plot(runs, [row["seconds"] for row in rows], marker=".")
    seconds.set(title="run time", xlabel="run", ylabel="seconds")
    for name in (*FOLDERS, "servers"):
        disk.plot(runs, [row[f"{name}_mib"] for row in rows], label=name)
    disk.set(title="disk used", xlabel="run", ylabel="MiB")
    disk.legend(fontsize=7)
    memory.plot(runs, [row["server_rss_mib"] for row in rows], marker=".")
    memory.set(title="servers' resident memory", xlabel="run", ylabel="MiB")
    figure.tight_layout()
    figure.savefig(out, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--start", type=int, default=300)
    parser.add_argument("--growth", type=float, default=0.02)
    parser.add_argument(
        "--retention-hours",
        type=float,
        default=0.05,
        help="workspace_retention_hours of every run (default 0.05: 3 minutes)",
    )
    parser.add_argument("--database", choices=servers.DATABASES, default="postgres")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak")
    parser.add_argument("--keep", type=Path, help="keep the folders here (default: a temporary folder, removed)")
    add_record_option(parser)
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="imagelake-soak-"))
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o711)  # run by root, PostgreSQL runs as `postgres`, which must be able to enter its data folder
    args.out.mkdir(parents=True, exist_ok=True)
    write_digits(base / "pool")
    # Labels interleaved, so that every prefix of the pool holds every label.
    by_label = [sorted((base / "pool" / str(label)).glob("*.png")) for label in range(10)]
    pool = [paths[i] for i in range(max(map(len, by_label))) for paths in by_label if i < len(paths)]
    source, workspace, rows = base / "source", base / "workspace", []
    cluster = servers.up(base / "servers", servers.Ports.free(), database=args.database, compute=False)
    try:
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("IMAGELAKE_", "PREFECT_", "MLFLOW_"))
        }
        env.update(cluster.client_env(), PREFECT_HOME=str(base / "prefect-home"))
        used = grow(pool, source, 0, args.start)
        for run in range(1, args.runs + 1):
            if run > 1:
                used = grow(pool, source, used, min(len(pool), used + math.ceil(used * args.growth)))
            started = time.monotonic()
            done = subprocess.run(
                [
                    IMAGELAKE,
                    "run",
                    "--source",
                    str(source),
                    "--set",
                    f"workspace={workspace}",
                    *(part for pair in SMALL for part in ("--set", pair)),
                    "--set",
                    f"workspace_retention_hours={args.retention_hours}",
                    "--json",
                ],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                timeout=1800,
            )
            seconds = time.monotonic() - started
            if done.returncode != 0:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"run {run} exited {done.returncode}")
            summary = json.loads(done.stdout.strip().splitlines()[-1])
            row = {
                "run": run,
                "files": used,
                "seconds": round(seconds, 1),
                "decoded": summary.get("files_decoded"),
                **{f"{name}_mib": round(folder_bytes(workspace / name) / 2**20, 2) for name in FOLDERS},
                "servers_mib": round(folder_bytes(Path(cluster.root)) / 2**20, 2),
                **server_figures(Path(cluster.root)),
            }
            rows.append(row)
            print(
                json.dumps(
                    {
                        **row,
                        "removed_by_retention": summary.get("removed_by_retention"),
                        "stage_seconds": summary.get("stage_seconds"),
                    }
                ),
                flush=True,
            )
            write_csv(rows, args.out / "soak.csv")  # after every run: a soak stopped early keeps what it measured
    except KeyboardInterrupt:
        print(f"stopped after {len(rows)} runs", file=sys.stderr)
    finally:
        servers.down(Path(cluster.root))
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    if not rows:
        return 1
    plot(rows, args.out / "soak.png")
    fifth, last = rows[min(4, len(rows) - 1)], rows[-1]
    print(f"run {last['run']} / run {fifth['run']} time: {last['seconds'] / fifth['seconds']:.2f}")
    for name in ("server_rss_mib", "server_open_files", "server_processes"):
        print(f"{name}: run {fifth['run']} {fifth[name]}, run {last['run']} {last[name]}")
    if not args.no_record and last["run"] > fifth["run"]:
        runs = last["run"] - fifth["run"]
        growth = {
            f"{name}_growth_mib_per_run": round((last[f"{name}_mib"] - fifth[f"{name}_mib"]) / runs, 2)
            for name in [*FOLDERS, "servers"]
        }
        figures = {
            f"run_{fifth['run']}_s": fifth["seconds"],
            f"run_{last['run']}_s": last["seconds"],
            f"run_{last['run']}_of_run_{fifth['run']}_ratio": round(last["seconds"] / fifth["seconds"], 2),
            **growth,
            "servers_rss_growth_mib_per_run": round((last["server_rss_mib"] - fifth["server_rss_mib"]) / runs, 2),
        }
        what = f"{len(rows)} runs against long-lived servers ({args.database}): time, disk and memory"
        record("soak", what, invoked(), figures, note=f"every run's row in {args.out / 'soak.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
