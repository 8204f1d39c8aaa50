#!/usr/bin/env bash
# On a machine with a CUDA GPU: the engine and the trainer in bfloat16 on the GPU.
#   1. greedy parity: the native engine against transformers' generate on the same weights
#   2. a few RL steps of the quickstart on the GPU (SFT, RL, held-out evaluation)
#   3. the rollout benchmark on the GPU
# DEVICE=cpu DTYPE=float32 runs the same steps on the CPU: a dry run of this script.
# Nothing in the test suite needs a GPU; this script is how a GPU machine is checked.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"

echo "== 1. greedy parity on $DEVICE ($DTYPE)"
DEVICE=$DEVICE DTYPE=$DTYPE "$PY" - <<'PYTHON'
import os

import torch

from assay.bench.rollout import QUICK_MODEL as QUICK, build_model
from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.engine.engine import Engine, EngineConfig

device, dtype = os.environ["DEVICE"], {"float32": torch.float32, "bfloat16": torch.bfloat16}[os.environ["DTYPE"]]
model = build_model(QUICK, dtype, device)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(2, QUICK.vocab, (int(n),), generator=g).tolist() for n in torch.randint(20, 60, (16,), generator=g)]
engine = Engine(model, None, EngineConfig(kv_cache_bytes=2**28))
greedy = SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[])
ours = [r[0].token_ids for r in engine.generate([GenRequest(p, greedy) for p in prompts])]
with torch.inference_mode():
    theirs = []
    for p in prompts:
        out = model.generate(input_ids=torch.tensor([p], device=model.device), do_sample=False, max_new_tokens=32,
                             min_new_tokens=32, pad_token_id=0, eos_token_id=None)
        theirs.append(out[0, len(p):].tolist())
same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
print(f"identical greedy prefixes (of 32 tokens): min {min(same)}, mean {sum(same) / len(same):.1f}, "
      f"all 32 in {sum(s == 32 for s in same)} of {len(same)} prompts")
if sum(s >= 8 for s in same) < 0.9 * len(same):  # low precision may tie-break late tokens differently, not early ones
    raise SystemExit("engine and transformers disagree within the first 8 greedy tokens on >10% of prompts")
PYTHON

echo "== 2. RL steps on $DEVICE ($DTYPE)"
"$PY" -m assay.cli quickstart name=steps run_dir="$OUT" model.device="$DEVICE" model.dtype="$DTYPE" \
    sft.steps=200 train.steps=5 train.groups_per_step=8 eval.tasks_per_domain=8 eval.n=2

echo "== 3. rollout benchmark on $DEVICE ($DTYPE)"
"$PY" -m assay.cli bench rollout --device "$DEVICE" --dtype "$DTYPE" ${QUICK:+--quick} --out "$OUT/rollout.json"
