from assay.rollout.base import SamplingParams
from assay.rollout.engine.block_manager import BlockManager
from assay.rollout.engine.sequence import Sequence


def seq(tokens, i=0):
    return Sequence(i, list(tokens), len(tokens), SamplingParams(), frozenset(), None)


def run_to_end(bm, s):
    """Admit and mark every token computed, as the engine does after a prefill."""
    cached = bm.admit(s)
    bm.computed(s, len(s.tokens))
    return cached


def test_equal_prefixes_share_full_blocks_and_refcounts_return_to_zero():
    bm = BlockManager(16, 4)
    a, b = seq(range(10), 0), seq(list(range(8)) + [99, 98, 97], 1)
    assert run_to_end(bm, a) == 0
    assert run_to_end(bm, b) == 8  # two full blocks shared
    assert a.block_table[:2] == b.block_table[:2]
    assert [bm.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    bm.release(a, keep_partial=False)
    bm.release(b, keep_partial=False)
    assert bm.num_free == 16 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_a_hash_collision_never_shares_wrong_tokens():
    bm = BlockManager(8, 4)
    a = seq(range(9))
    run_to_end(bm, a)
    first = a.block_table[0]
    bm.release(a, keep_partial=False)
    assert bm.match(list(range(5))).num_tokens == 4
    bm.by_hash[hash((None, (7, 7, 7, 7)))] = first  # forge a colliding entry for other tokens
    assert bm.match([7, 7, 7, 7, 7]).num_tokens == 0


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(8, 4)
    a = seq(range(8))
    run_to_end(bm, a)
    bm.release(a, keep_partial=False)
    assert bm.match(list(range(8))).num_tokens == 4  # all 8 cached, but the last block is recomputed
    assert bm.match(list(range(9))).num_tokens == 8


def test_a_finished_turn_is_continued_from_its_partial_block():
    bm = BlockManager(8, 4)
    turn1 = seq(range(6))
    run_to_end(bm, turn1)
    bm.release(turn1, keep_partial=True)
    turn2 = seq(list(range(6)) + [50, 51, 52])
    assert bm.admit(turn2) == 6  # one full block shared, the partial one taken over
    assert bm.blocks[turn2.block_table[1]].ref_count == 1
    assert bm.match(list(range(6)) + [60]).num_tokens == 4  # taken over: no longer offered to others


def test_least_recently_freed_blocks_are_evicted_first():
    bm = BlockManager(4, 2)
    old, new = seq([1, 2, 3]), seq([5, 6, 7])
    run_to_end(bm, old)
    bm.release(old, keep_partial=False)
    run_to_end(bm, new)
    bm.release(new, keep_partial=False)
    filler = seq([9, 9, 9])
    bm.admit(filler)  # takes two blocks: the oldest freed ones, i.e. `old`'s
    assert bm.match([1, 2, 3]).num_tokens == 0
    assert bm.match([5, 6, 7]).num_tokens == 2


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(8, 4)
    leader, follower = seq(range(6), 0), seq(range(6), 1)
    run_to_end(bm, leader)
    src, dst = bm.fork(leader, follower)
    assert follower.block_table[0] == leader.block_table[0]
    assert src == leader.block_table[1] and dst == follower.block_table[1] and src != dst
    assert follower.num_computed == 6


def test_reserve_refuses_without_changing_anything_and_reset_forgets_the_cache():
    bm = BlockManager(3, 2)
    a = seq(range(5))
    bm.admit(a)
    assert not bm.reserve(a, 7)
    assert len(a.block_table) == 3
    bm.computed(a, 5)
    bm.release(a, keep_partial=True)
    assert bm.match(list(range(6))).num_tokens == 5
    bm.reset_cache()
    assert bm.match(list(range(6))).num_tokens == 0


def _check_invariants(bm, live):
    refs = {}
    for s in live:
        assert len(s.block_table) == len(set(s.block_table)), "a sequence holds a block twice"
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
        bs = bm.block_size
        for i, b in enumerate(s.block_table[: s.num_computed // bs]):  # full computed blocks hold the tokens
            blk = bm.blocks[b]
            assert blk.hash is None or blk.tokens == tuple(s.tokens[i * bs:(i + 1) * bs])
    for b, blk in enumerate(bm.blocks):
        assert blk.ref_count == refs.get(b, 0), f"block {b}: ref_count {blk.ref_count}, held {refs.get(b, 0)} times"
        assert (b in bm.free) == (blk.ref_count == 0)
    for h, b in bm.by_hash.items():
        assert bm.blocks[b].hash == h
    for key, b in bm.by_partial.items():
        assert bm.blocks[b].partial_key == key and bm.blocks[b].tokens == key[1]
    assert bm.num_free + len(refs) == len(bm.blocks)


def test_reference_counts_and_free_list_hold_under_random_operations():
    """Random admit / grow / fork / release / reset sequences: after every operation each block's
    reference count equals the sequences holding it, free blocks are exactly the unreferenced ones,
    and every index entry points at a block that holds what it claims."""
    import random

    for trial in range(40):
        rng = random.Random(trial)
        bm = BlockManager(rng.randint(6, 24), rng.choice([1, 2, 4]))
        prefixes = [[rng.randrange(5) for _ in range(rng.randint(1, 12))] for _ in range(3)]
        live, next_id = [], 0
        for _ in range(300):
            op = rng.random()
            if op < 0.35:  # a new request, often sharing a prefix (or a finished one's whole history)
                base = rng.choice(prefixes + [s.tokens for s in live][:2])
                s = seq(base + [rng.randrange(5) for _ in range(rng.randint(1, 6))], next_id)
                next_id += 1
                if bm.admit(s) is not None:
                    bm.computed(s, len(s.tokens) - 1)  # the engine computes all but what it samples next
                    live.append(s)
            elif op < 0.6 and live:  # a decode step: one more token
                s = rng.choice(live)
                if bm.reserve(s, len(s.tokens) + 1):
                    s.tokens.append(rng.randrange(5))
                    bm.computed(s, len(s.tokens) - 1)
            elif op < 0.75 and live:  # a GRPO sibling forks from a leader
                leader = rng.choice(live)
                f = seq(list(leader.tokens), next_id)
                next_id += 1
                if bm.fork(leader, f) is not None:
                    live.append(f)
            elif op < 0.97 and live:
                s = live.pop(rng.randrange(len(live)))
                bm.release(s, keep_partial=rng.random() < 0.7)
            else:
                bm.reset_cache()
            _check_invariants(bm, live)
        for s in live:
            bm.release(s, keep_partial=True)
        _check_invariants(bm, [])
        assert bm.num_free == len(bm.blocks)
