"""Where a command's CPU goes: every process it starts, counted and timed by kind.

    .venv/bin/python bench/suite_processes.py [--json FILE] [--every 0.3] -- COMMAND ...
    .venv/bin/python bench/suite_processes.py --report FILE

Runs COMMAND (e.g. `.venv/bin/python -m pytest -n 2 -m "not alone"`) and reads /proc every EVERY seconds. A process
counts when its parent is one already counted or its environment carries this census's mark (which COMMAND's
environment holds, so a Ray worker started by a raylet or a flow run started by a Prefect worker counts too); others
on the machine do not. Each process's CPU (user + system) is the last reading before it ended, so a process that
lives less than EVERY seconds may be missed or short: the figures are a floor. Each is put in a kind by its command
line (the last one seen: a process that exec()s, as spark-submit's script becomes Spark's JVM, is what it became):

  spark-jvm, s3proxy-jvm, other-jvm       Java
  ray:<actor or part>                     Ray's head (gcs, raylet, agents) and its workers by the actor they hold
  prefect-server, prefect-worker, prefect-flow-run, mlflow-server, postgres, chromium
  imagelake-cli, pytest, pyspark-daemon, loader-process (multiprocessing's spawn), python-other

Printed: wall time, CPU of all counted processes, and per kind the CPU seconds, how many processes and the CPU of the
median one (a Ray Train worker's median is mostly its imports). --json keeps every process (pid, first seen, CPU,
kind, command line) for another reading with --report.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

MARK = "IMAGELAKE_CENSUS"
TICKS = os.sysconf("SC_CLK_TCK")


def read_processes() -> dict[tuple[int, int], tuple[float, int, str]]:
    """(pid, start tick) -> (CPU seconds, parent pid, command line) of every process readable now."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                text = stat.read()
            fields = text[text.rindex(")") + 2 :].split()
            with open(f"/proc/{name}/cmdline", "rb") as raw:
                command = raw.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue  # ended between the listing and the read
        cpu = (int(fields[11]) + int(fields[12])) / TICKS
        found[(int(name), int(fields[19]))] = (cpu, int(fields[1]), command)
    return found


def carries_mark(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return mark in environ.read().split(b"\0")
    except OSError:
        return False


def kind(command: str) -> str:
    words = command.split()
    program = os.path.basename(words[0]) if words else ""
    if program == "java":
        if "s3proxy" in command:
            return "s3proxy-jvm"
        return "spark-jvm" if "pyspark" in command or "spark" in command else "other-jvm"
    if command.startswith("ray::"):
        return "ray:" + words[0][5:].split("(")[0].split(".")[0]
    if "/ray/" in command:
        for part in ("gcs_server", "raylet", "dashboard/agent.py", "dashboard.py", "log_monitor", "monitor.py"):
            if part in command:
                return "ray:" + part.rsplit("/", 1)[-1]
        if "runtime_env" in command:
            return "ray:runtime_env_agent"
        if "default_worker.py" in command or "setup_worker.py" in command:
            return "ray:worker(starting)"
        return "ray:other"
    rules = (
        ("deploy.SparkSubmit", "spark-jvm"),  # spark-submit's script, read before it exec()ed the JVM
        ("bin/spark-submit", "spark-jvm"),
        ("bin/imagelake ", "imagelake-cli"),
        ("-m imagelake", "imagelake-cli"),
        ("prefect.server.api.server", "prefect-server"),
        ("prefect server start", "prefect-server"),
        ("prefect worker start", "prefect-worker"),
        ("prefect.engine", "prefect-flow-run"),
        ("prefect.runner", "prefect-flow-run"),
        ("mlflow", "mlflow-server"),
        ("postgres", "postgres"),
        ("chrom", "chromium"),
        ("pytest", "pytest"),
        ("exec(eval(sys.stdin.readline()))", "pytest"),  # an xdist worker
        ("pyspark.daemon", "pyspark-daemon"),
        ("pyspark.worker", "pyspark-daemon"),
        ("multiprocessing.spawn", "loader-process"),
        ("tests.", "test-helper"),
    )
    for needle, name in rules:
        if needle in command:
            return name
    if "python" in program:
        return "python-other"
    return "other:" + program


def census(argv: list[str], every: float) -> tuple[float, list[dict], int]:
    before = set(read_processes())
    token = f"{os.getpid()}-{time.time_ns()}"
    mark = f"{MARK}={token}".encode()
    started = time.monotonic()
    child = subprocess.Popen(argv, env={**os.environ, MARK: token})
    counted: dict[tuple[int, int], dict] = {}
    ours = {child.pid}
    while True:
        ended = child.poll() is not None
        for key, (cpu, parent, command) in read_processes().items():
            if key in before:
                continue
            seen = counted.get(key)
            if seen is None:
                if not (parent in ours or carries_mark(key[0], mark)):
                    continue
                ours.add(key[0])
                seen = counted[key] = {"pid": key[0], "first_seen_s": round(time.monotonic() - started, 1)}
            seen["cpu_s"] = cpu
            if command:  # a zombie's is empty: keep the last one it had
                seen["command"] = command[:400]
        if ended:
            break
        time.sleep(every)
    for process in counted.values():
        process["kind"] = kind(process.get("command", ""))
    return time.monotonic() - started, list(counted.values()), child.returncode


def report(wall: float, processes: list[dict]) -> None:
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for process in processes:
        by_kind[process["kind"]].append(process.get("cpu_s", 0.0))
    total = sum(sum(cpus) for cpus in by_kind.values())
    print(f"wall {wall:.0f} s; CPU of {len(processes)} processes {total:.0f} s ({total / max(wall, 1):.2f} cores busy)")
    print(f"{'CPU s':>9} {'share':>6} {'count':>6} {'median s':>9}  kind")
    for name, cpus in sorted(by_kind.items(), key=lambda item: -sum(item[1])):
        spent = sum(cpus)
        print(f"{spent:9.0f} {spent / max(total, 1e-9):6.1%} {len(cpus):6d} {statistics.median(cpus):9.1f}  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="keep every process's figures in this file")
    parser.add_argument("--every", type=float, default=0.3, help="seconds between readings of /proc")
    parser.add_argument("--report", help="print the report of a file written by --json, and run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.report:
        kept = json.loads(open(args.report).read())
        for process in kept["processes"]:  # kinds as this version reads them
            process["kind"] = kind(process.get("command", ""))
        report(kept["wall_s"], kept["processes"])
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, or --report FILE")
    wall, processes, code = census(command, args.every)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": command, "wall_s": round(wall, 1), "processes": processes}, out)
    report(wall, processes)
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the report was piped into a reader that stopped early (`| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit must not fail
        sys.exit(1)
