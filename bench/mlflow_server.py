"""An MLflow server as imagelake starts it (no job runner) against MLflow's default (a job runner and its Huey
consumers), side by side.

    .venv/bin/python bench/mlflow_server.py [--runs 3] [--hold 30]

Each run starts `mlflow server` on 127.0.0.1 with a SQLite store in a fresh folder and one worker, the two sides taken
in turn so that a busier minute falls on both. Three figures per side, each the median of RUNS (min and max beside
it): the seconds until /health answers, the processes the server runs HOLD seconds after that, and the CPU seconds
all of them used from the start until then. Then the ratio of imagelake's median to the default's.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil
from figures import add_record_option, keep  # bench/figures.py

from imagelake.infra.local.cluster import BIN, NO_MLFLOW_JOBS

SIDES = {"imagelake": NO_MLFLOW_JOBS, "default": {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true"}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def one_start(env: dict[str, str], hold: float) -> tuple[float, int, float]:
    """Seconds to /health, processes and CPU seconds after HOLD more seconds, of one server."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="mlflow-bench-") as root:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | env
        command = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        command += ["--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", f"{root}/a"]
        started = time.monotonic()
        server = subprocess.Popen(
            command, env=environ, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            while not answers(f"http://127.0.0.1:{port}/health"):
                if server.poll() is not None or time.monotonic() - started > 300:
                    sys.exit(f"the MLflow server on port {port} did not answer (exit code {server.poll()})")
                time.sleep(0.1)
            up = time.monotonic() - started
            time.sleep(hold)
            tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
            cpu = 0.0
            for process in tree:
                try:
                    times = process.cpu_times()
                    cpu += times.user + times.system + times.children_user + times.children_system
                except psutil.Error:
                    pass
            return up, len(tree), cpu
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hold", type=float, default=30.0, help="seconds after /health answers before counting")
    add_record_option(parser)
    args = parser.parse_args()
    figures: dict[str, list[tuple[float, int, float]]] = {side: [] for side in SIDES}
    for run in range(args.runs):
        for side, env in SIDES.items():
            figures[side].append(one_start(env, args.hold))
            up, count, cpu = figures[side][-1]
            print(f"run {run + 1} {side:9}  health {up:5.1f} s  {count:2d} processes  {cpu:5.1f} CPU s", flush=True)
    print(f"\n{'':9}  {'health s':>22}  {'processes':>10}  {'CPU s (start + ' + str(int(args.hold)) + ' s)':>26}")
    medians = {}
    for side, rows in figures.items():
        columns = list(zip(*rows, strict=True))
        medians[side] = [statistics.median(c) for c in columns]
        cells = [f"{statistics.median(c):6.1f} ({min(c):.1f}-{max(c):.1f})" for c in columns]
        print(f"{side:9}  {cells[0]:>22}  {medians[side][1]:>10.0f}  {cells[2]:>26}")
    ratios = [a / b for a, b in zip(medians["imagelake"], medians["default"], strict=True)]
    print(f"{'ratio':9}  {ratios[0]:>22.2f}  {ratios[1]:>10.2f}  {ratios[2]:>26.2f}   (imagelake / default)")
    keep(
        args,
        "mlflow_server",
        f"the MLflow server as imagelake starts it against MLflow's defaults (median of {args.runs})",
        {
            "health_s": round(medians["imagelake"][0], 1),
            "processes": round(medians["imagelake"][1]),
            "cpu_s": round(medians["imagelake"][2], 1),
            "health_of_default_ratio": round(ratios[0], 2),
            "cpu_of_default_ratio": round(ratios[2], 2),
        },
    )


if __name__ == "__main__":
    main()
