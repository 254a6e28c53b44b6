"""The test suite's time, from the output of `pytest --durations=0`: the slowest tests and each file's total.

    .venv/bin/python bench/suite_durations.py LOG [LOG ...] [--top 30] [--baseline BASELINE_LOG ...]

LOG: what `make test PYTEST_ARGS=--durations=0` printed. A test's time is its setup, call and teardown added up (a
module fixture counts in the setup of the first test that uses it); pytest leaves out phases under 5 ms, so a file's
"tests timed" can be fewer than its tests. With --baseline, each file's total is shown beside the baseline's, and the
ratio (this run / the baseline). Tests run in parallel add up to more than the wall clock, which the closing line gives.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(tests/\S+)")
CLOSING = re.compile(r"^=+ (.*\d+ passed.*) in ([\d.]+)s")


def read(logs: list[Path]) -> tuple[dict[str, float], list[str]]:
    """Seconds per test id, and the closing lines ('N passed ... in S s') of each pytest run in LOGS."""
    per_test: dict[str, float] = defaultdict(float)
    closing: list[str] = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if match := LINE.match(line):
                # pytest-xdist's loadgroup names a grouped test `id@group`: the id alone is the test's.
                per_test[re.sub(r"@[\w.-]+$", "", match.group(3))] += float(match.group(1))
            elif match := CLOSING.match(line.strip()):
                closing.append(f"{match.group(1)} in {float(match.group(2)) / 60:.1f} min")
    return dict(per_test), closing


def per_file(per_test: dict[str, float]) -> dict[str, tuple[int, float]]:
    files: dict[str, list[float]] = defaultdict(list)
    for test, seconds in per_test.items():
        files[test.split("::")[0]].append(seconds)
    return {name: (len(times), sum(times)) for name, times in files.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--baseline", nargs="*", type=Path, default=[])
    args = parser.parse_args()
    tests, closing = read(args.logs)
    if not tests:
        raise SystemExit(f"no durations in {', '.join(map(str, args.logs))}: run pytest with --durations=0")
    base_files = per_file(read(args.baseline)[0]) if args.baseline else {}
    print("| # | test | s |\n| ---: | --- | ---: |")
    for rank, (test, seconds) in enumerate(sorted(tests.items(), key=lambda kv: -kv[1])[: args.top], 1):
        print(f"| {rank} | `{test}` | {seconds:.0f} |")
    print()
    files = per_file(tests)
    if base_files:
        print(
            "| file | tests timed | s | baseline tests timed | baseline s | ratio |\n| --- | ---: | ---: | "
            "---: | ---: | ---: |"
        )
        for name in sorted(set(files) | set(base_files), key=lambda n: -files.get(n, (0, 0.0))[1]):
            count, seconds = files.get(name, (0, 0.0))
            base_count, base_seconds = base_files.get(name, (0, 0.0))
            ratio = f"{seconds / base_seconds:.2f}" if base_seconds else "-"
            print(f"| `{name}` | {count} | {seconds:.0f} | {base_count} | {base_seconds:.0f} | {ratio} |")
    else:
        print("| file | tests timed | s |\n| --- | ---: | ---: |")
        for name, (count, seconds) in sorted(files.items(), key=lambda kv: -kv[1][1]):
            print(f"| `{name}` | {count} | {seconds:.0f} |")
    total = sum(tests.values())
    print(
        f"\n{len(tests)} tests, {total / 60:.1f} min of test time added up; wall clock: "
        f"{'; '.join(closing) or 'not in the log'}"
    )


if __name__ == "__main__":
    main()
