"""Run configuration: YAML validated by pydantic, with `key.sub=value` overrides.

Every error is one line naming the key path and what is allowed."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from assay.core.errors import ConfigError
from assay.core.loggers import check_loggers


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    path: str | None = Field(None, description=(
        "A local Hugging Face model directory, a `.gguf` file, or a packaged model's name (`smollm2`); never the "
        "network; none: build a tiny model from the architecture keys below and train its tokenizer"))
    arch: Literal["qwen2", "llama"] = Field("qwen2", description="Built model (`path` none): architecture family")
    hidden_size: int = Field(128, gt=0, description="Built model: hidden size; must divide by `num_heads`")
    num_layers: int = Field(2, gt=0, description="Built model: decoder layers")
    num_heads: int = Field(4, gt=0, description="Built model: attention heads; must divide by `num_kv_heads`")
    num_kv_heads: int = Field(2, gt=0, description="Built model: key/value heads (grouped-query attention)")
    intermediate_size: int = Field(384, gt=0, description="Built model: the MLP's inner size")
    max_position: int = Field(1024, gt=0, description="Built model: the longest sequence it has positions for")
    vocab_size: int = Field(1024, ge=300, description="Built model: size of its locally trained byte-level BPE "
                                                      "tokenizer")
    tokenizer_corpus: int = Field(2000, gt=0, description="Built model: generated tasks per domain (training "
                                                          "partition) the tokenizer is trained on")
    device: str = Field("cpu", description="Where the policy, the reference model and the engine hold their weights: "
                                           "`cpu`, `cuda`, `cuda:N`")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="The weights' dtype there")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field("auto", description=(
        "The transformers attention implementation. `auto`: SDPA, except bfloat16 on the CPU at a training "
        "micro-batch's size, where matmul attention is faster (core/attention.py)"))
    chat_template_kwargs: dict[str, Any] = Field({}, description=(
        "Variables for the tokenizer's chat template wherever a prompt or turn layout is rendered, e.g. "
        "`{enable_thinking: false}` for Qwen3's non-thinking mode (core.chat_format.set_template_kwargs)"))

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        return self


class DifficultyRange(_Strict):
    min: int = Field(1, description="Lowest level of the range")
    max: int = Field(4, description="Highest level of the range")
    start: int = Field(1, description="Level the curriculum starts at; `min <= start <= max`")
    review: float = Field(0.0, ge=0, lt=1, description="Share of tasks drawn uniformly from the levels below the "
                                                       "current one (against forgetting)")
    schedule: Literal["curriculum", "uniform", "stratified"] = Field("curriculum", description=(
        "`curriculum`: start at `start`, promote and demote on the rolling pass rate (the domain's `acceptance` "
        "and `regression`); `uniform`: every level of [`min`, `max`] in equal parts for the whole run (the levels "
        "evaluation samples), each task's level drawn at random; `stratified`: the same levels, in equal parts "
        "within every batch (a batch of as many groups as levels has one group a level, so no step lacks the "
        "easy tasks that give a weak policy reward variance)"))
    acceptance: float = Field(0.8, gt=0, le=1, description=(
        "Curriculum: the rolling pass rate that promotes a level; at `max` it marks the domain learned (the "
        "adaptive mixer stops favouring it)"))
    regression: float = Field(0.3, ge=0, lt=1, description="Curriculum: the rolling pass rate below which a "
                                                           "level drops; below `acceptance`")
    window: int = Field(32, gt=0, description="Curriculum: trajectories in the rolling pass rate (at the current "
                                              "level only)")

    def levels(self, available: Sequence[int]) -> list[int]:
        """The environment's levels that fall in this range."""
        return [d for d in available if self.min <= d <= self.max]

    @model_validator(mode="after")
    def _order(self) -> DifficultyRange:
        if not self.min <= self.start <= self.max:
            raise ValueError(f"need min <= start <= max, got {self.min}, {self.start}, {self.max}")
        if self.regression >= self.acceptance:
            raise ValueError(f"need regression < acceptance (a level would promote and demote on one pass rate), "
                             f"got {self.regression} and {self.acceptance}")
        return self


class RewardTerm(_Strict):
    fn: str = Field(description=(
        "Built in: `verifier`, `format` (ended on its own answer, no tool error), `length` (minus the share of the "
        "token budget used); or `package.module:function` (see assay.envs.rewards)"))
    weight: float = Field(1.0, description="The term's weight in the sum")


class AgentConfig(_Strict):
    mode: Literal["react", "plan_execute"] = Field("react", description=(
        "`react`: one context that grows turn by turn; `plan_execute`: a planning turn (the `plan` tool) before "
        "every acting turn keeps a task list outside the context, and each acting turn sees the task, the current "
        "subtask and a one-paragraph summary of the plan, with only that subtask's turns; planning turns do not "
        "count against `max_turns` (assay.agent.modes)"))
    memory: bool = Field(False, description=(
        "Offer `note_write(key, text)`, `note_read(key)` and `note_search(query)` to tasks that have tools: notes "
        "kept by the loop for the episode, outside the context, so compaction never drops them"))
    note_max_chars: int = Field(2000, gt=0, description="Memory: characters per note; a longer note is refused "
                                                        "with an error observation")
    notes_max_chars: int = Field(16000, gt=0, description="Memory: characters of all the episode's notes together")
    compaction: str = Field("none", description=(
        "A compaction rule from assay.agent.compaction's registry, for when the context nears `max_context`: "
        "`none`, the episode ends with finish reason `context`; "
        "`elide_observations`, the oldest tool results become a one-line stub naming the tool and its size; "
        "`drop_turns`, the oldest turns leave the context whole. The system prompt, the task and the last "
        "`keep_last` turns stay. Each compaction starts a new token segment, and the trainer scores each segment "
        "as the policy saw it (assay.agent.compaction)"))
    keep_last: int = Field(2, ge=0, description="Compaction: the newest turns kept as they are")
    compact_at: float = Field(0.9, gt=0, le=1, description=(
        "Compaction: compact when the context passes this share of `max_context` or leaves no room for a whole "
        "turn of `max_new_tokens`; it sheds the oldest turns' tokens until it is below that again"))
    fallback_tools: dict[str, str] = Field({}, description=(
        "Declared fallback tools, e.g. `{edit_file: patch}`: a call naming a tool the task does not offer (a "
        "hallucinated `edit_file`) runs as a call of the tool declared for that name when its arguments pass that "
        "tool's schema, counted as degraded (`degraded_calls`, and `fallback_calls`); otherwise it is the usual "
        "unknown-tool error. Each key must be a name the task does not offer, each value a tool it does"))


    @field_validator("fallback_tools")
    @classmethod
    def _fallbacks(cls, v: dict[str, str]) -> dict[str, str]:
        for name, tool in v.items():
            if not name or not tool:
                raise ValueError(f"fallback_tools: empty tool name in {name!r}: {tool!r}; map a name to a tool")
            if name == tool:
                raise ValueError(f"fallback_tools: {name!r} falls back to itself; map a name the task does not "
                                 "offer to a tool it does, e.g. {edit_file: patch}")
        return v


class DomainConfig(_Strict):
    name: str = Field(description="Domain name, unique in the run; overrides address the domain by it "
                                  "(`domains.NAME.key=value`)")
    env: str = Field(description="Environment: `name` or `name@version` in the environment registry")
    weight: float = Field(1.0, ge=0, description="Static mixer: the domain's ratio weight; adaptive: a prior on "
                                                 "its ratio")
    group_size: int = Field(8, ge=2, description="Samples per task (the GRPO group)")
    max_new_tokens: int = Field(64, gt=0, description="Tokens sampled per assistant turn")
    max_turns: int = Field(1, gt=0, description="Assistant turns per episode")
    max_context: int = Field(512, gt=0, description="Tokens per episode")
    time_limit_s: float | None = Field(None, gt=0, description=(
        "Wall-clock budget of one episode in seconds, checked after each turn (none: no limit); an episode past it "
        "stops acting and is verified as it stands, like one that ran out of turns"))
    verify_timeout_s: float = Field(120.0, gt=0, description=(
        "A verification running longer than this many seconds gives its episode `verifier_error` (an "
        "infrastructure status, never a reward) and the run goes on"))
    tool_retries: int = Field(0, ge=0, description=(
        "Retries of a malformed tool-call turn (a call that does not parse, names an unknown tool or breaks its "
        "schema): nothing in the turn runs, the policy is shown the validator's message with an instruction to "
        "call again, and the turn does not count against `max_turns`; up to this many such turns in a row, after "
        "which a malformed turn counts (its valid calls run, its bad ones get error results) and the count starts "
        "over, so an episode takes at most `max_turns` × (1 + this) turns. 0: every malformed turn counts. "
        "Training and evaluation run the same loop, so evaluate with the setting you trained with"))
    repair_tool_calls: bool = Field(False, description=(
        "Repair a tool call that does not parse before calling it malformed: unwrap a markdown code fence, "
        "double-quote single-quoted strings and bare keys, drop trailing commas, read `arguments` given as a JSON "
        "string; the repaired call must still pass its schema and counts as degraded (`degraded_calls`). The "
        "sampled tokens are trained on as sampled"))
    difficulty: DifficultyRange = Field(DifficultyRange(), description=(
        "The domain's difficulty levels and its curriculum: the range, the schedule, and the pass rates that "
        "move it (every curriculum setting lives here)"))
    rewards: list[RewardTerm] = Field(default_factory=list, description=(
        "Training reward as a weighted sum of terms, e.g. `[{fn: verifier}, {fn: length, weight: 0.1}, "
        "{fn: mypkg.rewards:polite, weight: 0.5}]`; empty: the verifier's score alone. Each term is logged as "
        "`domain/NAME/term_FN`; `passed` and pass rates stay the verifier's"))
    milestone_reward: float = Field(0.0, ge=0, description=(
        "Shaped reward per milestone of staged verification (the environment's declared milestones, e.g. repo's "
        "reproduced, visible_pass, submitted) that an episode reached, added to the training reward that advantages "
        "use; process milestones pay only beside a progress milestone (assay.envs.milestones). 0: off, the "
        "default, because a shaped reward is a new surface for reward hacking. Hit rates are logged either way; "
        "`passed` and pass rates never include it"))
    env_args: dict[str, Any] = Field({}, description=(
        "Passed to the environment's constructor (e.g. `jsonl`: `path`, `matcher`, `category`)"))
    agent: AgentConfig = Field(AgentConfig(), description=(
        "The agent loop's context handling (mode, memory tool, compaction) and declared fallback tools; training "
        "and evaluation run the same loop, so evaluate with the setting you trained with"))


class MixerConfig(_Strict):
    strategy: Literal["static", "adaptive"] = Field("adaptive", description=(
        "`static`: the domains' normalized weights; `adaptive`: shares move towards learning progress"))
    floor: float = Field(0.1, ge=0, lt=1, description="Adaptive: minimum share of every domain")
    progress_window: int = Field(4, gt=0, description="Steps over which learning progress is measured")
    smoothing: float = Field(0.5, ge=0, le=1, description="Adaptive: how fast ratios move towards the target")
    seesaw_margin: float = Field(0.15, ge=0, le=1, description=(
        "A domain's pass-rate fall by more than this over the progress window, while another's rises by more "
        "(each at an unchanged level), raises a warning"))


class LossConfig(_Strict):
    kind: Literal["grpo", "dr_grpo", "rloo"] = Field("grpo", description="The advantage estimator")
    eps_low: float = Field(0.2, ge=0, description="Clip range below 1 of the importance ratio")
    eps_high: float = Field(0.28, ge=0, description="Clip range above 1 (asymmetric: clip-higher)")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL (k3 estimator) to the starting policy")
    std_normalize: bool = Field(False, description="Divide advantages by their group's std")
    per_domain_normalize: bool = Field(True, description="Rescale each domain's advantages to unit std")
    aggregation: Literal["token", "sequence"] = Field("token", description=(
        "`token`: every token of the batch weighs the same (long answers weigh more); `sequence`: the mean per "
        "sequence, then over sequences (each context segment of a compacted or plan_execute episode is one)"))
    decoupled: bool = Field(False, description=(
        "Decoupled PPO, for stale (async) samples and engine mismatch: clip against the trainer's weights at "
        "arrival (the proximal policy), weight by the truncated importance ratio proximal / behaviour"))
    is_cap: float = Field(2.0, gt=0, description="Decoupled: truncation of that importance weight")


class LoraConfig(_Strict):
    rank: int = Field(0, ge=0, description=(
        "0: full fine-tuning; > 0: LoRA adapters of this rank (peft), the base frozen; rollouts and checkpoints use "
        "the adapters folded into plain weights. Not with `train.sharding: fsdp`"))
    alpha: float = Field(16.0, gt=0, description="The adapters' scale is alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input")
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                      description="Modules that get adapters: the attention and MLP projections")


class TrainConfig(_Strict):
    steps: int = Field(40, gt=0, description="RL steps")
    groups_per_step: int = Field(8, gt=0, description="GRPO groups (tasks) per step")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup over the first optimizer steps, then constant")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clipping")
    micro_batch: int = Field(16, gt=0, description="Trajectories per forward pass; gradients accumulate across "
                                                   "micro-batches")
    updates_per_batch: int = Field(1, gt=0, description="Optimizer steps per rollout batch (> 1: PPO-style reuse)")
    dynamic_sampling: bool = Field(True, description="Drop zero-variance groups (nothing to learn) and refill them "
                                                     "with fresh tasks")
    max_refill_rounds: int = Field(2, ge=0, description="Dynamic sampling: refill rounds per step at most")
    refill_min_yield: float = Field(0.0, ge=0, le=1, description=(
        "Refill only from the domains where at least this share of the step's groups so far had reward variance "
        "(so a kept group costs at most 1 / refill_min_yield refill draws); 0: from every domain"))
    loss: LossConfig = Field(LossConfig(), description="The clipped policy-gradient loss and its advantages")
    selective_logprobs: bool = Field(False, description=(
        "Logits only at the completion tokens, the output head run in recomputed chunks: for real vocabularies "
        "(~150k), where full logits at every position do not fit"))
    shared_prefix: bool = Field(True, description=(
        "With selective_logprobs: the tokens a micro-batch's sequences share before their first completion "
        "token (a group's prompt) run forward once, their keys and values repeated for each sequence; the same "
        "log-probs and gradients for fewer tokens. Not with activation_checkpointing or sharding"))
    activation_checkpointing: bool = Field(False, description=(
        "Recompute each layer's activations in the backward pass: memory for time"))
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters (peft) in place of full fine-tuning")
    ranks: int = Field(1, ge=1, description=(
        "Data-parallel trainer processes (torch.distributed: gloo on the CPU; on CUDA nccl and a GPU per rank, "
        "rank 0 on the model's, refused when fewer are visible); each takes the gradient of its share of every "
        "batch"))
    sharding: Literal["none", "fsdp"] = Field("none", description=(
        "`none`: every rank holds the whole model and optimizer, gradients all-reduced; `fsdp`: each rank holds a "
        "shard of the weights, gradients and optimizer state (torch's `fully_shard` per decoder layer and the "
        "root), the whole weights gathered for the rollout each step and for checkpoints; works with `ranks: 1` "
        "(a world of one); not with `lora.rank` > 0"))
    rank_workers: Literal["process", "ray"] = Field("process", description=(
        "Where ranks 1 .. ranks-1 run: `process`, processes spawned on this machine; `ray`, Ray actors on the "
        "run's cluster (`pipeline.ray`; CPU models only), each asking for `rank_cpus`"))
    rank_cpus: float = Field(1.0, gt=0, description="`rank_workers: ray`: CPUs each rank actor asks for")
    bf16: bool | Literal["auto"] = Field(False, description=(
        "bf16 autocast in the trainer (log-probs stay float32): for a CPU with AMX or AVX512-BF16, or a GPU; without "
        "either it ran 10-20x slower than float32 (docs/architecture.md, Threads). `auto`: on where bf16 matmuls are "
        "fast (a CPU with AMX or AVX512-BF16, a GPU that supports bf16), else off. The rollout stays float32: pair it with `loss.decoupled`, "
        "whose importance weight corrects the trainer/rollout log-prob mismatch (logged as `mismatch`)"))
    checkpoint_every: int = Field(10, gt=0, description="Steps between checkpoints")
    keep_checkpoints: int = Field(2, gt=0, description="How many checkpoints to keep (the newest)")

    @model_validator(mode="after")
    def _sharding_without_lora(self) -> TrainConfig:
        if self.sharding == "fsdp" and self.lora.rank:
            raise ValueError("train.sharding: fsdp with train.lora.rank > 0 is not built (the adapters are folded "
                             "into full weights, which sharded ones are not); LoRA's trainable state is small, "
                             "so use train.sharding: none with LoRA, or train.lora.rank: 0 to shard")
        return self

    @property
    def distributed(self) -> bool:
        """Whether the trainer needs a process group: several ranks, or sharding (even over one)."""
        return self.ranks > 1 or self.sharding == "fsdp"


class SFTConfig(_Strict):
    steps: int = Field(300, ge=0, description="SFT optimizer steps; 0: RL starts from `model.path` as it is")
    batch_size: int = Field(32, gt=0, description="Demonstrations per step")
    lr: float = Field(2e-3, gt=0, description="AdamW peak learning rate")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps, then cosine decay to 0 at `steps`")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clipping")
    micro_batch_tokens: int = Field(1024, ge=0, description=(
        "A batch's gradient is accumulated over length buckets of at most this many padded tokens, so short "
        "examples are not padded to the longest one's length (same loss); 0: the whole batch in one pass"))
    examples_per_domain: int = Field(2000, gt=0, description="Demonstrations generated per domain (training "
                                                             "partition)")
    max_level: int | None = Field(None, ge=1, description=(
        "SFT only on levels up to this one (none: each domain's whole difficulty range), leaving the harder levels "
        "to RL"))
    bf16: bool | Literal["auto"] = Field(False, description=(
        "bf16 autocast in SFT's forward and backward (the loss, weights and optimizer stay float32), as `train.bf16`: "
        "`auto` turns it on where bf16 matmuls are fast (a CPU with AMX or AVX512-BF16, a GPU that supports bf16)"))
    label_noise: float = Field(0.0, ge=0, lt=1, description=(
        "An experiment key: share of demonstrations whose response is another task's (same domain and level), the "
        "label noise of demonstrations gathered from people or weaker models, which a verifier's reward can "
        "correct; no shipped config uses it"))


class VLLMConfig(_Strict):
    block_size: int = Field(32, gt=0, description=(
        "Tokens per KV block (vLLM's CPU attention takes multiples of 32); the cache holds `rollout.kv_cache_mb`"))
    enforce_eager: bool = Field(True, description="No graph capture or compilation: starts in seconds")
    max_model_len: int | None = Field(None, gt=0, description=(
        "The longest sequence vLLM admits (none: the model's max_position_embeddings); vLLM refuses to start when "
        "the KV cache (`rollout.kv_cache_mb`) cannot hold one sequence this long, so lower it for long-context "
        "models"))


class RolloutConfig(_Strict):
    backend: str = Field("engine", description=(
        "`engine`: Assay's own (paged KV cache, prefix cache, continuous batching); `hf`: transformers `generate`; "
        "`vllm`: vLLM in this process (the `vllm` extra, `pip install -e '.[vllm]'`; prefix caching on, the "
        "trainer's weights loaded by version); or the name a plugin registers (`@assay.register_backend`, or the "
        "`assay.rollout_backends` entry-point group)"))
    block_size: int = Field(16, gt=0, description="Engine: tokens per KV block")
    kv_cache_mb: int = Field(512, gt=0, description="KV cache budget in MiB, the engine's and vLLM's")
    max_batched_tokens: int = Field(2048, gt=0, description="Engine: tokens computed per step")
    max_seqs: int = Field(256, gt=0, description="Engine: sequences running at once")
    speculative_tokens: int = Field(0, ge=0, description=(
        "Engine: prompt-lookup speculative decoding (exact acceptance) with drafts of up to this length, each as "
        "long as the verifying steps timed as the engine starts say pays on this machine; 0: off"))
    speculative_max_batch: int = Field(4, gt=0, description="Engine: speculate only while at most this many "
                                                            "sequences run")
    gemm: Literal["auto", "onednn", "torch"] = Field("auto", description=(
        "Engine: the GEMMs' library; `auto` runs float32 on the CPU through oneDNN on prepacked weights (a packed "
        "copy of the weights beside them), and a decode step's few rows on the C kernel's weight panels (one more "
        "copy, made when first needed); `torch` keeps `torch.mm`"))
    weights: Literal["float32", "int8", "bf16", "auto"] = Field("float32", description=(
        "Engine: `int8` runs the layers' linears on weight-only int8 (per output feature, symmetric scales) made "
        "from the float32 weights: a decode step's few rows on the int8 C kernel (a quarter of the bytes read), "
        "more rows on oneDNN with the dequantized weights. `bf16` runs them as bf16 GEMMs on oneDNN (for a CPU with "
        "AMX or AVX512-BF16; 10-20x slower without either), outputs in float32. The LM head stays float32 in both. "
        "`auto`: bf16 where `train.bf16: auto` would be on (a CPU with AMX or AVX512-BF16), else float32. A float32 model on the CPU; the engine "
        "samples every episode of the run with them, its evaluations included, so pair a lossy setting with "
        "`train.loss.decoupled`"))
    warm_up: bool = Field(True, description=(
        "Engine: one throwaway step of `max_batched_tokens` tokens as it starts, so that a step's memory is "
        "allocated once and kept; off saves ~1 s of start-up on a 57M-parameter model, "
        "more on a large one"))
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the trainer recomputes log-probs at it)")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling's probability mass; 1: off")
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens; 0: off")
    verifiers: int = Field(16, ge=1, description=(
        "Finished episodes verified at once (threads); codegen grades the candidates waiting together in one "
        "sandboxed run, so more threads mean larger batches"))
    verifier_processes: int = Field(0, ge=0, description=(
        "Verifier processes of their own for the episodes whose verdict reads only the task and the messages "
        "(tool-less environments: codegen, arith, jsonl); a hung one is killed at the domain's `verify_timeout_s`, "
        "a dead one replaced and its request issued again once; 0: the rollout's threads verify"))
    vllm: VLLMConfig = Field(VLLMConfig(), description="vLLM's own settings, for `rollout.backend: vllm`")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        from assay.rollout.factory import backend_names  # light: no backend is imported to list them

        if name not in backend_names():
            raise ValueError(f"no rollout backend of that name; known backends: {', '.join(backend_names())} (a "
                             "plugin adds one through the 'assay.rollout_backends' entry-point group)")
        return name


class RayConfig(_Strict):
    address: str | None = Field(None, description=(
        "An existing cluster to join; none: a local one is started for the run, with no dashboard, Ray's token "
        "authentication on and a fresh token (Ray's servers listen on every interface)"))
    num_cpus: int | None = Field(None, gt=0, description="A local cluster's CPUs (none: the machine's)")
    rollout_workers: int = Field(1, gt=0, description="Rollout actors a step's tasks are split over (`assay scale` "
                                                      "changes it in a running run)")
    rollout_cpus: float = Field(1.0, ge=0, description=(
        "CPUs each rollout actor asks for, in its placement-group bundle (with `rollout_gpus` 0 and no "
        "`rollout_resources`, above 0)"))
    rollout_gpus: float = Field(0.0, ge=0, description="GPUs each rollout actor asks for, in the same bundle")
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field("pack", description=(
        "How the actors' placement-group bundles lie over the nodes (Ray's strategies): `pack` onto as few nodes "
        "as fit, `spread` over as many, `strict_pack` on one node, `strict_spread` on distinct nodes"))
    placement_wait_s: float | None = Field(None, gt=0, description=(
        "How long a placement group, or an actor added or replaced mid-run, may wait to be placed before it is "
        "refused (none: 120 s); on a cluster with Ray's autoscaler (where a pending placement group is the demand "
        "for nodes), long enough for new nodes to start"))
    verifier_workers: int = Field(0, ge=0, description=(
        "Verifier actors of their own, to which every rollout actor sends its episodes that verify anywhere (as "
        "`rollout.verifier_processes`); Ray restarts one that dies and its calls are issued again (to the rollout "
        "actor itself when none is left); 0: each rollout actor verifies its own (`assay scale` changes it in a "
        "running run)"))
    verifier_cpus: float = Field(1.0, ge=0, description="CPUs each verifier actor asks for")
    rollout_resources: dict[str, float] = Field({}, description=(
        "Custom resources (Ray's `resources`: a node's label, an accelerator kind) each rollout actor asks for "
        "too; amounts > 0; `CPU` and `GPU` have keys of their own"))
    verifier_resources: dict[str, float] = Field({}, description=(
        "Custom resources each verifier actor asks for too, as `rollout_resources`"))

    @model_validator(mode="after")
    def _bundle_holds_something(self) -> RayConfig:
        for key, asked in (("rollout_resources", self.rollout_resources), ("verifier_resources",
                                                                           self.verifier_resources)):
            named = {"CPU", "GPU"} & set(asked)
            if named:
                raise ValueError(f"{key}: {sorted(named)} have keys of their own (rollout_cpus, rollout_gpus, "
                                 "verifier_cpus); custom resources are the cluster's other names")
            if any(v <= 0 for v in asked.values()):
                raise ValueError(f"{key}: every amount must be > 0, got {asked}")
        if self.rollout_cpus == 0 and self.rollout_gpus == 0 and not self.rollout_resources:
            raise ValueError("rollout_cpus: 0 with rollout_gpus: 0 leaves a rollout actor's placement-group bundle "
                             "empty, which Ray cannot reserve; give an actor some CPU (e.g. rollout_cpus: 0.5) or GPU")
        return self


class PipelineConfig(_Strict):
    mode: Literal["sync", "async"] = Field("sync", description=(
        "`sync`, or `async`: sampling runs ahead of training on its own thread (docs/architecture.md)"))
    max_staleness: int = Field(1, ge=0, description=(
        "Async: a batch is sampled with weights at most this many versions old (0: the synchronous schedule)"))
    online: bool = Field(False, description=(
        "Engine: episodes advance on their own (tools and verification overlap generation), every domain in one "
        "batch"))
    workers: Literal["thread", "process", "ray"] = Field("thread", description=(
        "Async: where the rollout (engine, agent loop, tools, verifiers) runs: `thread`, a thread of the trainer's "
        "process (sharing its interpreter); `process`, a process of its own beside it (with the run's thread "
        "count); `ray`, Ray actors on this machine or a cluster. Other than `thread` needs `mode: async`"))
    worker_restarts: int = Field(3, ge=0, description=(
        "Process, ray: how many times a worker that dies, or runs one request past `worker_timeout_s` (hung), is "
        "replaced from the last weights sent and its request issued again"))
    worker_timeout_s: float | None = Field(None, gt=0, description=(
        "Process, ray: seconds one request may run before its worker counts as hung (none: no limit)"))
    ray: RayConfig = Field(RayConfig(), description=(
        "The Ray cluster and its actors, for `pipeline.workers: ray` and `train.rank_workers: ray`"))

    @model_validator(mode="after")
    def _workers_need_async(self) -> PipelineConfig:
        if self.workers != "thread" and self.mode != "async":
            raise ValueError(f"workers: {self.workers} runs the rollout beside training, which needs mode: async "
                             "(max_staleness: 0 keeps the synchronous schedule)")
        return self


class EvalConfig(_Strict):
    tasks_per_domain: int = Field(64, gt=0, description="Held-out tasks per domain")
    n: int = Field(8, gt=0, description="Samples per task (pass@k for every k <= n)")
    seed: int = Field(1_000_003, description=(
        "Seed of the evaluation's task draws and sampling, apart from training's (the tasks come from the "
        "evaluation partition whatever it is)"))
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the evaluation")
    max_turns: int = Field(4, gt=0, description=(
        "Turns per episode of the domains `assay eval --env` builds (a run's domains carry their own `max_turns`): "
        "enough for the tool environments, where a single turn can only call a tool, never read its result"))
    every: int | None = Field(None, ge=0, description=(
        "The loophole watch: during training, evaluate on the evaluation partition every N steps and flag a domain "
        "whose training pass rate rises while its held-out one does not. None: four times a run (runs of 8 steps "
        "or more; a shorter one cannot tell a loophole from noise), 0 with `rollout.backend: vllm`; 0: never"))
    watch_tasks: int = Field(64, gt=0, description="Held-out tasks per domain at each watch evaluation")
    watch_n: int = Field(4, gt=0, description=(
        "Samples per task at each watch evaluation (pass@1 only: its standard error is what matters)"))
    qa_store: str | None = Field(None, description=(
        "The QA store training logs its pass rates per environment version and level to, and where the gate's "
        "passing records are looked for first (none: Assay's home store, `$ASSAY_HOME/envqa` or `~/.assay/envqa`, "
        "which `assay env check` writes and `assay env show` reads; the packaged records are searched last)"))
    loophole_margin: float = Field(0.1, gt=0, description=(
        "A training pass-rate rise this large with no held-out rise is flagged"))


class Config(_Strict):
    name: str = Field("run", description="Run name: the directory under `run_dir`")
    seed: int = Field(0, description="The run's seed: initial weights, tokenizer corpus, task draws, sampling")
    run_dir: str = Field("runs", description="Directory runs are written under")
    threads: int = Field(0, ge=0, description=(
        "Torch threads; 0: measure 1, 2, 4, ... up to the cores this process may use (its CPU affinity capped by "
        "its cgroup's CPU quota) on the model and take the fastest, stopping at the first count slower than the "
        "best so far"))
    model: ModelConfig = Field(ModelConfig(), description=(
        "The policy: a pretrained model to load, or the tiny one built from these keys, and where its weights live"))
    domains: list[DomainConfig] = Field(min_length=1, description=(
        "The domains trained on: each an environment with its own group size, limits, curriculum and reward; "
        "names unique"))
    mixer: MixerConfig = Field(MixerConfig(), description="How each step's groups are shared among the domains")
    rollout: RolloutConfig = Field(RolloutConfig(), description=(
        "Sampling: the backend that generates, its limits, and verification"))
    pipeline: PipelineConfig = Field(PipelineConfig(), description=(
        "How sampling and training are scheduled, and where the rollout runs"))
    train: TrainConfig = Field(TrainConfig(), description="RL training: optimizer, batching, loss, ranks, "
                                                          "checkpoints")
    sft: SFTConfig = Field(SFTConfig(), description=(
        "The supervised cold start on reference solutions (`assay sft`, and the quickstart before RL)"))
    eval: EvalConfig = Field(EvalConfig(), description="Held-out evaluation, and the loophole watch in training")
    allow_unchecked: list[str] = Field(default_factory=list, description=(
        "Environments (name, NAME@VERSION or domain) that may train and be evaluated without a passing QA record; "
        "kept in the run's config and stamped on their trajectories (`reward_info[\"qa_unchecked\"]`)"))
    loggers: Annotated[list[str], AfterValidator(check_loggers)] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Where metrics go besides metrics.jsonl (always written): tensorboard, wandb, mlflow, or a "
                    "sink registered in the assay.loggers entry-point group; [] for metrics.jsonl alone")

    @model_validator(mode="after")
    def _unique_domains(self) -> Config:
        names = [d.name for d in self.domains]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"domain names must be unique, repeated: {sorted(dup)}")
        if self.rollout.backend == "vllm":
            if self.eval.every is None:  # the watch evaluates in the trainer's process, where vLLM cannot: off
                self.eval.every = 0
            in_trainer = self.pipeline.workers == "thread" or self.eval.every > 0  # in-training evaluation is here
            if self.train.distributed and in_trainer:
                raise ValueError("rollout.backend: vllm starts its own torch.distributed group in the process it runs "
                                 "in, where train.ranks > 1 (or train.sharding: fsdp) needs the trainer's; run the "
                                 "rollout in a process of its own (pipeline.mode: async, pipeline.workers: process) "
                                 "without in-training evaluation (eval.every: 0), or use train.ranks: 1 with "
                                 "train.sharding: none")
            if self.pipeline.mode == "async" and self.pipeline.workers == "thread" and self.eval.every > 0:
                raise ValueError("rollout.backend: vllm with the rollout on a thread and eval.every > 0 would run two "
                                 "vLLM engines in one process (vLLM keeps its forward state process-wide); use "
                                 "pipeline.workers: process, or eval.every: 0")
        return self

    @property
    def watch_every(self) -> int:
        """Steps between the loophole watch's held-out evaluations; 0: no watch."""
        if self.eval.every is not None:
            return self.eval.every
        return self.train.steps // 4 if self.train.steps >= 8 else 0


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply `a.b.c=value`; a list element is addressed by index or, for domains, by name."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key.sub=value")
    path, raw = override.split("=", 1)
    keys = path.strip().split(".")
    node: Any = data
    for i, key in enumerate(keys[:-1]):
        where = ".".join(keys[: i + 1])
        if isinstance(node, list):
            node = _list_item(node, key, where)
        else:
            node = node.setdefault(key, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override {path}: {where} is a value, not a section")
    last = keys[-1]
    if isinstance(node, list):
        idx = _list_index(node, last, path)
        node[idx] = _parse_value(raw)
    else:
        node[last] = _parse_value(raw)


def _list_index(items: list[Any], key: str, where: str) -> int:
    if key.isdigit() and int(key) < len(items):
        return int(key)
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("name") == key:
            return i
    raise ConfigError(f"override {where}: no list item {key!r} (use an index or a domain name)")


def _list_item(items: list[Any], key: str, where: str) -> Any:
    return items[_list_index(items, key, where)]


# keys that were renamed, so that a config written for the old name is told the new one
# old key -> new key; `domains.*` stands for any domain
RENAMED = {"sft.warmup": "sft.warmup_steps",  # named as train.warmup_steps is
           # every curriculum setting in one place, the domain's difficulty
           "domains.*.acceptance": "domains[].difficulty.acceptance",
           "domains.*.regression": "domains[].difficulty.regression",
           "mixer.curriculum_window": "domains[].difficulty.window"}
# keys a run config refuses wherever they appear, with the reason: what they would set has no place in training
REFUSED = {name: "RL rollouts never wait for a person, so a run config has no approvals; approve critical tool "
                 "calls where episodes act for real: assay eval --critical-tools a,b [--allow-tools ...] "
                 "[--approvals cli|file:DIR|webhook:URL]"
           for name in ("approvals", "critical_tools", "allow_tools")}


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "config"
    if e["type"] == "extra_forbidden":
        pattern = re.sub(r"^domains\.\d+\.", "domains.*.", loc)
        if pattern in RENAMED:
            return f"config: {loc} is now {RENAMED[pattern]}; move the key there"
        if str(e["loc"][-1]) in REFUSED:
            return f"config: {loc}: {REFUSED[str(e['loc'][-1])]}"
        return f"config: unknown key {loc!r}; check its spelling (see docs/configuration.md)"
    if e["type"] == "missing":
        return f"config: {loc} is required"
    got = e.get("input")
    got_text = f" (got {got!r})" if not isinstance(got, (dict, list)) else ""
    return f"config: {loc}: {e['msg']}{got_text}"


def build_config(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy
    for o in overrides:
        apply_override(data, o)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """A recorded config (a run's config.yaml, written by an earlier Assay) in today's keys: each RENAMED key moved
    where it is now, a value already there kept. Configs a user writes are not migrated: they get RENAMED's
    message, so that the file is fixed once."""
    data = yaml.safe_load(yaml.safe_dump(data))
    domains = [d for d in data.get("domains") or [] if isinstance(d, dict)]
    for old, new in RENAMED.items():
        if old.startswith("domains.*."):
            key = old.removeprefix("domains.*.")
            moves = [(d, d.pop(key)) for d in domains if key in d]
        else:
            *parents, key = old.split(".")
            holder = data
            for part in parents:
                holder = holder.get(part) if isinstance(holder, dict) else None
            if not isinstance(holder, dict) or key not in holder:
                continue
            value = holder.pop(key)
            moves = [(d, value) for d in domains] if new.startswith("domains[].") else [(data, value)]
        for target, value in moves:
            *parents, key = new.removeprefix("domains[].").split(".")
            for part in parents:
                target = target.setdefault(part, {})
            target.setdefault(key, value)
    return data


def load_recorded_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A run's own config.yaml, possibly written by an earlier Assay (see `migrate`)."""
    return build_config(migrate(_read_yaml(Path(path))), overrides)


def _read_yaml(p: Path) -> dict[str, Any]:
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found; pass a YAML file (`assay quickstart --print-config > run.yaml` writes the default one)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config {p}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {p}: the top level must be a mapping of keys, not {type(data).__name__}")
    return data


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    return build_config(_read_yaml(Path(path)), overrides)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
