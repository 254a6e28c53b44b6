"""What a pytest process of the suite pays a minute for what it holds while no test uses it.

    .venv/bin/python bench/idle_cost.py [--parts spark,ray,prefect] [--seconds 60]

Starts, in this process and with the suite's own environment (tests/conftest.py), what a pytest process starts for the
whole session: the S3 server and Spark's session (`spark`: a Delta table written and read first), a local Ray sized as
the suite's (`ray`) and Prefect's test server (`prefect`: one flow run first). It then waits 20 s and counts the CPU
seconds that this process and every process under it (the JVMs, Ray's head and workers, the server) use over SECONDS
of doing nothing, printed per process as CPU seconds a minute, largest first, and in all.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil
from figures import add_record_option, keep  # bench/figures.py

REPO = Path(__file__).resolve().parent.parent
SETTLE_SECONDS = 20.0  # what was just started finishes its own start-up before the count begins


def start(parts: set[str], folder: Path, stack: contextlib.ExitStack) -> None:
    """Start what PARTS name, as the suite's fixtures do; STACK stops them."""
    sys.path.insert(0, str(REPO))
    # The suite's environment (JVM flags, Spark SQL settings, Prefect's) and its session fixtures' starts.
    from tests.conftest import session_prefect, start_session_ray, start_session_spark

    if "spark" in parts:
        from tests.s3 import S3Server

        server = S3Server(folder / "s3").start()
        stack.callback(server.stop)
        os.environ.update(server.env)
        session = start_session_spark(folder / "ws")
        stack.callback(session.stop)
        session.range(100).write.format("delta").save(str(folder / "table"))
        session.read.format("delta").load(str(folder / "table")).count()
    if "ray" in parts:
        import ray

        start_session_ray()
        stack.callback(ray.shutdown)
    if "prefect" in parts:
        from prefect import flow

        stack.enter_context(session_prefect())

        @flow
        def one() -> int:
            return 1

        one()


def cpu_by_process() -> collections.Counter[str]:
    """CPU seconds so far of this process and every process under it, by command line."""
    found: collections.Counter[str] = collections.Counter()
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
            found[" ".join(process.cmdline()[:3])[:100]] += times.user + times.system
        except psutil.Error:
            continue
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="spark,ray,prefect", help="any of spark, ray, prefect, comma-separated")
    parser.add_argument("--seconds", type=float, default=60.0)
    add_record_option(parser)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"spark", "ray", "prefect"}
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; name any of spark, ray, prefect")
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="idle-cost-")))  # removed last
        start(parts, folder, stack)
        time.sleep(SETTLE_SECONDS)
        before = cpu_by_process()
        time.sleep(args.seconds)
        after = cpu_by_process()
    minutes = args.seconds / 60
    used = {name: (after[name] - before.get(name, 0.0)) / minutes for name in after}
    print(f"{args.parts}: CPU seconds a minute over {args.seconds:.0f} s of doing nothing")
    for name, rate in sorted(used.items(), key=lambda item: -item[1]):
        if rate >= 0.05:
            print(f"  {rate:6.2f}  {name}")
    print(f"  {sum(used.values()):6.2f}  in all")
    keep(
        args,
        "idle_cost",
        f"CPU seconds a minute that {args.parts} take while doing nothing",
        {"cpu_s_per_min": round(sum(used.values()), 2)},
        note=f"parts {args.parts}",
    )


if __name__ == "__main__":
    main()
