#!/bin/bash
# The README's one-GPU figures in one go, on one GPU machine, from an 8.03 B random-init model folder
# (Hunyuan-MT-7B's shape, untied head): hy-mt-7b-lora and hy-mt-7b-lora-fast as `hymt train` runs them
# (jobs/bench_real_model.py: figures from what the workers report), then decoding at batch 64
# (jobs/bench_generation.py: generate against the default path, identical-token counts).
#   usage: benchmarks/one_gpu_figures.sh OUT_DIR [STEPS]
# OUT_DIR receives the JSON lines and the consoles; the model folder, runs and exports go to
# $HYMT_BENCH_SCRATCH (default /tmp/hymt-bench: ~16 GB each for the model and an export).
set -uo pipefail
OUT=${1:?usage: $0 OUT_DIR [STEPS]}; STEPS=${2:-10}
SCRATCH=${HYMT_BENCH_SCRATCH:-/tmp/hymt-bench}
MODEL=/dev/shm/hymt-8b
mkdir -p "$OUT" "$SCRATCH"
cd "$(dirname "$0")/.."
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers, ray, deepspeed; print("torch", torch.__version__, "transformers",
transformers.__version__, "ray", ray.__version__, "deepspeed", deepspeed.__version__)'
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20; } > "$OUT/environment.txt" 2>&1
for preset in hy-mt-7b-lora-fast hy-mt-7b-lora; do
  python3 jobs/bench_real_model.py --preset "$preset" --model-dir "$MODEL" --untied --steps "$STEPS" \
    --out "$SCRATCH/$preset" > "$OUT/$preset.console.txt" 2>&1
  echo "$preset exit $?"
  tail -1 "$SCRATCH/$preset/real_model.jsonl" >> "$OUT/real_model.jsonl"
  rm -rf "$SCRATCH/$preset/runs"  # the export (16 GB) and checkpoints: the figures are in the JSON line
done
python3 jobs/bench_generation.py --model-dir "$MODEL" --untied --lora --test-set tests/assets/flores200/devtest \
  --sentences 32 --out "$OUT/generation.jsonl" > "$OUT/generation.console.txt" 2>&1
echo "generation exit $?"
