"""The discrete-event model behind `assay bench cluster`: Assay's RL pipeline at a cluster's shape, run
on durations resampled from a real run (bench/cluster_fit.py).

Service model, per episode inside each rollout worker. A worker is one engine doing continuous
batching: every iteration advances each running sequence by one token and costs
`iteration_s + token_s * (tokens computed in it)`, the law fitted to the engine's own counters. A
worker's decode throughput is thus shared over its concurrent episodes (processor sharing, at most
`max_seqs` at once, the rest queued), and its time for a round is bound both by its total tokens and
by its longest episode: the long tail of generation length is what leaves workers idle at a round's
end, and it grows as the batch is spread thin over many workers. A batch-level model (resampling
whole measured rollout times) cannot see that, nor a worker given more or fewer groups than the
measured one, so it is not used. A joining sequence (a group's prompt, once, or a turn's tool
observation) stalls the worker for its prefill. Tool calls run off the engine (the episode waits, the
batch goes on); a finished episode queues for a verifier of a pool shared by the cluster.

The step schedule is the pipelines' own (pipeline/sync.py, pipeline/async_pipeline.py): a step's
tasks are split into contiguous parts, one per worker; a round (the batch, then each refill) ends
when its last part is verified; the trainer's R ranks take `fixed + variable / R + all-reduce`; sync
runs rollout, training, weight sync and the driver's bookkeeping in turn; async with staleness k
samples step s with the weights of version s-1-k, refills after the mixer saw step s-k, and trains
step s once step s+k's tasks are drawn. With `cores` > 0 the rollout and the trainer share one
machine of that many cores: while both run, the cores are split in proportion to each lane's demand
(the rollout's threads plus its verifier processes, the trainer's threads), as a fair scheduler would.
Deterministic given the seed (random.Random; heapq for the engine's events)."""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace

from assay.bench.cluster_fit import Fit, Group

INF = float("inf")


@dataclass(frozen=True)
class Shape:
    workers: int  # rollout workers (engines)
    verifiers: int  # verifier slots, pooled over the cluster
    ranks: int  # data-parallel trainer ranks
    groups_per_step: int
    max_seqs: int = 256
    refills: bool = True  # dynamic sampling's refill rounds, as often as the measured run needed them
    allreduce_s: float = 0.0  # one gradient all-reduce across many ranks (ring: scaled by 2(R-1)/R)
    cores: int = 0  # > 0: rollout and trainer share a machine of this many cores (this machine's shape)
    rollout_demand: float = 1.0  # cores the rollout lane would keep busy alone (threads + verifier processes)
    train_demand: float = 1.0  # and the trainer's (its threads)

    def overlap_speed(self) -> tuple[float, float]:
        """Each lane's speed while both run, against its speed alone: the cores split in proportion to
        the runnable threads (a fair scheduler), alone each gets min(cores, its demand)."""
        if not self.cores:
            return 1.0, 1.0
        c, r, t = self.cores, self.rollout_demand, self.train_demand
        return min(1.0, c * r / (r + t) / min(c, r)), min(1.0, c * t / (r + t) / min(c, t))


@dataclass(frozen=True)
class Round:
    seconds: float
    worker_busy_s: float  # summed over workers: seconds with a sequence decoding or prefilling
    verify_busy_s: float  # summed over verifier slots


@dataclass(frozen=True)
class StepPlan:
    rounds: tuple[Round, ...]
    train_s: float
    weight_sync_s: float
    driver_s: float
    samples: int  # episodes the step trains on (groups x group size)


@dataclass
class Result:
    mode: str
    wall_s: float
    steps: int
    samples: int
    busy: dict[str, float] = field(default_factory=dict)  # worker kind -> share of its capacity used

    @property
    def steps_per_hour(self) -> float:
        return 3600 * self.steps / self.wall_s if self.wall_s > 0 else INF

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else INF

    def idle(self, kind: str) -> float:
        return 1.0 - self.busy.get(kind, 0.0)


def simulate_worker(groups: list[Group], iteration_s: float, token_s: float, max_seqs: int
                    ) -> tuple[list[tuple[float, float]], float, float]:
    """One engine working through `groups` from time 0: ([(generation done, verify seconds)] per episode,
    busy seconds, the time its last episode left the engine). Virtual time: V counts the tokens each
    running sequence has received, so a sequence's turn ends when V reaches its mark; between events
    the iteration cost is constant, V grows at 1 / (iteration_s + token_s * running)."""
    waiting: deque[tuple[int, float, float]] = deque()  # (episode, tokens of its turn, prefill tokens)
    eps = [e for g in groups for e in g.episodes]
    turn = [0] * len(eps)
    i = 0
    for g in groups:
        for j, e in enumerate(g.episodes):
            waiting.append((i, e.tokens / e.turns, g.prompt if j == 0 else 0.0))
            i += 1
    running: list[tuple[float, int]] = []  # (V at which its turn ends, episode)
    timed: list[tuple[float, int]] = []  # (time, episode) of tool calls that return
    done: list[tuple[float, float]] = []
    t = v = stall = busy = last = 0.0

    def admit() -> None:
        nonlocal stall
        while waiting and len(running) < max_seqs:
            k, tokens, prefill = waiting.popleft()
            stall += token_s * prefill
            heapq.heappush(running, (v + tokens, k))

    def advance(to: float) -> None:
        nonlocal t, v, stall, busy
        dt = to - t
        if running or stall > 0:
            busy += dt
        s = min(stall, dt)
        stall -= s
        cost = iteration_s + token_s * len(running)
        if running and cost > 0:
            v += (dt - s) / cost
        t = to

    admit()
    while running or timed:
        cost = iteration_s + token_s * len(running)
        at = t + stall + max(0.0, running[0][0] - v) * cost if running else INF
        if timed and timed[0][0] <= at:
            when, k = heapq.heappop(timed)
            advance(max(t, when))
            e = eps[k]
            waiting.append((k, e.tokens / e.turns, e.observed / (e.turns - 1)))
        else:
            advance(at)
            _, k = heapq.heappop(running)
            last = t
            e = eps[k]
            turn[k] += 1
            if turn[k] < e.turns:  # its tool calls run off the engine, then the next turn joins
                heapq.heappush(timed, (t + e.tool_s / (e.turns - 1), k))
            else:
                done.append((t + (e.tool_s if e.turns == 1 else 0.0), e.verify_s))
        admit()
    return done, busy, last


def verify_pool(arrivals: list[tuple[float, float]], slots: int) -> tuple[float, float]:
    """First come, first served on `slots` verifiers: (when the last verification ends, busy seconds)."""
    free = [0.0] * max(1, slots)
    end = busy = 0.0
    for at, seconds in sorted(arrivals):
        start = max(at, heapq.heappop(free))
        heapq.heappush(free, start + seconds)
        end, busy = max(end, start + seconds), busy + seconds
    return end, busy


def simulate_round(groups: list[Group], shape: Shape, fit: Fit) -> Round:
    """A rollout round over the cluster: groups split into contiguous parts, one per worker."""
    n, arrivals = shape.workers, []
    q, r = divmod(len(groups), n)
    end = busy = 0.0
    start = 0
    for w in range(min(n, len(groups))):
        part = groups[start:start + q + (w < r)]
        start += len(part)
        done, b, last = simulate_worker(part, fit.iteration_s, fit.token_s, shape.max_seqs)
        arrivals += done
        busy, end = busy + b, max(end, last)
    vend, vbusy = verify_pool(arrivals, shape.verifiers)
    return Round(max(0.0, max(end, vend) + fit.round_residual_s), busy, vbusy)


def _draw(rng: random.Random, pools: dict[str, list[Group]], like: tuple[Group, ...], count: int) -> list[Group]:
    """`count` groups in the domain proportions of the measured round `like` (the mixer's ratios then),
    each drawn from every measured group of its domain; largest remainders round the shares."""
    mix = Counter(g.domain for g in like)
    exact = {d: count * n / len(like) for d, n in mix.items()}
    counts = {d: int(x) for d, x in exact.items()}
    for d in sorted(exact, key=lambda d: counts[d] - exact[d])[:count - sum(counts.values())]:
        counts[d] += 1
    drawn = [rng.choice(pools[d]) for d in sorted(counts) for _ in range(counts[d])]
    rng.shuffle(drawn)  # the mixer's draws interleave domains; parts per worker take contiguous runs
    return drawn


def plan_steps(fit: Fit, shape: Shape, steps: int, seed: int) -> list[StepPlan]:
    """`steps` steps, each resampling one measured step (its refill rounds, train time, weight sync,
    driver time) and, for its rounds, groups from every measured group, in that step's domain mix."""
    rng = random.Random(seed)
    g, g0 = shape.groups_per_step, fit.groups_per_step
    pools: dict[str, list[Group]] = {}
    for group in fit.groups:
        pools.setdefault(group.domain, []).append(group)
    plans = []
    for _ in range(steps):
        rec = rng.choice(fit.steps)
        rounds = []
        for k, share in enumerate(rec.rounds if shape.refills else rec.rounds[:1]):
            count = g if k == 0 else round(share * g)
            if count:
                rounds.append(simulate_round(_draw(rng, pools, rec.round_groups[k], count), shape, fit))
        fixed = fit.train_fixed_s if fit.train_linear else 0.0
        ring = 2 * (shape.ranks - 1) / shape.ranks * shape.allreduce_s
        train = fixed + max(0.0, rec.train_s - fixed) * g / g0 / shape.ranks + ring
        plans.append(StepPlan(tuple(rounds), train, rec.weight_sync_s, rec.driver_s, g * fit.group_size))
    return plans


def calibrate(fit: Fit) -> Fit:
    """The fit with `round_residual_s` set: per round, the mean of what the measured rollout took beyond
    what the model gives for that step's own groups at the run's own shape (Python around the engine,
    task setup, result passing). Carried unchanged to other shapes."""
    shape = Shape(workers=fit.rollout_workers, verifiers=fit.verifiers * fit.rollout_workers, ranks=1,
                  groups_per_step=fit.groups_per_step, max_seqs=fit.max_seqs)
    bare = replace(fit, round_residual_s=0.0)
    gaps = [(s.rollout_s - sum(simulate_round(list(gs), shape, bare).seconds for gs in s.round_groups))
            / len(s.round_groups) for s in fit.steps]
    return replace(fit, round_residual_s=sum(gaps) / len(gaps))


# -- the schedule: two lanes (rollout, trainer) of work items, sharing cores when colocated ----------

Work = tuple[float, dict[str, float]]  # (seconds at full speed, worker kind -> share of it kept busy)
Lane = Generator[Callable[[], bool] | Work, None, None]  # yields a condition to wait for, or work


def run_schedule(plans: list[StepPlan], shape: Shape, k: int | None) -> Result:
    """Wall time of the planned steps: `k` None is the synchronous pipeline, else async with staleness k."""
    n = len(plans)
    state = {"trained": 0, "seen": 0, "drawn": 0}
    ready: set[int] = set()

    def round_work(r: Round) -> Work:
        s = r.seconds or 1e-12
        return r.seconds, {"rollout": r.worker_busy_s / (shape.workers * s),
                           "verifier": r.verify_busy_s / (shape.verifiers * s)}

    def sync_lane() -> Lane:
        for p in plans:
            for r in p.rounds:
                yield round_work(r)
            yield p.train_s, {"trainer": 1.0}
            yield p.weight_sync_s, {"rollout": 1.0}  # sync.py: update_weights after the trainer step
            yield p.driver_s, {}

    def rollout_lane(k: int) -> Lane:
        loaded = 0
        for s, p in enumerate(plans, 1):
            version = max(0, s - 1 - k)
            yield lambda v=version: state["trained"] >= v
            state["drawn"] = s
            if version != loaded:
                yield p.weight_sync_s, {"rollout": 1.0}
                loaded = version
            for i, r in enumerate(p.rounds):
                if i and k:  # a refill waits for the mixer to have seen step s - k
                    yield lambda s=s: state["seen"] >= s - k
                yield round_work(r)
            ready.add(s)
        state["drawn"] = n + 1

    def trainer_lane(k: int) -> Lane:
        for s, p in enumerate(plans, 1):
            yield lambda s=s: s in ready and state["drawn"] >= min(s + k, n + 1)
            state["seen"] = s
            yield p.train_s, {"trainer": 1.0}
            yield p.driver_s, {}
            state["trained"] = s

    lanes = [sync_lane()] if k is None else [rollout_lane(k), trainer_lane(k)]
    shared = shape.overlap_speed() if len(lanes) > 1 else (1.0,)
    work: list[list[float] | None] = [None] * len(lanes)  # [remaining seconds] per lane
    shares: list[dict[str, float]] = [{} for _ in lanes]
    waits: list[Callable[[], bool] | None] = [None] * len(lanes)
    alive = [True] * len(lanes)
    busy: dict[str, float] = {}
    t = 0.0
    while True:
        progressed = True
        while progressed:  # resume every lane whose wait is over, until none can move
            progressed = False
            for i, lane in enumerate(lanes):
                while alive[i] and work[i] is None and (waits[i] is None or waits[i]()):
                    waits[i] = None
                    progressed = True
                    try:
                        item = next(lane)
                    except StopIteration:
                        alive[i] = False
                        break
                    if callable(item):
                        waits[i] = item
                    elif item[0] > 0:
                        work[i], shares[i] = [item[0]], item[1]
        active = [i for i in range(len(lanes)) if work[i] is not None]
        if not active:
            if any(alive):
                raise RuntimeError("bench cluster: the schedule deadlocked (a bug in the model)")
            break
        rate = [shared[i] if len(active) > 1 else 1.0 for i in range(len(lanes))]
        dt = min(work[i][0] / rate[i] for i in active)
        t += dt
        for i in active:
            for kind, share in shares[i].items():
                busy[kind] = busy.get(kind, 0.0) + dt * share
            work[i][0] -= dt * rate[i]
            if work[i][0] <= 1e-12:
                work[i] = None
    mode = "sync" if k is None else f"async k={k}"
    return Result(mode, t, n, sum(p.samples for p in plans), {kind: b / t for kind, b in busy.items()} if t else {})
