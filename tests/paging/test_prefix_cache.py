"""Prefix caching, eviction and swapping: white-box scenarios with exact block ids and orders."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from helpers import internals, random_array

import cupaged
from cupaged import CupagedError, OutOfBlocksError, PagedCache

BS = 4
LAYERS, HEADS, DIM = 2, 2, 64  # head_dim 64: the smallest the attention kernel takes


def make_cache(num_blocks=8, **kwargs):
    return PagedCache(num_blocks, block_size=BS, num_layers=LAYERS, num_kv_heads=HEADS,
                      head_dim=DIM, dtype="float32", device="cpu", enable_prefix_caching=True,
                      **kwargs)  # fmt: skip


def prefix_kv(tokens, start=0, salt=b""):
    """K/V of positions start.. as a model makes them: a function of the whole prefix."""
    ks, vs = [], []
    for p in range(start, len(tokens)):
        seed = hashlib.sha256(salt + np.asarray(tokens[: p + 1], np.int64).tobytes()).digest()
        rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
        ks.append(rng.standard_normal((LAYERS, HEADS, DIM), dtype=np.float32))
        vs.append(rng.standard_normal((LAYERS, HEADS, DIM), dtype=np.float32))
    shape = (LAYERS, 0, HEADS, DIM)
    stack = lambda xs: np.stack(xs, axis=1) if xs else np.zeros(shape, np.float32)  # noqa: E731
    return stack(ks), stack(vs)


def add(cache, prompt, salt=None):
    """Admit a prompt: attach cached blocks, compute and append the rest."""
    sid = cache.add_sequence(tokens=prompt, cache_salt=salt)
    n = cache.num_cached_tokens(sid)
    salt_bytes = salt.encode() if salt else b""
    cache.append(sid, *prefix_kv(prompt, n, salt_bytes), tokens=prompt[n:])
    return sid


def assert_kv(cache, sid, tokens, salt=b""):
    k, v = cache.gather_kv(sid)
    want_k, want_v = prefix_kv(tokens, 0, salt)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)


PROMPT = list(range(10))  # blocks [0-3] [4-7] [8 9 . .]


def test_two_requests_share_a_prompt_then_a_third_evicts_and_a_fourth_revives():
    cache = make_cache(num_blocks=6)
    a = add(cache, PROMPT)
    assert cache.block_table(a) == [0, 1, 2]
    assert cache.num_cached_tokens(a) == 0
    stats = cache.prefix_cache_stats
    assert (stats.hits, stats.misses, stats.cached_tokens) == (0, 2, 0)

    b_prompt = PROMPT[:8] + [100, 101, 102]
    b = add(cache, b_prompt)  # blocks 0 and 1 are cached; the rest is computed
    assert cache.num_cached_tokens(b) == 8
    assert cache.block_table(b) == [0, 1, 3]
    assert [cache.refcount(x) for x in range(4)] == [2, 2, 1, 1]
    stats = cache.prefix_cache_stats
    assert (stats.hits, stats.misses, stats.cached_tokens) == (2, 2, 8)
    assert_kv(cache, b, b_prompt)
    cache.check_invariants()

    cache.free(a)  # block 2 was never full: plain free; blocks 0, 1 are still b's
    cache.free(b)  # last block first: 3 (partial) free, then 1, then 0 evictable
    assert cache.pool.evictable_blocks() == [1, 0]
    assert cache.num_free_blocks == 6
    cache.check_invariants()

    c = add(cache, [50 + i for i in range(17)])  # 5 blocks: free 3, 2, 4, 5, then evict 1
    assert cache.block_table(c) == [3, 2, 4, 5, 1]
    assert cache.prefix_cache_stats.evictions == 1
    assert cache.pool.evictable_blocks() == [0]
    cache.check_invariants()

    d = cache.add_sequence(tokens=PROMPT)  # block 0 (tokens 0-3) is still cached: revived
    assert cache.num_cached_tokens(d) == 4
    assert cache.block_table(d) == [0]
    assert cache.pool.evictable_blocks() == []
    cache.check_invariants()


def test_the_block_holding_the_last_prompt_token_is_never_attached():
    cache = make_cache()
    a = add(cache, PROMPT[:8])  # two full blocks, both registered
    again = cache.add_sequence(tokens=PROMPT[:8])
    assert cache.num_cached_tokens(again) == 4  # block 1 holds the last token: recompute it
    longer = cache.add_sequence(tokens=PROMPT[:9])
    assert cache.num_cached_tokens(longer) == 8
    assert cache.block_table(longer) == cache.block_table(a)
    cache.check_invariants()


def test_salts_isolate_tenants():
    cache = make_cache(num_blocks=12)
    add(cache, PROMPT, salt="tenant-a")
    b = cache.add_sequence(tokens=PROMPT, cache_salt="tenant-b")
    assert cache.num_cached_tokens(b) == 0
    c = cache.add_sequence(tokens=PROMPT, cache_salt="tenant-a")
    assert cache.num_cached_tokens(c) == 8
    d = cache.add_sequence(tokens=PROMPT)
    assert cache.num_cached_tokens(d) == 0
    cache.check_invariants()


def test_a_forced_hash_collision_is_caught_by_the_token_check():
    def colliding(parent: bytes, tokens) -> bytes:  # every block with the same first token collides
        return b"collide-%d" % tokens[0]

    cache = make_cache(block_hasher=colliding)
    add(cache, PROMPT)
    other = [0, 99, 98, 97, 4, 5, 6, 7, 8]  # same key as PROMPT's first block, other tokens
    sid = cache.add_sequence(tokens=other)
    assert cache.num_cached_tokens(sid) == 0
    assert cache.prefix_cache_stats.hits == 0
    cache.append(sid, *prefix_kv(other), tokens=other)
    assert_kv(cache, sid, other)
    assert cache.block_table(sid)[0] != 0  # the colliding key stays with the first writer
    cache.check_invariants()


def test_attention_over_cached_blocks_equals_attention_from_scratch(rng):
    shared = list(range(40))
    cached_cache, fresh_cache = make_cache(num_blocks=40), make_cache(num_blocks=40)
    add(cached_cache, shared + [7, 7, 7])
    prompt = shared + [1, 2, 3, 4, 5]
    hit = add(cached_cache, prompt)
    assert cached_cache.num_cached_tokens(hit) == 40
    fresh = add(fresh_cache, prompt)
    assert fresh_cache.num_cached_tokens(fresh) == 0
    assert cached_cache.block_table(hit) != fresh_cache.block_table(fresh)
    q = random_array(rng, (1, 4, DIM), "float32")
    for layer in range(LAYERS):
        outs = []
        for cache, sid in ((cached_cache, hit), (fresh_cache, fresh)):
            tables, lens = cache.block_tables([sid])
            outs.append(cupaged.paged_attention(q, cache.k[layer], cache.v[layer], tables, lens))
        np.testing.assert_array_equal(outs[0], outs[1])


def test_tokens_are_required_with_prefix_caching_and_checked_without(rng):
    cache = make_cache()
    sid = cache.add_sequence(tokens=[1, 2])
    k, v = prefix_kv([1, 2, 3], 2)
    with pytest.raises(ValueError, match="expected tokens="):
        cache.append(sid, k, v)
    with pytest.raises(ValueError, match=r"expected 1 token ids \(one per new token\), got 2"):
        cache.append(sid, k, v, tokens=[3, 4])
    with pytest.raises(TypeError, match="expected tokens to be a 1-D sequence of int token ids"):
        cache.append(sid, k, v, tokens=[3.5])
    with pytest.raises(ValueError, match="expected tokens="):
        cache.reserve([sid], 1)
    assert cache.seq_len(sid) == 0
    cache.check_invariants()
    # Without prefix caching tokens= is accepted (so callers need no branch), checked, unused.
    plain = PagedCache(4, block_size=BS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                       dtype="float32", device="cpu")  # fmt: skip
    other = plain.add_sequence(tokens=[1], cache_salt="tenant")
    assert plain.num_cached_tokens(other) == 0 and plain.seq_len(other) == 0
    plain.append(other, k[:, :1], v[:, :1], tokens=[3])
    with pytest.raises(ValueError, match=r"expected 1 token ids \(one per new token\), got 2"):
        plain.append(other, k[:, :1], v[:, :1], tokens=[3, 4])
    assert plain.seq_len(other) == 1
    plain.check_invariants()
    with pytest.raises(ValueError, match="block_hasher= needs enable_prefix_caching=True"):
        PagedCache(4, head_dim=DIM, device="cpu", block_hasher=lambda p, t: b"")


# ------------------------------------------------------------------------------------ swapping


def test_swap_out_fill_free_swap_in_round_trip():
    cache = make_cache(num_blocks=8)
    prompt = list(range(14))
    sid = add(cache, prompt)
    child = cache.fork(sid)  # shares all 4 blocks
    k_before, v_before = cache.gather_kv(sid)
    cache.swap_out(sid)
    assert cache.is_swapped(sid) and cache.seq_len(sid) == 14
    assert cache.num_free_blocks == 4  # the child still holds the shared blocks
    cache.check_invariants()
    for call in (lambda: cache.block_table(sid), lambda: cache.block_tables([sid]),
                 lambda: cache.fork(sid), lambda: cache.reserve([sid], 1, tokens=[[1]]),
                 lambda: cache.gather_kv(sid), lambda: cache.swap_out(sid)):  # fmt: skip
        with pytest.raises(CupagedError, match=f"sequence {sid} is swapped out"):
            call()

    others = [add(cache, [200 + i] * 8) for i in range(2)]  # fills the pool
    assert cache.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError):
        cache.swap_in(sid)
    assert cache.is_swapped(sid)
    cache.check_invariants()
    for other in others:
        cache.free(other)
    cache.free(child)

    cache.swap_in(sid)
    assert not cache.is_swapped(sid)
    k_after, v_after = cache.gather_kv(sid)
    np.testing.assert_array_equal(k_after, k_before)
    np.testing.assert_array_equal(v_after, v_before)
    cache.append(sid, *prefix_kv(prompt + [5], 14), tokens=[5])
    assert_kv(cache, sid, prompt + [5])
    with pytest.raises(CupagedError, match="is not swapped out"):
        cache.swap_in(sid)
    cache.free(sid)
    assert cache.num_free_blocks == 8
    cache.check_invariants()


def test_freeing_a_swapped_sequence_returns_nothing_twice():
    cache = make_cache(num_blocks=4)
    sid = add(cache, list(range(6)))
    cache.swap_out(sid)
    assert cache.num_free_blocks == 4
    cache.free(sid)
    assert cache.num_free_blocks == 4
    cache.check_invariants()


def test_swap_works_without_prefix_caching(rng):
    cache = PagedCache(6, block_size=4, num_layers=1, num_kv_heads=1, head_dim=64,
                       dtype="bfloat16", device="cpu")  # fmt: skip
    sid = cache.add_sequence()
    k = random_array(rng, (1, 9, 1, 64), "bfloat16")
    cache.append(sid, k, k)
    cache.swap_out(sid)
    assert cache.num_free_blocks == 6
    cache.swap_in(sid)
    np.testing.assert_array_equal(cache.gather_kv(sid)[0], k)
    cache.check_invariants()


def _bare_prefix(num_blocks=64):
    pool = cupaged.BlockPool(num_blocks)
    return pool, cupaged.PrefixCache(pool, block_size=BS)


def test_a_match_finds_the_blocks_and_keys_of_the_chain_walk():
    """A match looks the walk's keys up until the first miss, and the chain it returns holds
    what the walk computes, through evictions, a salt, a shorter prompt and blocks computed
    again into other blocks."""
    pool, prefix = _bare_prefix()
    head = list(range(100, 100 + 6 * BS))  # 6 full blocks shared by every request
    own = pool.allocate(6)
    prefix.extend(prefix.chain(), head, own)
    walk = prefix.keys(prefix.chain(), np.array(head, np.int64))
    keys, digests = (list(field) for field in zip(*walk, strict=True))
    for tail in ([1], [2, 3], list(range(BS + 1))):
        blocks, chain = prefix.match(head + tail)
        assert blocks == own and chain.committed == 6
        assert (chain.keys, chain.digests) == (keys, digests)
    blocks, chain = prefix.match(head[: 3 * BS] + [7])  # shorter: the first three
    assert blocks == own[:3] and chain.keys == keys[:3]
    assert prefix.match(head + [1], cache_salt="other")[0] == []  # the salt is in the key
    pool.decref(own[::-1])  # all evictable, the last block first
    taken = pool.allocate(60)  # the 58 free blocks, then the LRU's first two: own[5], own[4]
    assert prefix.match(head + [1])[0] == own[:4]  # up to the first block gone
    _, chain = prefix.match(head[: 4 * BS] + [1])
    pool.decref(taken[:2])
    again = pool.allocate(2)  # the two lost blocks computed again, into other blocks
    prefix.extend(chain, head[4 * BS :], again)
    assert prefix.match(head + [1])[0] == own[:4] + again
    assert chain.keys == keys and chain.digests == digests
    # What a collision would look like: block own[2] holding another content.
    internals(pool).content_of[own[2]] = b"not the prefix"
    assert prefix.match(head + [1])[0] == own[:2]  # the content check ends the hits


def test_each_full_block_is_hashed_once_and_nothing_is_remembered(monkeypatch):
    """A match hashes each full block of its prompt once (the walk, which admission keeps),
    whatever earlier matches found: no memo of blocks or prompt heads that hit."""
    from cupaged.paging import prefix as module  # (its prepared BLAKE2b state)

    hashed = []

    class Counting:  # the prepared BLAKE2b state the walk copies once per block
        def copy(self):
            hashed.append(1)
            return hashlib.blake2b(digest_size=16)

    monkeypatch.setattr(module, "_BLAKE2B_16", Counting())
    pool, prefix = _bare_prefix()
    head = list(range(100, 100 + 6 * BS))
    prefix.extend(prefix.chain(), head, pool.allocate(6))
    assert len(hashed) == 6
    for _ in range(3):  # the same prompt again and again: all six hit, all six hashed
        hashed.clear()
        assert len(prefix.match(head + [1])[0]) == 6
        assert len(hashed) == 6
    hashed.clear()
    hits, chain = prefix.match(head + list(range(900, 900 + 2 * BS)) + [1])
    assert len(hits) == 6 and len(hashed) == 8 and len(chain.keys) == 6


def test_a_colliding_key_is_never_served_for_another_prefix():
    """With every key equal, only the first block registers; another prompt whose first block
    differs finds nothing (the content check), and the same prompt finds only that block."""
    pool = cupaged.BlockPool(16)
    prefix = cupaged.PrefixCache(pool, block_size=BS, hasher=lambda parent, tokens: b"same")
    first = list(range(2 * BS))
    own = pool.allocate(2)
    prefix.extend(prefix.chain(), first, own)
    assert dict(pool.keys.mapping) == {b"same": own[0]}
    assert prefix.match(first + [1])[0] == own[:1]
    assert prefix.match([7] + first[1:] + [1])[0] == []
    pool.check_invariants()
