#!/usr/bin/env bash
# Issue 18's paired measurements at the sizes people run: synthetic models of real shapes (bench/synthetic_model.py)
# and the default SmolLM2-135M Q4_1, minfer against llama.cpp (llama-cpp-python) at 2 threads, runs alternating.
#
#   LLAMACPP_PYTHON=/tmp/lcpenv/bin/python bench/real_sizes.sh [OUT_DIR] [REPS]
#
# Models are written once to OUT_DIR (default /tmp/synth; ~4.5 GB in all, F16 sources removed as they go) and
# reused. Each line of the report: both engines' t/s, the ratio, tg's read bandwidth against the measured one,
# pp's GFLOP/s against the measured FMA peak. State the load average with the figures (it is printed first).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/synth}
REPS=${2:-2}
PY=${PYTHON:-python3}
LCP=${LLAMACPP_PYTHON:-/tmp/lcpenv/bin/python}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
for spec in "smollm2-1.7b q4_k_m" "smollm2-1.7b q8_0" "smollm2-360m q4_k_m" "qwen2.5-1.5b q4_k_m"; do
  set -- $spec
  f="$OUT/$1-$2.gguf"
  [ -f "$f" ] || "$PY" bench/synthetic_model.py --shape "$1" --type "$2" -o "$f" --llamacpp-python "$LCP"
done
echo "load average before: $(cat /proc/loadavg)"
run() {  # MODEL TG
  echo; echo "## $1"
  "$PY" -m minfer bench "$1" -p 512 -n "$2" -r "$REPS" -t 2 --compare --peer-python "llama.cpp=$LCP"
  echo "load average: $(cat /proc/loadavg)"
}
run smollm2 128
run "$OUT/smollm2-360m-q4_k_m.gguf" 64
run "$OUT/qwen2.5-1.5b-q4_k_m.gguf" 32
run "$OUT/smollm2-1.7b-q8_0.gguf" 32
run "$OUT/smollm2-1.7b-q4_k_m.gguf" 32
