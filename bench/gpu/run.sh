#!/usr/bin/env bash
# On a GPU machine without network: unpack bench/gpu/pack.sh's bundle, show the machine, run the GPU table.
#
#   bench/gpu/run.sh [RESULTS] [bench/train.py arguments...]     # RESULTS: a folder for the table (.txt and .json)
#   GPU_TESTS=1 bench/gpu/run.sh ...                               # tests/test_loader_gpu.py first (gpu-tests.txt)
#
# Without arguments the table is its goals section (bench/train.py): the rows most wanted first, cut off after
# BENCH_TIMEOUT seconds (default 450, so that unpacking, the machine's start and the table fit a 10-minute call);
# every row is in RESULTS as soon as it is measured. `bench/train.py --dry-run` runs the same code here, on the CPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
results=${1:-bench/out}
shift || true
site=/tmp/imagelake-gpu-site
if [ ! -f "$site/.unpacked" ]; then
  mkdir -p "$site"
  for part in bench/out/gpu/part*.tar.xz; do xz -dc "$part" | tar -xf - -C "$site" || exit 1; done
  touch "$site/.unpacked"
fi
# Some packages of such an image are hidden from Python (a finder that sitecustomize puts first):
# - scipy, scikit-learn, transformers, matplotlib: built for numpy 2, and torchmetrics imports them when
#   they are there, while the bundle brings numpy 1.26 (for pyarrow 14).
# - lightning: Ray's Lightning integration uses `lightning.pytorch` whenever it is importable, and its RayDDPStrategy
#   is then no strategy of imagelake's `pytorch_lightning` Trainer (imagelake installs pytorch-lightning alone).
# torchvision stays visible: the table uses its models and nvJPEG decoder, and it imports numpy 1.26 as it is.
cat >"$site/sitecustomize.py" <<'PY'
import importlib.machinery
import importlib.metadata
import os
import sys

HIDDEN = {"scipy", "sklearn", "scikit-learn", "transformers", "matplotlib", "lightning"}


def hidden(name):
    return name is not None and name.partition(".")[0].lower() in HIDDEN


class Hide(importlib.machinery.PathFinder):
    """The path finder, blind to the hidden packages: importing one fails, and find_spec and metadata find none."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if hidden(name) else super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, context=importlib.metadata.DistributionFinder.Context()):
        if hidden(context.name):
            return iter(())
        return (dist for dist in super().find_distributions(context) if not hidden(dist.metadata["Name"]))


sys.meta_path[:] = [Hide if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
# The image's own sitecustomize, if it has one, still runs.
here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
if spec is not None and spec.loader is not None:
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
PY
# The repository's flows/, tasks/ and infra/ as imagelake.flows, ... (nothing installs them here): bench/checkout.py's
# link folder, then the repository itself.
code=$(python3 bench/checkout.py "$PWD") || exit 1
export PYTHONPATH="$site:$code" PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 PYTHONWARNINGS=ignore
mkdir -p "$results"
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  echo "$(nproc) cores, $(awk '/MemTotal/{printf "%.0f GiB", $2/2^20}' /proc/meminfo), $(python3 --version)"
  python3 -c "import numpy, pyarrow, petastorm, ray; print('numpy', numpy.__version__, 'pyarrow', pyarrow.__version__, 'petastorm', petastorm.__version__, 'ray', ray.__version__)"
} 2>&1 | tee "$results/gpu-machine.txt"
rm -f "$results/gpu-table.txt"
if [ -n "${GPU_TESTS:-}" ]; then  # the tests that need a GPU (CI has none), before the table
  timeout 180 python3 -m pytest --noconftest -p no:cacheprovider -q tests/test_loader_gpu.py >"$results/gpu-tests.txt" 2>&1
  tested=$?
  tail -15 "$results/gpu-tests.txt"
  if [ "$tested" != 0 ]; then  # the table still measures, through the pinned copy the tests did not fail
    echo "GPU tests failed (exit $tested): the table runs with --no-page-lock" | tee -a "$results/gpu-tests.txt"
    set -- "$@" --no-page-lock
  fi
fi
timeout "${BENCH_TIMEOUT:-450}" python3 bench/train.py --gpu --json "$results/gpu-table.json" "$@" >"$results/gpu-run.log" 2>&1
status=$?
cat "$results/gpu-table.txt" 2>/dev/null; tail -5 "$results/gpu-run.log"
exit $status
