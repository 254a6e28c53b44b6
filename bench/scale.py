"""What a growing lake costs: a cold run, a re-run with nothing new, and a run with 1% new files, side by side.

    .venv/bin/python bench/scale.py [--files 40000] [--new 0.01] [--keep DIR] [--code DIR]
    .venv/bin/python bench/scale.py --listing-only --files 1000000

Builds FILES small JPEGs (96-200 px, 10 labels), then runs `imagelake run` three times on one workspace
(image_size 32, 1 epoch): cold, again with nothing changed (the first re-run after a write), and after adding
NEW x FILES new images. Each run is its own process, as a scheduled run is. Per stage, the seconds the run
reports itself (`stage_seconds`). The data stages are ingest to cache; the ratio is each run's data-stage seconds
over the cold run's, Spark's start-up included where a data stage started Spark (the user waits for it: a run that
needs no Spark job starts none). Spark's start-up is also shown apart, with the stage it fell in, and the ratio
without it. Also: bytes the run added to the Petastorm cache, and the Python driver's peak RSS. --code runs the
pipeline from another checkout of imagelake (an older commit's, say) with this environment, to compare the two: its
flows/, tasks/ and infra/ imported as imagelake.flows, ... (bench/checkout.py), checked before the first run.

With --listing-only: FILES/10 and FILES empty files (date=/label folders of 1,000 to 2,000 files); in a fresh process
each, the listing streamed to staging, then the driver's diff of that listing with one holding NEW x more files;
seconds per 100,000 files, and the process's peak RSS after its imports, after the listing and after the diff, with
the growth over the imports per file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import checkout  # bench/checkout.py: a checkout's code under the name imagelake
import numpy as np
from figures import add_record_option, keep  # bench/figures.py
from PIL import Image

DATA_STAGES = ("ingest", "resize", "write", "split", "cache")
STAGES = (*DATA_STAGES, "train", "promote")
IMAGELAKE = str(Path(sys.executable).with_name("imagelake"))


def write_images(args: tuple[Path, int, int]) -> None:
    """COUNT JPEGs from START: a random gradient with a random box, 96-200 px a side, in one of 10 label folders."""
    out, start, count = args
    rng = np.random.default_rng(start)
    for index in range(start, start + count):
        width, height = (int(v) for v in rng.integers(96, 201, 2))
        base = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * rng.random(3, dtype=np.float32)
        pixels = np.broadcast_to(base, (height, width, 3)).copy()
        x, y = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        pixels[y : y + height // 3, x : x + width // 3] = rng.integers(0, 255, 3)
        folder = out / f"label{index % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{index:07d}.jpg", quality=85)


def build(out: Path, start: int, count: int) -> None:
    chunk = max(1, count // 16)
    jobs = [(out, first, min(chunk, start + count - first)) for first in range(start, start + count, chunk)]
    with multiprocessing.Pool(os.cpu_count() or 2) as pool:
        pool.map(write_images, jobs)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_env(code: Path | None) -> dict[str, str]:
    """The run's environment: no IMAGELAKE_ settings of this shell, and CODE (a checkout) first on the import path, as
    imagelake (bench/checkout.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMAGELAKE_")}
    return env if code is None else checkout.environ(checkout.import_path(code), env)


def reused(summary: dict) -> list[str]:
    """The stages whose stored result the run reused (`cache_hits` in the summary of a checkout before the rename)."""
    return summary["results_reused"] if "results_reused" in summary else summary["cache_hits"]


def started_in(summary: dict) -> str | None:
    """The stage whose seconds hold Spark's start-up. A run that says none started none; one from before the summary
    said which started it in the first stage after ingest (which needs none) that ran rather than reused its result."""
    if not summary.get("spark_startup_seconds"):
        return None
    if "spark_started_in" in summary:
        return summary["spark_started_in"]
    return next((s for s in STAGES[1:] if s in summary["stage_seconds"] and s not in reused(summary)), None)


def run(source: Path, workspace: Path, code: Path | None = None) -> dict:
    settings = [f"workspace={workspace}", "image_size=32", "max_epochs=1", "num_workers=1", "batch_size=64"]
    before = folder_bytes(workspace / "cache")
    started = time.perf_counter()
    done = subprocess.run(
        [IMAGELAKE, "run", "--source", str(source), "--json", *[a for s in settings for a in ("--set", s)]],
        capture_output=True,
        text=True,
        env=run_env(code),
        cwd=code,  # a checkout's run in it: its workers' first import path entry (see bench/checkout.py)
    )
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"imagelake run failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    seconds = dict(summary["stage_seconds"])
    startup = summary.get("spark_startup_seconds") or 0.0
    stage = started_in(summary)
    data = sum(seconds.get(s, 0.0) for s in DATA_STAGES)
    return {
        "wall": wall,
        "seconds": seconds,
        "spark_startup": startup,
        "spark_in": stage or "-",
        "data": data,  # Spark's start-up included where a data stage started it
        "data_ex_spark": data - (startup if stage in DATA_STAGES else 0.0),
        "cache_added": folder_bytes(workspace / "cache") - before,
        "rss_mb": summary.get("driver_peak_rss_mb"),
        "decoded": summary["files_decoded"],
        "hits": reused(summary),
    }


def write_empty(args: tuple[Path, int, int]) -> None:
    """COUNT empty .jpg files from START, in date=YYYY-MM-DD/label<K> folders (10,000 files a day, 10 labels; a day
    comes back after 28)."""
    out, start, count = args
    for index in range(start, start + count):
        folder = (
            out / f"date=2026-{1 + index // 300_000 % 12:02d}-{1 + index // 10_000 % 28:02d}" / f"label{index % 10}"
        )
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(folder / f"{index:08d}.jpg", os.O_CREAT | os.O_WRONLY, 0o644))


def build_empty(out: Path, start: int, count: int) -> None:
    chunk = 10_000  # one day's files: two processes never create the same folder's files
    jobs = [(out, first, min(chunk, start + count - first)) for first in range(start, start + count, chunk)]
    with multiprocessing.Pool(os.cpu_count() or 2) as pool:
        pool.map(write_empty, jobs)


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_listing(source: Path, staging: Path, new: float) -> None:
    """In its own process: list SOURCE into staging, add NEW x files, list again and diff the two listings in the
    driver (what a run does when the tables are in step with the first); print seconds and peak RSS as JSON."""
    from imagelake.tasks.data.changes import changes_between
    from imagelake.tasks.data.listing import save_listing, source_uri
    from imagelake.tasks.rules.listed_files import Scope

    scope, uri, out = Scope((".jpg",)), source_uri(str(source)), {"rss_after_imports": peak_rss_mb()}
    started = time.perf_counter()
    first = save_listing(uri, scope, str(staging))
    out.update(files=first.listed, listing_seconds=time.perf_counter() - started, rss_after_listing=peak_rss_mb())
    build_empty(source, first.listed, max(1, round(first.listed * new)))
    second = save_listing(uri, scope, str(staging))
    started = time.perf_counter()
    changes = changes_between(first.manifest_uri, second.manifest_uri, retire=True)
    out.update(diff_seconds=time.perf_counter() - started, changed=changes.num_rows, rss_after_diff=peak_rss_mb())
    print(json.dumps(out), flush=True)


def listing_scale(files: list[int], new: float, root: Path) -> None:
    """The listing part at each size in FILES (empty files): seconds per 100,000 files and the driver's peak RSS."""
    print(
        f"{'files':>10} {'list s':>7} {'s/100k':>7} {'diff s':>7} {'imports MB':>10} {'listed MB':>9} "
        f"{'diffed MB':>9} {'B/file listed':>13} {'B/file diffed':>13}"
    )
    for count in files:
        source, staging = root / f"empty-{count}", root / f"staging-{count}"
        build_empty(source, 0, count)
        done = subprocess.run(
            [sys.executable, __file__, "--measure-listing", str(source), str(staging), "--new", str(new)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            sys.exit(f"listing {count} files failed:\n{done.stderr[-3000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        base, listed, diffed = r["rss_after_imports"], r["rss_after_listing"], r["rss_after_diff"]
        print(
            f"{r['files']:>10} {r['listing_seconds']:>7.1f} {r['listing_seconds'] / r['files'] * 1e5:>7.2f} "
            f"{r['diff_seconds']:>7.2f} "
            f"{base:>10.0f} {listed:>9.0f} {diffed:>9.0f} {(listed - base) * 1e6 / r['files']:>13.0f} "
            f"{(diffed - base) * 1e6 / r['files']:>13.0f}",
            flush=True,
        )
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)


def print_table(results: dict[str, dict], files: int) -> None:
    """Seconds per stage (Spark's start-up inside the stage that started it), the data stages' sum and its ratio to the
    cold run's with the start-up (what the user waits for) and without it; the start-up and its stage apart."""
    cold = results["cold"]
    print(
        f"\n{files} files, image_size 32, 1 epoch, {os.cpu_count()} cores; seconds per stage, Spark's "
        "start-up inside the stage it fell in"
    )
    print(
        f"{'run':<10} {'wall':>7} {'spark':>6} {'in':>8} "
        + " ".join(f"{s:>8}" for s in STAGES)
        + f" {'data':>7} {'ratio':>6} {'ex-spark':>8} {'cache +MB':>9} {'RSS MB':>7}"
    )
    for name, r in results.items():
        cells = " ".join(f"{'hit' if s in r['hits'] else format(r['seconds'].get(s, 0.0), '.1f'):>8}" for s in STAGES)
        ratio = r["data"] / cold["data"] if cold["data"] else float("nan")
        bare = r["data_ex_spark"] / cold["data_ex_spark"] if cold["data_ex_spark"] else float("nan")
        print(
            f"{name:<10} {r['wall']:>7.1f} {r['spark_startup']:>6.1f} {r['spark_in']:>8} {cells} "
            f"{r['data']:>7.2f} {ratio:>6.3f} {bare:>8.3f} "
            f"{r['cache_added'] / 1e6:>9.1f} {r['rss_mb'] or 0:>7.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=40_000)
    parser.add_argument("--new", type=float, default=0.01)
    parser.add_argument("--keep", type=Path, help="work in this folder and leave it (default: a temp folder, removed)")
    parser.add_argument(
        "--code", type=Path, help="run the pipeline from this checkout of imagelake (default: the installed one)"
    )
    parser.add_argument(
        "--listing-only", action="store_true", help="only the listing part, on empty files, at FILES/10 and FILES"
    )
    parser.add_argument("--measure-listing", nargs=2, type=Path, metavar=("SOURCE", "STAGING"), help=argparse.SUPPRESS)
    add_record_option(parser)
    args = parser.parse_args()
    if args.measure_listing:
        return measure_listing(*args.measure_listing, args.new)
    if args.code is not None:  # `imagelake run` (its console script) imports imagelake.flows.cli: the checkout's
        checkout.verify_module(args.code, run_env(args.code), "imagelake.flows.cli", cwd=args.code)
    root = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="imagelake-scale-"))
    if args.listing_only:
        try:
            return listing_scale([max(1, args.files // 10), args.files], args.new, root)
        finally:
            if args.keep is None:
                shutil.rmtree(root, ignore_errors=True)
    source, workspace = root / "source", root / "workspace"
    try:
        started = time.perf_counter()
        build(source, 0, args.files)
        print(f"built {args.files} JPEGs in {time.perf_counter() - started:.1f} s", flush=True)
        results = {}
        for name in ("cold", "no change", f"+{args.new:.0%}"):
            if name.startswith("+"):
                build(source, args.files, max(1, round(args.files * args.new)))
            results[name] = run(source, workspace, args.code)
            print(f"{name}: {results[name]['wall']:.1f} s, decoded {results[name]['decoded']}", flush=True)
        print_table(results, args.files)
        cold, grown = results["cold"], results[f"+{args.new:.0%}"]
        print(
            f"\ncache bytes added by the +{args.new:.0%} run / the first cache: "
            f"{grown['cache_added'] / cold['cache_added']:.3f}"
        )
        unchanged = results["no change"]
        keep(
            args,
            "scale",
            f"runs over {args.files:,} files: the first, one with no change and one with {args.new:.0%} new files",
            {
                "cold_wall_s": round(cold["wall"], 1),
                "no_change_wall_s": round(unchanged["wall"], 1),
                "grown_wall_s": round(grown["wall"], 1),
                "grown_of_cold_data_ratio": round(grown["data"] / cold["data"], 3),
                "grown_of_first_cache_bytes_ratio": round(grown["cache_added"] / cold["cache_added"], 3),
            },
        )
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
