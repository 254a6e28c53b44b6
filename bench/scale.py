"""What a growing lake costs: a cold run, a re-run with nothing new, and a run with 1% new files, side by side.

    .venv/bin/python bench/scale.py [--files 40000] [--new 0.01] [--keep DIR]

Builds FILES small JPEGs (96-200 px, 10 labels), then runs `imagelake run` three times on one workspace
(image_size 32, 1 epoch): cold, again with nothing changed (the first re-run after a write), and after adding
NEW x FILES new images. Each run is its own process, as a scheduled run is. Per stage, the seconds the run
reports itself (`stage_seconds`); Spark's start-up (which falls inside the first stage that needs Spark) is
taken out and reported apart. The data stages are ingest to cache; the ratios are each run's data-stage
seconds over the cold run's. Also: bytes the run added to the Petastorm cache, and the Python driver's peak RSS.
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

import numpy as np
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


def run(source: Path, workspace: Path) -> dict:
    settings = [f"workspace={workspace}", "image_size=32", "max_epochs=1", "num_workers=1", "batch_size=64"]
    before = folder_bytes(workspace / "cache")
    started = time.perf_counter()
    done = subprocess.run(
        [IMAGELAKE, "run", "--source", str(source), "--json", *[a for s in settings for a in ("--set", s)]],
        capture_output=True, text=True, env={k: v for k, v in os.environ.items() if not k.startswith("IMAGELAKE_")},
    )
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"imagelake run failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    seconds = dict(summary["stage_seconds"])
    startup = summary.get("spark_startup_seconds") or 0.0
    # Spark starts in the first stage after ingest (which needs none) that ran rather than came from the cache.
    first = next((s for s in STAGES[1:] if s in seconds and s not in summary["cache_hits"]), None)
    if startup and first is not None:
        seconds[first] = max(0.0, seconds[first] - startup)
    return {
        "wall": wall,
        "seconds": seconds,
        "spark_startup": startup,
        "data": sum(seconds.get(s, 0.0) for s in DATA_STAGES),
        "cache_added": folder_bytes(workspace / "cache") - before,
        "rss_mb": summary.get("driver_peak_rss_mb"),
        "decoded": summary["files_decoded"],
        "hits": summary["cache_hits"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=40_000)
    parser.add_argument("--new", type=float, default=0.01)
    parser.add_argument("--keep", type=Path, help="work in this folder and leave it (default: a temp folder, removed)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="imagelake-scale-"))
    source, workspace = root / "source", root / "workspace"
    try:
        started = time.perf_counter()
        build(source, 0, args.files)
        print(f"built {args.files} JPEGs in {time.perf_counter() - started:.1f} s", flush=True)
        results = {}
        for name in ("cold", "no change", f"+{args.new:.0%}"):
            if name.startswith("+"):
                build(source, args.files, max(1, round(args.files * args.new)))
            results[name] = run(source, workspace)
            print(f"{name}: {results[name]['wall']:.1f} s, decoded {results[name]['decoded']}", flush=True)
        cold = results["cold"]
        print(f"\n{args.files} files, image_size 32, 1 epoch, {os.cpu_count()} cores; seconds per stage (Spark start-up apart)")
        print(f"{'run':<10} {'wall':>7} {'spark':>6} " + " ".join(f"{s:>8}" for s in STAGES) + f" {'data':>7} {'ratio':>6} {'cache +MB':>9} {'RSS MB':>7}")
        for name, r in results.items():
            cells = " ".join(f"{'hit' if s in r['hits'] else format(r['seconds'].get(s, 0.0), '.1f'):>8}" for s in STAGES)
            ratio = r["data"] / cold["data"] if cold["data"] else float("nan")
            print(
                f"{name:<10} {r['wall']:>7.1f} {r['spark_startup']:>6.1f} {cells} {r['data']:>7.2f} {ratio:>6.3f} "
                f"{r['cache_added'] / 1e6:>9.1f} {r['rss_mb'] or 0:>7.0f}"
            )
        grown = results[f"+{args.new:.0%}"]
        print(f"\ncache bytes added by the +{args.new:.0%} run / the first cache: {grown['cache_added'] / cold['cache_added']:.3f}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
