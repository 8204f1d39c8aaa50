"""Run configuration: YAML validated by pydantic, with `key.sub=value` overrides.

Every error is one line naming the key path and what is allowed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from assay.core.errors import ConfigError
from assay.core.loggers import check_loggers


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    path: str | None = None  # a local Hugging Face model directory or .gguf file; None: build from the fields below
    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(384, gt=0)
    max_position: int = Field(1024, gt=0)
    vocab_size: int = Field(1024, ge=300)  # the locally trained byte-level BPE tokenizer's size
    tokenizer_corpus: int = Field(2000, gt=0)  # generated tasks per domain to train the tokenizer on
    # where and how the policy, the reference model and the engine hold their weights
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # sdpa by default: no slower than eager for the tiny built models (docs/architecture.md, Threads)
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    # variables for the tokenizer's chat template wherever a prompt or turn layout is rendered, e.g.
    # {enable_thinking: false} for Qwen3's non-thinking mode (core.chat_format.set_template_kwargs)
    chat_template_kwargs: dict[str, Any] = {}

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        return self


class DifficultyRange(_Strict):
    min: int = 1
    max: int = 4
    start: int = 1
    review: float = Field(0.0, ge=0, lt=1)  # share of tasks drawn from the levels below the current one
    # curriculum: start at `start`, promote and demote on the rolling pass rate; uniform: every level
    # of [min, max] in equal parts for the whole run (the levels evaluation samples)
    schedule: Literal["curriculum", "uniform"] = "curriculum"

    def levels(self, available: Sequence[int]) -> list[int]:
        """The environment's levels that fall in this range."""
        return [d for d in available if self.min <= d <= self.max]

    @model_validator(mode="after")
    def _order(self) -> DifficultyRange:
        if not self.min <= self.start <= self.max:
            raise ValueError(f"need min <= start <= max, got {self.min}, {self.start}, {self.max}")
        return self


class RewardTerm(_Strict):
    fn: str  # verifier | format | length | package.module:function (see assay.envs.rewards)
    weight: float = 1.0


class DomainConfig(_Strict):
    name: str
    env: str  # name or name@version in the environment registry
    weight: float = Field(1.0, ge=0)
    group_size: int = Field(8, ge=2)
    max_new_tokens: int = Field(64, gt=0)  # per assistant turn
    max_turns: int = Field(1, gt=0)
    max_context: int = Field(512, gt=0)
    # wall-clock budget of one episode in seconds, checked after each turn (None: no limit); an episode
    # past it stops acting and is verified as it stands, like one that ran out of turns
    time_limit_s: float | None = Field(None, gt=0)
    # a verification past this many seconds gives its episode an infrastructure status (never a reward)
    verify_timeout_s: float = Field(120.0, gt=0)
    difficulty: DifficultyRange = DifficultyRange()
    # training reward as a weighted sum of terms (empty: the verifier's score alone); `passed` stays the verifier's
    rewards: list[RewardTerm] = Field(default_factory=list)
    acceptance: float = Field(0.8, gt=0, le=1)  # rolling pass rate that promotes difficulty
    regression: float = Field(0.3, ge=0, lt=1)  # rolling pass rate below which difficulty drops
    env_args: dict[str, Any] = {}  # passed to the environment's constructor (e.g. jsonl's path)


class MixerConfig(_Strict):
    strategy: Literal["static", "adaptive"] = "adaptive"
    floor: float = Field(0.1, ge=0, lt=1)  # adaptive: minimum share of any domain
    progress_window: int = Field(4, gt=0)  # steps over which learning progress is measured
    smoothing: float = Field(0.5, ge=0, le=1)  # adaptive: how fast ratios move towards the target
    curriculum_window: int = Field(32, gt=0)  # trajectories in a domain's rolling pass rate
    seesaw_margin: float = Field(0.15, ge=0, le=1)


class LossConfig(_Strict):
    kind: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.28, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    std_normalize: bool = False
    per_domain_normalize: bool = True
    aggregation: Literal["token", "sequence"] = "token"
    # decoupled PPO: clip against the trainer's weights at arrival (the proximal policy), weight by the
    # truncated importance ratio proximal / behaviour; for stale (async) samples and engine mismatch
    decoupled: bool = False
    is_cap: float = Field(2.0, gt=0)  # truncation of that importance weight


class LoraConfig(_Strict):
    rank: int = Field(0, ge=0)  # 0: full fine-tuning; > 0: LoRA adapters of this rank (peft), the base frozen
    alpha: float = Field(16.0, gt=0)  # the adapters' scale is alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TrainConfig(_Strict):
    steps: int = Field(40, gt=0)
    groups_per_step: int = Field(8, gt=0)
    lr: float = Field(3e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)  # linear LR warmup over the first optimizer steps
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch: int = Field(16, gt=0)  # trajectories per forward; gradients accumulate across
    updates_per_batch: int = Field(1, gt=0)  # optimizer steps per rollout batch (>1: PPO-style reuse)
    dynamic_sampling: bool = True  # drop zero-variance groups and refill
    max_refill_rounds: int = Field(2, ge=0)
    # refills only from the domains where at least this share of the step's groups so far had reward
    # variance (so a kept group costs at most 1 / refill_min_yield refill draws); 0: from every domain
    refill_min_yield: float = Field(0.0, ge=0, le=1)
    loss: LossConfig = LossConfig()
    # logits only at the completion tokens, the output head run in recomputed chunks: for real
    # vocabularies (~150k), where full logits at every position do not fit
    selective_logprobs: bool = False
    activation_checkpointing: bool = False  # recompute each layer's activations in backward: memory for time
    lora: LoraConfig = LoraConfig()
    ranks: int = Field(1, ge=1)  # data-parallel trainer processes (torch.distributed: gloo on the CPU, nccl on CUDA)
    # none: every rank holds the whole model and optimizer (gradients all-reduced); fsdp: each rank holds
    # a shard of them (torch's fully_shard per decoder layer and the root), with ranks: 1 a world of one
    sharding: Literal["none", "fsdp"] = "none"
    # where ranks 1 .. ranks-1 run: processes spawned on this machine, or Ray actors on the run's
    # cluster (pipeline.ray), each asking for rank_cpus
    rank_workers: Literal["process", "ray"] = "process"
    rank_cpus: float = Field(1.0, gt=0)
    bf16: bool = False
    checkpoint_every: int = Field(10, gt=0)
    keep_checkpoints: int = Field(2, gt=0)

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
    steps: int = Field(300, ge=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(2e-3, gt=0)
    warmup: int = Field(20, ge=0)  # linear warmup steps, then cosine decay to 0 at `steps`
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    # A batch's gradient is accumulated over length buckets of at most this many padded tokens, so short
    # examples are not padded to the longest one's length (same loss; 0: the whole batch in one pass).
    micro_batch_tokens: int = Field(1024, ge=0)
    examples_per_domain: int = Field(2000, gt=0)
    max_level: int | None = Field(None, ge=1)  # SFT only on levels <= this (None: the domain's whole range)
    # Share of demonstrations whose response is another task's (same domain and level): the label noise
    # of demonstrations gathered from people or weaker models, which a verifier's reward can correct.
    label_noise: float = Field(0.0, ge=0, lt=1)


class VLLMConfig(_Strict):
    # tokens per KV block (vLLM's CPU attention takes multiples of 32); the cache holds rollout.kv_cache_mb
    block_size: int = Field(32, gt=0)
    enforce_eager: bool = True  # no graph capture or compilation: starts in seconds
    # the longest sequence vLLM admits (none: the model's max_position_embeddings); vLLM refuses to start when
    # the KV cache (rollout.kv_cache_mb) cannot hold one sequence this long, so lower it for long-context models
    max_model_len: int | None = Field(None, gt=0)


class RolloutConfig(_Strict):
    # engine: Assay's own (paged KV, prefix cache); hf: transformers generate; vllm: vLLM in this process
    # (the optional extra `pip install -e '.[vllm]'`, prefix caching on, the trainer's weights loaded by version)
    backend: Literal["engine", "hf", "vllm"] = "engine"
    block_size: int = Field(16, gt=0)  # engine: tokens per KV block
    kv_cache_mb: int = Field(512, gt=0)  # engine: KV cache budget
    max_batched_tokens: int = Field(2048, gt=0)  # engine: tokens computed per step
    max_seqs: int = Field(256, gt=0)  # engine: sequences running at once
    speculative_tokens: int = Field(0, ge=0)  # engine: prompt-lookup draft length (0: off)
    speculative_max_batch: int = Field(4, gt=0)  # engine: speculate only while this few sequences run
    # engine: the GEMMs' library; auto takes oneDNN on prepacked weights where it runs (float32 on the
    # CPU; a packed copy of the weights beside them), torch keeps torch.mm
    gemm: Literal["auto", "onednn", "torch"] = "auto"
    # engine: one throwaway step of max_batched_tokens tokens as it starts (the heap grows to a step's
    # peak once; ~1 s on the rollout bench's 57M-parameter model, more for a large model on the CPU)
    warm_up: bool = True
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    verifiers: int = Field(16, ge=1)  # finished episodes verified at once (threads; codegen grades those waiting
    # together in one sandboxed run, so more threads mean larger batches: 16 against 4, 1.17x the sync pipeline)
    # processes of their own that verify episodes whose verdict reads only the task and the messages (0: the
    # rollout's threads do); a hung one is killed at the domain's verify_timeout_s, a dead one replaced
    verifier_processes: int = Field(0, ge=0)
    vllm: VLLMConfig = VLLMConfig()


class RayConfig(_Strict):
    address: str | None = None  # an existing cluster to join; none starts a local one for the run
    num_cpus: int | None = Field(None, gt=0)  # a local cluster's CPUs (none: the machine's)
    rollout_workers: int = Field(1, gt=0)  # actors a step's tasks are split over
    rollout_cpus: float = Field(1.0, ge=0)  # resources each rollout actor asks for: one placement-group bundle
    rollout_gpus: float = Field(0.0, ge=0)
    # how a placement group lays out its bundles over the nodes (Ray's strategies): pack onto as few
    # nodes as fit, spread over as many, strict_pack on one node, strict_spread on distinct nodes
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    # how long a placement group or an added or replaced actor may wait to be placed before it is refused
    # (none: 120 s); on a cluster with Ray's autoscaler, long enough for new nodes to start
    placement_wait_s: float | None = Field(None, gt=0)
    # verifier actors of their own, shared by the rollout actors (0: each rollout actor verifies, on its
    # threads or rollout.verifier_processes); each asks for verifier_cpus
    verifier_workers: int = Field(0, ge=0)
    verifier_cpus: float = Field(1.0, ge=0)
    # custom resources (Ray's `resources`: a node's label, an accelerator kind) each actor asks for too
    rollout_resources: dict[str, float] = {}
    verifier_resources: dict[str, float] = {}

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
    mode: Literal["sync", "async"] = "sync"  # async: sampling runs ahead of training on its own thread
    max_staleness: int = Field(1, ge=0)  # async: batches sampled with weights at most this many versions old
    online: bool = False  # engine: episodes advance on their own, every domain in one batch
    # async: where the rollout runs; a thread of the trainer's process (sharing its interpreter), a
    # process of its own (generation, tools and verification beside training, with the run's thread
    # count), or Ray actors (`ray`, on this machine or a cluster)
    workers: Literal["thread", "process", "ray"] = "thread"
    # process, ray: a worker that dies, or runs one request past the timeout (hung), is replaced this
    # often and its request re-issued
    worker_restarts: int = Field(3, ge=0)
    worker_timeout_s: float | None = Field(None, gt=0)
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _workers_need_async(self) -> PipelineConfig:
        if self.workers != "thread" and self.mode != "async":
            raise ValueError(f"workers: {self.workers} runs the rollout beside training, which needs mode: async "
                             "(max_staleness: 0 keeps the synchronous schedule)")
        return self


class EvalConfig(_Strict):
    tasks_per_domain: int = Field(64, gt=0)
    n: int = Field(8, gt=0)  # samples per task
    seed: int = 1_000_003  # held-out: disjoint from training seeds
    temperature: float = Field(1.0, gt=0)
    # `assay eval --env` builds its domains with these (a run's domains carry their own): enough turns
    # for the tool environments, where a single turn can only call a tool, never read its result
    max_turns: int = Field(4, gt=0)
    # the loophole watch: during training, evaluate on the evaluation partition every N steps and flag a
    # domain whose training pass rate rises while its held-out one does not. None: four times a run (runs of
    # 8 steps or more; a shorter one cannot tell a loophole from noise); 0: never
    every: int | None = Field(None, ge=0)
    watch_tasks: int = Field(64, gt=0)  # held-out tasks per domain at each watch evaluation
    watch_n: int = Field(4, gt=0)  # samples per task there (pass@1 only: its standard error is what matters)
    qa_store: str | None = None  # training's pass rates per env version and level go here; None: RUN/envqa
    loophole_margin: float = Field(0.1, gt=0)  # a training rise this large with no held-out rise is flagged


class Config(_Strict):
    name: str = "run"
    seed: int = 0
    run_dir: str = "runs"
    threads: int = Field(0, ge=0)  # torch threads; 0 = choose by measuring
    model: ModelConfig = ModelConfig()
    domains: list[DomainConfig] = Field(min_length=1)
    mixer: MixerConfig = MixerConfig()
    rollout: RolloutConfig = RolloutConfig()
    pipeline: PipelineConfig = PipelineConfig()
    train: TrainConfig = TrainConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    # environments (name, NAME@VERSION or domain) that may train and be evaluated without a passing QA
    # record; kept in the run's config and stamped on their trajectories (reward_info["qa_unchecked"])
    allow_unchecked: list[str] = Field(default_factory=list)
    loggers: Annotated[list[str], AfterValidator(check_loggers)] = Field(
        default_factory=lambda: ["tensorboard"],
        description="where metrics go besides metrics.jsonl (always written): tensorboard, wandb, mlflow, or a "
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


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "config"
    if e["type"] == "extra_forbidden":
        return f"config: unknown key {loc!r}; check its spelling (see README, Configuration)"
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


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    p = Path(path)
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
    return build_config(data, overrides)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
