#!/usr/bin/env bash
# On a machine with a CUDA GPU: the engine and the trainer in bfloat16 on the GPU.
#   1. greedy parity: the native engine against transformers' generate on the same weights
#   2. a few RL steps of the quickstart on the GPU (SFT, RL, held-out evaluation)
#   3. the rollout benchmark on the GPU
#   4. sharded training (train.sharding: fsdp, nccl): a world of one GPU, or two where two are visible;
#      a checkpoint gathered from the shards, resumed onto them, beside an unsharded run of the same steps
# DEVICE=cpu DTYPE=float32 runs the same steps on the CPU (two gloo ranks in step 4): a dry run of this
# script. STEPS="2 4" runs only those steps (step 4 starts from step 2's SFT policy when it is there).
# Nothing in the test suite needs a GPU; this script is how a GPU machine is checked.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
STEPS=${STEPS:-1 2 3 4}
mkdir -p "$OUT"
want() { [[ " $STEPS " == *" $1 "* ]]; }

if want 1; then
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
fi

if want 2; then
echo "== 2. RL steps on $DEVICE ($DTYPE)"
"$PY" -m assay.cli quickstart name=steps run_dir="$OUT" model.device="$DEVICE" model.dtype="$DTYPE" \
    sft.steps=200 train.steps=5 train.groups_per_step=8 eval.tasks_per_domain=8 eval.n=2
fi

if want 3; then
echo "== 3. rollout benchmark on $DEVICE ($DTYPE)"
"$PY" -m assay.cli bench rollout --device "$DEVICE" --dtype "$DTYPE" ${QUICK:+--quick} --out "$OUT/rollout.json"
fi

if want 4; then
# one rank per visible GPU, at most two; on the CPU two gloo ranks
RANKS=${RANKS:-$("$PY" -c "import torch; print(min(2, torch.cuda.device_count()) if '$DEVICE'.startswith('cuda') else 2)")}
echo "== 4. sharded training on $DEVICE ($DTYPE), $RANKS rank(s)"
POLICY=()
[[ -f "$OUT/steps/sft/policy/config.json" ]] && POLICY=(model.path="$OUT/steps/sft/policy")
# any policy, trained or not, passes "no letter e" about half the time: a signal from the first step
"$PY" -c "import json; print('\n'.join(json.dumps({'prompt': f'Say anything without the letter e ({i}).', \
'answer': '[^e]*', 'reference': 'ok'}) for i in range(16)))" > "$OUT/no_e.jsonl"
RUN=(run_dir="$OUT" model.device="$DEVICE" model.dtype="$DTYPE" "${POLICY[@]}" threads=1 eval.every=0
     "domains=[{name: no_e, env: jsonl, group_size: 8, max_new_tokens: 8,
                env_args: {path: $OUT/no_e.jsonl, matcher: regex}}]"
     train.groups_per_step=8 train.max_refill_rounds=0 train.checkpoint_every=2)
rm -rf "$OUT/unsharded" "$OUT/sharded"
"$PY" -m assay.cli train src/assay/configs/quickstart.yaml name=unsharded train.steps=3 "${RUN[@]}" --quiet
"$PY" -m assay.cli train src/assay/configs/quickstart.yaml name=sharded train.steps=2 train.sharding=fsdp \
    train.ranks="$RANKS" "${RUN[@]}" --quiet
"$PY" -m assay.cli train --resume "$OUT/sharded" train.steps=3 --quiet  # loads step 2's gathered state onto the shards
OUT=$OUT "$PY" - <<'PYTHON'
import json
import os

import torch
from safetensors.torch import load_file

out = os.environ["OUT"]
a, b = (load_file(f"{out}/{name}/checkpoints/step_3/model.safetensors") for name in ("unsharded", "sharded"))
if {k: v.shape for k, v in a.items()} != {k: v.shape for k, v in b.items()}:
    raise SystemExit("the sharded run's checkpoint does not hold the whole weights under the unsharded names")
if not all(torch.isfinite(v.float()).all() for v in b.values()):
    raise SystemExit("the sharded run's weights are not finite")
with open(f"{out}/sharded/metrics.jsonl") as f:
    steps = [r for r in map(json.loads, f) if r.get("kind") == "train"]
if not any(r.get("skipped") == 0 for r in steps):
    raise SystemExit("the sharded run took no optimizer step (no reward signal): nothing was checked")
gap = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
# not asserted: GPU sampling and low precision let the two runs' batches and sums drift apart
print(f"sharded vs unsharded after 3 steps: max |weight difference| {gap:.2e} over {len(a)} tensors")
PYTHON
fi
