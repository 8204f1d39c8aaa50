"""Paged KV-cache bookkeeping: fixed-size blocks with reference counts, and a prefix cache.

A block that holds `block_size` computed tokens is indexed by a chained hash of all tokens up to
its end (its parent's hash and its own tokens), so equal prefixes share blocks whatever request
they came from; the tokens are compared on every hit, so a hash collision can never share wrong
K/V. When a sequence finishes, its last, partly filled block is indexed too, by its parent hash
and its tokens: the next turn of a multi-turn session (the same tokens and then more) takes it
over and computes only its new tokens. Freed blocks stay indexed until they are reused, least
recently freed first. The cache holds one weights version: `reset_cache` forgets every entry.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from assay.rollout.engine.sequence import Sequence


@dataclass
class Block:
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and computed
    tokens: tuple[int, ...] = ()  # what `hash` or `partial_key` stands for (checked on every hit)
    partial_key: tuple[int | None, tuple[int, ...]] | None = None


@dataclass
class Match:
    blocks: list[int]
    num_tokens: int
    partial: bool  # the last matched block is partly filled (owned by the taker, not shared)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.blocks = [Block() for _ in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order
        self.by_hash: dict[int, int] = {}
        self.by_partial: dict[tuple[int | None, tuple[int, ...]], int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    # -- prefix cache ---------------------------------------------------------------------------

    def match(self, tokens: list[int]) -> Match:
        """The longest cached prefix of `tokens`, leaving at least one token to compute (a sequence
        needs the logits of its last token)."""
        bs, limit = self.block_size, len(tokens) - 1
        parent: int | None = None
        found: list[int] = []
        while (len(found) + 1) * bs <= limit:
            chunk = tuple(tokens[len(found) * bs : (len(found) + 1) * bs])
            b = self.by_hash.get(hash((parent, chunk)))
            if b is None or self.blocks[b].tokens != chunk:
                break
            found.append(b)
            parent = self.blocks[b].hash
        start = len(found) * bs
        for n in range(min(bs - 1, limit - start), 0, -1):
            b = self.by_partial.get((parent, tuple(tokens[start : start + n])))
            if b is not None:
                return Match(found + [b], start + n, partial=True)
        return Match(found, start, partial=False)

    def admit(self, seq: Sequence) -> int | None:
        """Give a waiting sequence its cached prefix and blocks for all its tokens; None (and no
        change) when the blocks are not there. Returns the number of tokens served from the cache."""
        m = self.match(seq.tokens)
        need = self._blocks_for(len(seq.tokens)) - len(m.blocks)
        reclaimed = sum(1 for b in m.blocks if b in self.free)  # cached but unreferenced: not free to take
        if need > self.num_free - reclaimed:
            return None
        for b in m.blocks:
            self._ref(b)
        if m.partial:  # the taker writes into it: it leaves the index and becomes private
            self._unindex(m.blocks[-1])
        seq.block_table = m.blocks + [self._take() for _ in range(need)]
        seq.num_computed = m.num_tokens
        return m.num_tokens

    def fork(self, leader: Sequence, follower: Sequence) -> tuple[int, int] | None:
        """Share the leader's computed prefix with a follower that has the same tokens: full blocks
        by reference, the partly filled last block by copy. Returns (src, dst) of the block whose
        K/V the caller must copy, (-1, -1) when there is none; None when no block is free."""
        full = leader.num_computed // self.block_size
        partial = leader.num_computed % self.block_size != 0
        if partial and not self.free:
            return None
        for b in leader.block_table[:full]:
            self._ref(b)
        follower.block_table = leader.block_table[:full]
        follower.num_computed = leader.num_computed
        if not partial:
            return (-1, -1)
        dst = self._take()
        follower.block_table.append(dst)
        return leader.block_table[full], dst

    # -- growth and release ---------------------------------------------------------------------

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the block table hold `num_tokens` slots; False (and no change) when blocks run out."""
        need = self._blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            return False
        seq.block_table += [self._take() for _ in range(max(need, 0))]
        return True

    def computed(self, seq: Sequence, num_computed: int) -> None:
        """Record that the first `num_computed` tokens now have K/V; index the blocks that filled up."""
        bs = self.block_size
        for i in range(seq.num_computed // bs, num_computed // bs):
            b = seq.block_table[i]
            parent = self.blocks[seq.block_table[i - 1]].hash if i else None
            chunk = tuple(seq.tokens[i * bs : (i + 1) * bs])
            blk = self.blocks[b]
            if blk.hash is None:
                blk.hash, blk.tokens = hash((parent, chunk)), chunk
                self.by_hash.setdefault(blk.hash, b)
        seq.num_computed = num_computed

    def release(self, seq: Sequence, keep_partial: bool) -> None:
        """Drop the sequence's references. With keep_partial, its partly filled last computed block
        stays findable for a continuation of the same tokens."""
        bs, n = self.block_size, seq.num_computed
        tail = n // bs if keep_partial and n % bs and n // bs < len(seq.block_table) else -1
        for i in reversed(range(len(seq.block_table))):  # the tail is evicted before the prefix
            b = seq.block_table[i]
            blk = self.blocks[b]
            if i == tail and blk.ref_count == 1:
                parent = self.blocks[seq.block_table[i - 1]].hash if i else None
                key = (parent, tuple(seq.tokens[i * bs : n]))
                if key not in self.by_partial:
                    blk.partial_key, blk.tokens = key, key[1]
                    self.by_partial[key] = b
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.free[b] = None
        seq.block_table = []
        seq.num_computed = 0

    def reset_cache(self) -> None:
        """Forget every cached prefix (new weights make the cached K/V stale)."""
        for b in list(self.by_hash.values()) + list(self.by_partial.values()):
            self._unindex(b)
        for blk in self.blocks:
            blk.hash, blk.tokens, blk.partial_key = None, (), None

    # -- internals ------------------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ref(self, b: int) -> None:
        if self.blocks[b].ref_count == 0:
            del self.free[b]
        self.blocks[b].ref_count += 1

    def _take(self) -> int:
        b, _ = self.free.popitem(last=False)
        self._unindex(b)
        blk = self.blocks[b]
        blk.hash, blk.tokens, blk.ref_count = None, (), 1
        return b

    def _unindex(self, b: int) -> None:
        blk = self.blocks[b]
        if blk.hash is not None and self.by_hash.get(blk.hash) == b:
            del self.by_hash[blk.hash]
        if blk.partial_key is not None and self.by_partial.get(blk.partial_key) == b:
            del self.by_partial[blk.partial_key]
        blk.partial_key = None
