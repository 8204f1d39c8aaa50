"""`assay bench trainer`: peak memory and step time of one RL trainer step with full logits beside
selective log-probs (`train.selective_logprobs`), and selective log-probs with LoRA adapters
(`train.lora`, the base and its embeddings frozen), then that with each group's prompt run once
(`train.shared_prefix`), on a model with a real vocabulary (151,936 tokens, Qwen2.5's), random weights
and tokens, the sequences in GRPO groups of 4 that share their prompt. Each measurement runs in a fresh
process, variants alternating, so a peak RSS belongs to that variant alone."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time

import torch

VOCAB = 151_936
# lora: rank-8 adapters on every projection (peft); shared prompt: each group's prompt runs forward once
VARIANTS = ["full", "selective", "selective + lora", "selective + lora + shared prompt"]
GROUP = 4


def measure(variant: str, seqs: int, length: int, completion: int, hidden: int, threads: int) -> dict[str, float]:
    """One trainer step in this process; returns its wall time and the process's peak RSS."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from assay.core.config import TrainConfig
    from assay.core.types import Message, Task, Trajectory
    from assay.train.trainer import GRPOTrainer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=2 * hidden, tie_word_embeddings=True))
    g = torch.Generator().manual_seed(1)
    batch = []
    for i in range(seqs):
        if i % GROUP == 0:
            prompt = torch.randint(0, VOCAB, (length - completion,), generator=g).tolist()
        ids = prompt + torch.randint(0, VOCAB, (completion,), generator=g).tolist()
        task = Task("bench@1", f"t{i // GROUP}", 1, [Message("user", "")], domain="bench")
        batch.append(Trajectory(task, [], ids, [0] * (length - completion) + [1] * completion,
                                [-12.0] * length, length - completion, reward=float(i % 2), passed=bool(i % 2),
                                group_id=f"g{i // GROUP}"))
    if "lora" in variant:
        from assay.core.config import LoraConfig
        from assay.train.lora import with_lora

        model = with_lora(model, LoraConfig(rank=8))
    trainer = GRPOTrainer(model, TrainConfig(micro_batch=seqs, selective_logprobs=variant != "full",
                                             shared_prefix="shared" in variant, dynamic_sampling=False))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    trainer.step(batch)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"seconds": seconds, "peak_mib": peak / 1024, "step_mib": (peak - base) / 1024}


def run_trainer_bench(rounds: int, seqs: int, length: int, completion: int, hidden: int, threads: int,
                      log=print) -> str:
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            code = (f"import json; from assay.bench.trainer import measure; "
                    f"print(json.dumps(measure({variant!r}, {seqs}, {length}, {completion}, {hidden}, {threads})))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            rows[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(f"round {r + 1} {variant}: {rows[variant][-1]}")
    med = {v: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for v, ms in rows.items()}
    lines = [f"One GRPO trainer step, vocabulary {VOCAB}, {seqs} sequences × {length} tokens ({completion} "
             f"completion tokens each, groups of {GROUP} sharing a prompt), hidden {hidden}, {threads} thread(s); "
             f"median of {rounds} fresh processes per variant, alternated.", "",
             "| logits | step time s | peak RSS MiB | RSS added by the step MiB |", "|---|---|---|---|"]
    for v, m in med.items():
        lines.append(f"| {v} | {m['seconds']:.2f} | {m['peak_mib']:.0f} | {m['step_mib']:.0f} |")
    f = med["full"]
    lines.append("")
    for v in VARIANTS[1:]:
        s = med[v]
        lines.append(f"{v} / full: step time {s['seconds'] / f['seconds']:.2f}×, memory added by the step "
                     f"{s['step_mib'] / max(f['step_mib'], 1e-9):.2f}×")
    lora, shared = med["selective + lora"], med["selective + lora + shared prompt"]
    lines.append(f"shared prompt / selective + lora: step time {shared['seconds'] / lora['seconds']:.2f}×")
    return "\n".join(lines)
