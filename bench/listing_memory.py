"""Peak memory of listing one large source folder the way the ingest stage does, this code against an earlier checkout,
side by side.

    .venv/bin/python bench/listing_memory.py [--files 1000000] [--labels 10] [--keep DIR] [--against DIR] [--bound-mb
    300]

Creates FILES empty .jpg files in LABELS label folders (label<k>/<n>.jpg, FILES/LABELS a folder; --labels 1 puts them
all in one folder), then lists them into a staging folder with tasks/data/listing.py:save_listing (what the ingest
stage and its key call) in a fresh process per checkout: (a) the code under --against (an earlier checkout, e.g. a git
worktree of HEAD, imported as imagelake through bench/checkout.py), (b) this tree. Each prints its peak resident
memory above the process's own after its imports and a one-file listing (ru_maxrss; the first listing pages in some
45 MB of Arrow's and Parquet's code, whatever its size), in MB and in bytes per listed file, and its seconds; then (b)
over (a), whether both listings have one fingerprint, and whether (b) stays within --bound-mb (the exit status is 1
when it does not).

Creating the files is the slow part (about 10-30 s per million on a local disk): --keep DIR builds them there once
and re-uses them on the next run with the same --files and --labels; without it they go in a temp folder, removed after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import checkout  # bench/checkout.py: a checkout's code under the name imagelake
from figures import add_record_option, keep  # bench/figures.py

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import importlib, json, resource, sys, time
listing = importlib.import_module(sys.argv[1])  # the checkout's, first on PYTHONPATH (bench/checkout.py)
Scope = listing.Scope  # the listing's own (a checkout from before the rename imports it as tasks.rules.listing)
# a one-file listing: Arrow and Parquet's code paged in
listing.save_listing(listing.source_uri(sys.argv[4]), Scope((".jpg",)), sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
listed = listing.save_listing(listing.source_uri(sys.argv[2]), Scope((".jpg",)), sys.argv[3])
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"peak_kb": peak, "seconds": seconds, "files": listed.listed,
                  "fingerprint": listed.listing_fingerprint, "code": listing.__file__}))
"""


def build(source: Path, files: int, labels: int) -> float:
    """FILES empty files in LABELS folders, created with bare os.open/os.close (no Path objects: a million of them is
    the slow part). Returns the seconds it took."""
    started = time.perf_counter()
    folders = [str(source / f"label{k}") for k in range(labels)]
    for folder in folders:
        os.makedirs(folder, exist_ok=True)
    flags, close, create = os.O_CREAT | os.O_WRONLY, os.close, os.open
    for n in range(files):
        close(create(f"{folders[n % labels]}/{n:08d}.jpg", flags, 0o644))
    return time.perf_counter() - started


def source_in(work: Path, files: int, labels: int) -> Path:
    """The source folder under WORK, built unless WORK holds one of the same size and layout (its marker says so)."""
    source, marker = work / "src", work / "built.json"
    wanted = {"files": files, "labels": labels}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        print(f"re-using {files:,} files under {source}")
        return source
    shutil.rmtree(source, ignore_errors=True)
    marker.unlink(missing_ok=True)
    seconds = build(source, files, labels)
    marker.write_text(json.dumps(wanted))
    print(f"created {files:,} files in {seconds:.0f} s")
    return source


def measure(code: Path, source: Path, work: Path) -> dict:
    """List SOURCE with the save_listing of the checkout at CODE, in a fresh process, into a staging folder removed
    after."""
    # the listing's module now, then where it was before: tasks/listing.py, and earlier still the ingest stage's
    module = checkout.module_in(
        code, "imagelake.tasks.data.listing", "imagelake.tasks.listing", "imagelake.tasks.ingest"
    )
    staging, tiny = Path(tempfile.mkdtemp(prefix="staging-", dir=work)), work / "one-file"
    build(tiny, 1, 1)
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, module, str(source), str(staging), str(tiny)],
            capture_output=True,
            text=True,
            cwd=code,  # the first import path entry: another tree's tasks/ there would shadow an old checkout's
            env=checkout.environ(checkout.import_path(code)),
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if done.returncode:
        sys.exit(f"listing with the code at {code} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    checkout.verify(code, result["code"])
    return result


def report(name: str, code: Path, result: dict) -> None:
    peak = result["peak_kb"] * 1024
    print(
        f"  {name} {str(code)[-28:]:>28}  peak {peak / 1e6:6.0f} MB  {peak / result['files']:6.0f} bytes a "
        f"file  {result['seconds']:6.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument(
        "--labels", type=int, default=10, help="label folders the files are spread over (1: one folder of them all)"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="build the files here and keep them for the next run (else a temp folder, removed after)",
    )
    parser.add_argument(
        "--against",
        type=Path,
        help="an earlier checkout to measure first, e.g. `git worktree add /tmp/listing-old HEAD`",
    )
    parser.add_argument("--bound-mb", type=float, default=300.0, help="the peak this tree's listing must stay within")
    add_record_option(parser)
    args = parser.parse_args()

    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="listing-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        source = source_in(work, args.files, args.labels)
        print(
            f"{args.files:,} empty .jpg files in {args.labels} label folders ({args.files // args.labels:,} a folder), "
            "listed to staging by imagelake.tasks.data.listing.save_listing, each in a fresh process"
        )
        results = {}
        for name, code in (("(a)", args.against), ("(b)", REPO)):
            if code is not None:
                results[name] = measure(code.resolve(), source, work)
                report(name, code.resolve(), results[name])
        now = results["(b)"]
        if "(a)" in results:
            old = results["(a)"]
            same = "yes" if old["fingerprint"] == now["fingerprint"] else "NO"
            print(
                f"  (b) / (a): peak {now['peak_kb'] / old['peak_kb']:.2f}, seconds "
                f"{now['seconds'] / old['seconds']:.2f}; same fingerprint: {same}"
            )
        within = now["peak_kb"] * 1024 <= args.bound_mb * 1e6
        keep(
            args,
            "listing_memory",
            f"the listing's peak memory over {args.files:,} files in {args.labels} folders",
            {
                "peak_mb": round(now["peak_kb"] * 1024 / 1e6),
                "bytes_per_file": round(now["peak_kb"] * 1024 / now["files"]),
                "seconds": round(now["seconds"], 1),
            },
        )
        print(f"  (b) within {args.bound_mb:.0f} MB: {'yes' if within else 'NO'}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if not within or ("(a)" in results and results["(a)"]["fingerprint"] != now["fingerprint"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
