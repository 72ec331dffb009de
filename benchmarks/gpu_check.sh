#!/usr/bin/env bash
# make gpu-check: what only a CUDA machine can check, in one run of a few minutes, no network.
#
#   bash benchmarks/gpu_check.sh                    # uses .venv (make install), else $PY
#   WHEELS=/path/to/wheels bash benchmarks/gpu_check.sh   # install missing deps from brought wheels
#
# PyTorch (CUDA build) and Transformers are expected on the machine; the rest of dspark's
# dependencies come from $WHEELS (`pip download -d wheels -r <(pip freeze)` on a networked machine)
# when the interpreter lacks them. Steps, each timed, all on the tiny fixture target:
#   1. the CUDA-only tests (flex attention vs SDPA: tests/test_model_drafter.py -k flex, and
#      tests/test_attention_flex.py with its slow compiled variant);
#   2. a bf16 training step on CUDA (the real trainer, 4 steps, precision bf16, export at the end);
#   3. `dspark cache build` on CUDA;  4. `dspark eval` on CUDA;  5. `dspark profile` on the GPU;
#   6. the trainer on a Qwen3-4B-shaped drafter at real width (pipelines/qwen3-4b.toml's settings,
#      random target embedding and features; benchmarks/gpu_train_step.py), and the rehearsal's
#      train stage on the cache `make rehearse` left in runs/rehearse (skipped when absent).
# Figures land in $OUT (default runs/gpu-check) and are printed as `gpu-check: <step> <seconds> s`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
test -x "$PY" || PY=python3
OUT=${OUT:-runs/gpu-check}
DEVICE=${DEVICE:-cuda}   # DEVICE=cpu rehearses the script on a machine without a GPU (no figures worth keeping)
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" -e '.[dev]'
fi
[ "$DEVICE" = cpu ] || "$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu-check: no CUDA device (torch.cuda.is_available() is False)")
print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PYEOF
mkdir -p "$OUT"
step() { local name=$1; shift; local t0; t0=$(date +%s); "$@"; echo "gpu-check: $name $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.txt"; }

[ "$DEVICE" = cpu ] || step "cuda-tests" "$PY" -m pytest -q -m "" tests/test_attention_flex.py tests/test_model_drafter.py -k flex -p no:cacheprovider

# The tiny target, its own answers as a responses artifact, and a prompt file (the fixtures' code).
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
from fixtures.cache_responses import response_rows, write_responses
from fixtures.tiny_models import build_tiny_target, mask_token_id
from fixtures.eval_drafter import PROMPTS
out = Path(sys.argv[1])
target = build_tiny_target(out / "target", num_layers=36)
write_responses(str(out / "responses"), response_rows(16))
(out / "prompts.jsonl").write_text("\n".join(json.dumps({"turns": [p]}) for p in PROMPTS))
(out / "mask_id").write_text(str(mask_token_id(target)))
PYEOF
T=$OUT/target
M=$(cat "$OUT/mask_id")
SETS=(--set "target.mask_token_id=$M" --set "target.layers=[1, 9, 17, 25, 33]" --set "target.device='$DEVICE'"
      --set "model.num_draft_layers=1" --set "model.block_size=4" --set "model.markov_rank=16"
      --set "train.device='$DEVICE'" --set "train.precision='bf16'" --set "train.max_steps=4"
      --set "train.global_batch=4" --set "train.micro_batch=4" --set "train.save_every=1000"
      --set "pipeline.work_dir='$OUT'")
step "cache-build" "$PY" -m dspark_cli.cli cache build --responses "$OUT/responses" --output "$OUT/cache" \
  --target "$T" --device $DEVICE --dtype bfloat16 --force "${SETS[@]}"
step "train-bf16" "$PY" -m dspark_cli.cli train --cache "$OUT/cache" --output "$OUT/train" --device $DEVICE \
  --force "${SETS[@]}"
step "eval" "$PY" -m dspark_cli.cli eval --target "$T" --drafter "$OUT/train" --dataset "$OUT/prompts.jsonl" \
  --limit 4 --max-new-tokens 32 -o "$OUT/eval" --force "${SETS[@]}" --set "target.dtype='bfloat16'"
step "profile" "$PY" -m dspark_cli.cli profile --target "$T" --device $DEVICE --dtype bfloat16 \
  --batch-tokens 1,4,16,64,256 -o "$OUT/profile" --force
"$PY" -m dspark_cli.cli export check "$OUT/train/export" --sps "$OUT/profile/sps.json" || true
# Real width: 5 draft layers × 2560, vocab 151,936, 512 anchors, 2048-token samples, bf16 (CPU: shrunk).
if [ "$DEVICE" = cpu ]; then
  step "train-qwen3-4b-shape" "$PY" -m benchmarks.gpu_train_step --out "$OUT/qwen3-4b" --device cpu \
    --draft-layers 1 --length 128 --anchors 8 --steps 2 --global-batch 2
else
  step "train-qwen3-4b-shape" "$PY" -m benchmarks.gpu_train_step --out "$OUT/qwen3-4b" --device cuda
fi
# The rehearsal's own train step (Qwen3-4B-shaped target, its cache from `make rehearse`) on the device.
RH=runs/rehearse
if [ -f "$RH/cache/manifest.json" ]; then
  step "rehearse-train" "$PY" -m dspark_cli.cli train -c pipelines/qwen3-4b.toml --cache "$RH/cache" \
    --output "$OUT/rehearse-train" --max-steps 2 --device "$DEVICE" --force \
    "--set=pipeline.work_dir='$RH'" "--set=target.model='$RH/target'" \
    --set=train.global_batch=2 --set=train.micro_batch=1 --set=train.save_every=100000
else
  echo "gpu-check: rehearse-train skipped (no $RH/cache: run \`make rehearse\` first)"
fi
echo "gpu-check: done; figures in $OUT (times.txt, eval/report.json, profile/sps.json)"
