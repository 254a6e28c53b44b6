"""The benchmarks' figures as data: each run appends a record to bench/results/<measure>.jsonl, and the table of the
latest figure of each measure in bench/README.md, with a plot of each measure's history, is rendered from them.

A record is one JSON line: what was measured, when, at which commit, on what machine, and its figures by name (the
unit in the name: `_s`, `_min`, `_mb`, `_ratio`, ...):

    {"measure": "startup", "what": "...", "command": "...", "when": "2026-12-05T13:00:00+00:00", "commit": "6744f08",
     "machine": {"cores": 2, "memory_gib": 24, "gpu": null}, "figures": {"import_pipeline_s": 1.46}, "note": "..."}

    .venv/bin/python bench/figures.py --write    # the table in bench/README.md and bench/results/plots/*.png
    .venv/bin/python bench/figures.py --check    # fails when the table differs from the records (make lint runs it)

Every bench script that measures calls `record(...)` (or `keep(args, ...)`) after it has printed its figures;
`--no-record` leaves the records as they are (a trial run). bench/checkout.py is a helper, and suite_durations.py and
suite_processes.py read or wrap another command's run: they print and record nothing (the suite's own record is
bench/suite.py's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
PLOTS = RESULTS / "plots"
README = BENCH / "README.md"
BEGIN, END = "<!-- generated: figures -->", "<!-- end generated -->"


def machine() -> dict[str, Any]:
    """This machine as a record names it: cores, memory and the GPU (None without one)."""
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    gpu = None
    try:
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        gpu = found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cores": os.cpu_count(), "memory_gib": round(pages * page_size / 2**30), "gpu": gpu}


def commit() -> str:
    """The repository's commit (short), with `+changes` when the work tree differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=BENCH, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=7", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def add_record_option(parser: argparse.ArgumentParser) -> None:
    """The `--no-record` option of a bench script: a trial run prints its figures and appends no record."""
    parser.add_argument("--no-record", action="store_true", help="print the figures only; append no record")


def invoked() -> str:
    """The command this bench script was started with, as a record gives it (an absolute path shown as PATH: it
    names a folder of the machine that ran it, not of the repository)."""
    shown = ["PATH" if argument.startswith("/") else argument for argument in sys.argv[1:]]
    return " ".join([".venv/bin/python", f"bench/{Path(sys.argv[0]).name}", *shown])


def keep(args: argparse.Namespace, measure: str, what: str, figures: dict[str, Any], note: str = "") -> None:
    """record(...) the figures of a bench script started with ARGS, as it was invoked, unless --no-record."""
    if not getattr(args, "no_record", False):
        record(measure, what, invoked(), figures, note)


def record(
    measure: str, what: str, command: str, figures: dict[str, float | int | str], note: str = "", **given: Any
) -> dict[str, Any]:
    """Append a record of MEASURE's FIGURES to bench/results/MEASURE.jsonl; GIVEN may set `when`, `commit` or
    `machine` (a record converted from an older run's notes)."""
    if not measure.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"measure {measure!r}: letters, digits, - and _ only (it names a file)")
    entry = {
        "measure": measure,
        "what": what,
        "command": command,
        "when": given.pop("when", None) or datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": given.pop("commit", None) or commit(),
        "machine": given.pop("machine", None) or machine(),
        "figures": figures,
        "note": note,
    }
    if given:
        raise TypeError(f"record() takes when, commit and machine besides its figures, not {sorted(given)}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{measure}.jsonl"
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(entry, sort_keys=True) + "\n")
    print(f"recorded in {path}")
    return entry


def records(folder: Path = RESULTS) -> dict[str, list[dict[str, Any]]]:
    """Every measure's records, oldest first (by `when`, then by their order in the file)."""
    found = {}
    for path in sorted(folder.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        found[path.stem] = sorted(lines, key=lambda entry: entry["when"])
    return found


def shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def machine_text(found: dict[str, Any]) -> str:
    text = f"{found.get('cores')} cores, {found.get('memory_gib')} GiB"
    return text + (f", {found['gpu']}" if found.get("gpu") else "")


def table(found: dict[str, list[dict[str, Any]]]) -> str:
    """The latest record of each measure as rows of a Markdown table, each figure a row, with its plot where the
    measure has a history."""
    rows = ["| measure | figure | latest | when, commit | machine | command |", "|---|---|---:|---|---|---|"]
    for measure, entries in found.items():
        latest = entries[-1]
        where = f"{latest['when'][:10]}, `{latest['commit']}`"
        for index, (name, value) in enumerate(latest["figures"].items()):
            first = index == 0
            rows.append(
                f"| {f'**{measure}**: ' + latest['what'] if first else ''} | `{name}` | {shown(value)} "
                f"| {where if first else ''} | {machine_text(latest['machine']) if first else ''} "
                f"| {'`' + latest['command'] + '`' if first and latest['command'] else ''} |"
            )
    plotted = [measure for measure, entries in found.items() if len(history(entries))]
    links = ", ".join(f"[{measure}](results/plots/{measure}.png)" for measure in plotted)
    return "\n".join([*rows, "", f"History, one point a record: {links}." if links else ""]).rstrip() + "\n"


def history(entries: list[dict[str, Any]]) -> dict[str, list[tuple[str, float]]]:
    """Each numeric figure that two records or more hold, as (commit, value) in the records' order."""
    series: dict[str, list[tuple[str, float]]] = {}
    for entry in entries:
        for name, value in entry["figures"].items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                series.setdefault(name, []).append((entry["commit"], float(value)))
    return {name: points for name, points in series.items() if len(points) >= 2}


def plot(measure: str, entries: list[dict[str, Any]], folder: Path = PLOTS) -> Path | None:
    """MEASURE's history, one panel a figure, as folder/MEASURE.png; None where no figure has two points."""
    series = history(entries)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(len(series), 1, figsize=(9, 2.4 * len(series)), squeeze=False)
    for axis, (name, points) in zip(axes[:, 0], series.items(), strict=True):
        axis.plot(range(len(points)), [value for _, value in points], marker="o")
        axis.set_title(name, fontsize=10)
        axis.set_xticks(range(len(points)), [label for label, _ in points], rotation=60, fontsize=7)
        axis.grid(alpha=0.3)
    figure.suptitle(f"{measure}: {entries[-1]['what']}", fontsize=11)
    figure.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{measure}.png"
    figure.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(figure)
    return path


def rendered(readme: str, found: dict[str, list[dict[str, Any]]]) -> str:
    if BEGIN not in readme or END not in readme.split(BEGIN, 1)[1]:
        raise SystemExit(f"{README}: no {BEGIN} ... {END} block to render the figures into")
    before, rest = readme.split(BEGIN, 1)
    return before + BEGIN + "\n" + table(found) + END + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="render the table into bench/README.md and the plots")
    action.add_argument("--check", action="store_true", help="fail when the table differs from the records")
    args = parser.parse_args(argv)
    found = records()
    readme = README.read_text(encoding="utf-8")
    fresh = rendered(readme, found)
    plotted = [measure for measure, entries in found.items() if history(entries)]
    if args.check:
        missing = [measure for measure in plotted if not (PLOTS / f"{measure}.png").is_file()]
        if fresh != readme or missing:
            plots = f" (no plot of {', '.join(missing)})" if missing else ""
            print(
                f"bench/README.md's figures differ from bench/results/*.jsonl{plots}: "
                "run .venv/bin/python bench/figures.py --write",
                file=sys.stderr,
            )
            return 1
        return 0
    README.write_text(fresh, encoding="utf-8")
    for measure in plotted:
        plot(measure, found[measure])
    print(f"rendered {len(found)} measures into bench/README.md, {len(plotted)} plots into bench/results/plots/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
