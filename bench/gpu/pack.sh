#!/usr/bin/env bash
# Bundle what a bare GPU machine (Python 3.12 with torch, Lightning and numpy 2, no network) lacks to run
# bench/train.py --gpu: Ray, Petastorm with the pyarrow 14 / numpy 1.26 it needs, pandas and a few pure-Python
# packages (pydantic-settings for the settings the model reads its architectures from), at the versions of constraints.txt, as cp312 manylinux wheels unpacked, trimmed and xz-compressed.
#
#   bench/gpu/pack.sh [OUT]        # default bench/out/gpu: part1 (Ray) and part2 (the rest), about 52 MB together
#
# Then, on the GPU machine, from the repository's root with OUT beside it: bench/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench/out/gpu}
pin() { grep -i -E "^$1==" constraints.txt | head -1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
wheels=(
  "$(pin ray)" "$(pin pyarrow)" "$(pin numpy)" "$(pin pandas)" "$(pin petastorm)" "$(pin pyzmq)"
  "$(pin dill)" "$(pin diskcache)" "$(pin future)" "$(pin pydantic)" "$(pin "pydantic[-_]core")"
  "$(pin jsonschema)" "$(pin referencing)" jsonschema-specifications annotated-types typing-inspection rpds-py pytz tzdata
  "$(pin pydantic-settings)" "$(pin python-dotenv)"
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d "$work/whl" "${wheels[@]}"
python3 -m pip install -q --no-deps --no-compile --target "$work/site" --python-version 3.12 --implementation cp --only-binary=:all: "${platforms[@]}" "$work"/whl/*.whl
cd "$work/site"
# What training never loads: Ray's Java, RLlib, Serve, LLM and dashboard front end; Arrow Flight, Substrait and
# Gandiva; headers, Cython sources, type stubs and test suites.
rm -rf ray/jars ray/rllib ray/serve ray/llm ray/dashboard/client pyarrow/tests pyarrow/include pyarrow/src pandas/tests numpy/*/tests \
  pyarrow/*flight* pyarrow/*substrait* pyarrow/*gandiva* pyarrow/*.pyx pyarrow/*.pxd
find . -name "*.pyi" -delete
cd - >/dev/null
mkdir -p "$out"
rm -f "$out"/part*.tar.xz
(cd "$work/site" && tar -cf - ray ray-*.dist-info) | xz -9 -T0 >"$out/part1.tar.xz"
(cd "$work/site" && tar -cf - --exclude=./ray --exclude='./ray-*.dist-info' .) | xz -9 -T0 >"$out/part2.tar.xz"
ls -l "$out"
