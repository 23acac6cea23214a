"""Random walks of a prefix-caching PagedCache against a model of its block pool.

A hypothesis state machine drives ``PagedCache(enable_prefix_caching=True)`` over 10 blocks of 4
tokens: it adds sequences whose prompts share a few prefixes over a 3-token vocabulary (so cache hits
are frequent), with cache salts None, "a" and "b"; appends the uncached rest of each prompt; decodes
(``append`` of one token, or ``reserve`` for a batch then ``write_kv`` layer by layer); forks and
writes to forks (copy-on-write); frees; swaps out and in; and makes calls that must fail and change
nothing.

As in a real model, the K/V of position ``p`` is a deterministic function of the token ids
``0 .. p`` (and, here, of the salt, so that blocks shared across salts would show in the data), so
attaching a cached block gives exactly the K/V that recomputing it would give.

The model mirrors the pool: which blocks are in use (read from the block tables), which full blocks
are registered under which prefix (first writer wins), the LRU list of evictable blocks (a freed
sequence's registered blocks join it last block first; evictions take its head once the free stack
is empty) and the prefix-cache counters. It predicts every hit, the blocks each call takes, which
cached blocks each allocation evicts and in what order, and checks them exactly; after every step it
checks ``check_invariants()``, every resident sequence's K/V bit-exactly, the free count, the
refcounts, the LRU list, the registered blocks and the counters.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from helpers import internals
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_stateful import assert_same_bits, bits, ceil_div, free_everything

import cupaged
from cupaged import CupagedError, OutOfBlocksError, PagedCache
from cupaged.paging.prefix import PrefixCacheStats, blake2b_block_hash, salt_root

NUM_BLOCKS = 10
BLOCK_SIZE = 4
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 64  # the smallest head_dim the attention kernels take

VOCAB = 3
TOKENS = st.integers(0, VOCAB - 1)
SALTS = (None, "a", "b")
# Prompts are a cut of one of these plus a short random tail: the first two share their first block.
PREFIXES = (
    (0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2),
    (0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 2, 1),
    (1, 1, 0, 0, 2, 1, 0, 2, 1, 0, 2, 2),
)
PREFIX = st.sampled_from(PREFIXES)
# Mostly past a block boundary, so that the prompt can hit; mostly unsalted, so that salts share.
CUT = st.sampled_from([5, 8, 9, 12]) | st.integers(0, len(PREFIXES[0]))
TAIL = st.lists(TOKENS, max_size=3)
SALT = st.sampled_from([None, None, "a", "b"])
MAX_LIVE = 8  # add_sequence runs below this many live sequences; fork has no cap
NEVER_HANDED_OUT = (-1, 10**6)
DEAD_ID_CALLS = (
    "free",
    "fork",
    "append",
    "reserve",
    "seq_len",
    "block_table",
    "block_tables",
    "gather_kv",
    "swap_out",
    "swap_in",
    "is_swapped",
    "num_cached_tokens",
)
SWAPPED_CALLS = (
    "append",
    "reserve",
    "fork",
    "block_table",
    "block_tables",
    "gather_kv",
    "swap_out",
)
SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None)
SALT_BLIND_SETTINGS = settings(SETTINGS, max_examples=20)

Key = tuple


# --------------------------------------------------------------------------- deterministic K/V


@functools.lru_cache(maxsize=1 << 16)
def _token_kv(salt: str | None, prefix: tuple[int, ...]) -> np.ndarray:
    """``[2, num_layers, num_kv_heads, head_dim]``: K and V of the last token of ``prefix``."""
    tag = b"-" if salt is None else b"+" + salt.encode()
    digest = hashlib.blake2b(tag + np.asarray(prefix, "<i8").tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return rng.standard_normal((2, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)


def prefix_kv(salt: str | None, tokens: Sequence[int], start: int = 0) -> tuple[np.ndarray, ...]:
    """K and V, each ``[num_layers, n, num_kv_heads, head_dim]``, of positions ``start ..``."""
    tokens = tuple(tokens)
    if start == len(tokens):
        empty = np.zeros((NUM_LAYERS, 0, NUM_KV_HEADS, HEAD_DIM), np.float32)
        return empty, empty.copy()
    rows = np.stack([_token_kv(salt, tokens[: p + 1]) for p in range(start, len(tokens))], axis=2)
    return np.ascontiguousarray(rows[0]), np.ascontiguousarray(rows[1])


def table_gather(pages: np.ndarray, table: list[int], length: int) -> np.ndarray:
    """Tokens ``0 .. length - 1`` read through a block table: ``[num_layers, length, H, D]``."""
    pos = np.arange(length)
    blocks = np.asarray(table, dtype=np.intp)[pos // BLOCK_SIZE]
    return pages[:, blocks, :, pos % BLOCK_SIZE, :].transpose(1, 0, 2, 3)


# --------------------------------------------------------------------------- block hashers

_SALT_ROOTS = {salt_root(salt.encode()) for salt in SALTS if salt is not None}


def salt_blind_hasher(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Keys that ignore the salt: equal token prefixes collide across salts at every depth.

    Only the check of each hit against its stored content (parent key, tokens, salt) keeps salted
    sequences apart. The keys still hash the whole token prefix, so a collision never hides a
    different prefix behind an equal parent key.
    """
    return blake2b_block_hash(b"" if parent in _SALT_ROOTS else parent, tokens)


@dataclass
class Seq:
    tokens: list[int]
    salt: str | None
    k: np.ndarray  # the model's K/V, [num_layers, len(tokens), num_kv_heads, head_dim]
    v: np.ndarray
    cached: int  # num_cached_tokens
    swapped: bool = False


class PrefixCacheMachine(RuleBasedStateMachine):
    block_hasher: Callable[[bytes, Sequence[int]], bytes] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.cache = prefix_cache(type(self).block_hasher)
        self.seqs: dict[int, Seq] = {}  # live sequences, oldest first
        self.tables: dict[int, list[int]] = {}  # resident sequences' block tables
        self.freed: set[int] = set()
        self.handed_out: set[int] = set()
        self.prompts: list[tuple[list[int], str | None]] = []  # every prompt added, and its salt
        # The prefix cache: key -> block, block -> (key, content), evictable blocks oldest first.
        self.block_of: dict[Key, int] = {}
        self.registered: dict[int, tuple[Key, Key]] = {}
        self.lru: list[int] = []
        self.stats = PrefixCacheStats()

    # --------------------------------------------------------------------------- model keys

    def key(self, salt: str | None, prefix: Sequence[int]) -> Key:
        """What the cache's key of the full block ending ``prefix`` stands for."""
        return (salt, tuple(prefix))

    def content(self, salt: str | None, prefix: Sequence[int]) -> Key:
        """What a hit is verified against."""
        return (salt, tuple(prefix))

    # --------------------------------------------------------------------------- model pool

    def refs(self) -> Counter[int]:
        return Counter(block for table in self.tables.values() for block in table)

    def free_stack(self) -> set[int]:
        """Blocks neither in use nor evictable."""
        return set(range(NUM_BLOCKS)) - set(self.refs()) - set(self.lru)

    def predict_hits(self, prompt: list[int], salt: str | None) -> list[int]:
        hits: list[int] = []
        for j in range(max(len(prompt) - 1, 0) // BLOCK_SIZE):
            prefix = prompt[: (j + 1) * BLOCK_SIZE]
            block = self.block_of.get(self.key(salt, prefix))
            if block is None:
                break
            if self.registered[block][1] != self.content(salt, prefix):
                event("lookup refused: same key, other content")
                break
            hits.append(block)
        return hits

    def allocate(self, n: int) -> tuple[int, list[int]]:
        """Model ``n`` allocations: the free stack first, then the LRU head, which is forgotten.

        Returns:
            The size of the free stack before, and the evicted blocks in eviction order.
        """
        free = len(self.free_stack())
        evicted = self.lru[: max(0, n - free)]
        del self.lru[: len(evicted)]
        for block in evicted:
            key, _ = self.registered.pop(block)
            del self.block_of[key]
        self.stats.evictions += len(evicted)
        if evicted:
            event("evicted cached blocks")
        return free, evicted

    def register(self, sid: int, start: int) -> None:
        """Register full blocks ``start ..`` of ``sid`` unless their key is taken."""
        seq, table = self.seqs[sid], self.tables[sid]
        for j in range(start, len(seq.tokens) // BLOCK_SIZE):
            prefix = seq.tokens[: (j + 1) * BLOCK_SIZE]
            key = self.key(seq.salt, prefix)
            if key in self.block_of:
                if self.block_of[key] != table[j]:
                    event("full block left unregistered: key taken")
                continue
            assert table[j] not in self.registered, f"block {table[j]} registered twice"
            self.block_of[key] = table[j]
            self.registered[table[j]] = (key, self.content(seq.salt, prefix))

    @contextlib.contextmanager
    def release(self, sid: int) -> Iterator[None]:
        """Drop a resident sequence's references, last block first, and check the cache did too.

        Call it around the cache's call: ``with self.release(sid): cache.free(sid)``.
        """
        cache = self.cache
        table = self.tables.pop(sid)
        still_held = self.refs()
        released = [block for block in reversed(table) if not still_held[block]]
        evictable = [block for block in released if block in self.registered]
        self.lru += evictable
        free = cache.num_free_blocks
        yield
        assert cache.num_free_blocks == free + len(released)
        # Its cached blocks are now the newest evictable ones, last block first.
        after = cache.pool.evictable_blocks()
        assert after[len(after) - len(evictable) :] == evictable, f"{after}, expected ..{evictable}"

    def check_allocation(
        self,
        old_tables: dict[int, list[int]],
        order: list[int],
        needed: int,
        free: int,
        evicted: list[int],
    ) -> None:
        """The blocks newly taken, in allocation order: free ones first, then the evicted ones."""
        old_used = {block for table in old_tables.values() for block in table}
        new_used = {block for table in self.tables.values() for block in table}
        assert len(order) == needed, f"took {order}, expected {needed} block(s)"
        assert set(order) == new_used - old_used, f"took {order}, tables show {new_used - old_used}"
        assert order[len(order) - len(evicted) :] == evicted, (
            f"allocated {order} with {free} free block(s): expected to evict {evicted} last"
        )
        free_blocks = set(range(NUM_BLOCKS)) - old_used - set(self.lru) - set(evicted)
        assert set(order) - set(evicted) <= free_blocks, f"took {order}: not all were free"

    # --------------------------------------------------------------------------- helpers

    def resident(self) -> list[int]:
        return [sid for sid, seq in self.seqs.items() if not seq.swapped]

    def swapped(self) -> list[int]:
        return [sid for sid, seq in self.seqs.items() if seq.swapped]

    def shared_partial_blocks(self) -> dict[int, list[int]]:
        """Partly filled last blocks held by two or more sequences -> their holders."""
        holders: dict[int, list[int]] = {}
        for sid, table in self.tables.items():
            if len(self.seqs[sid].tokens) % BLOCK_SIZE:
                holders.setdefault(table[-1], []).append(sid)
        return {block: sids for block, sids in holders.items() if len(sids) > 1}

    def sharing_last_block(self) -> list[int]:
        """Sequences whose next write must copy their last block first."""
        return sorted(sid for sids in self.shared_partial_blocks().values() for sid in sids)

    def draw_resident(self, data: st.DataObject, interesting: list[int] | None = None) -> int:
        live = st.sampled_from(sorted(self.resident()))
        if interesting:
            live = st.sampled_from(sorted(interesting)) | live
        return data.draw(live, label="sid")

    def blocks_needed(self, requests: list[tuple[int, int]]) -> int:
        """Blocks that writing ``n`` tokens to each ``(sid, n)`` of one batch takes.

        Growth, plus one copy per writer of a shared, partly filled last block; when every holder
        of such a block writes, the last one keeps it.
        """
        refs = self.refs()
        grow = 0
        writers: Counter[int] = Counter()
        for sid, n in requests:
            length = len(self.seqs[sid].tokens)
            grow += ceil_div(length + n, BLOCK_SIZE) - ceil_div(length, BLOCK_SIZE)
            if n and length % BLOCK_SIZE:
                writers[self.tables[sid][-1]] += 1
        return grow + sum(k - (k == refs[block]) for block, k in writers.items())

    def snapshot(self) -> dict[str, object]:
        cache, pool = self.cache, self.cache.pool
        return {
            "num_free_blocks": cache.num_free_blocks,
            "sequence_ids": cache.sequence_ids,
            "is_swapped": [cache.is_swapped(sid) for sid in cache.sequence_ids],
            "seq_len": [cache.seq_len(sid) for sid in cache.sequence_ids],
            "num_cached_tokens": [cache.num_cached_tokens(sid) for sid in cache.sequence_ids],
            "tables": [
                None if cache.is_swapped(sid) else cache.block_table(sid)
                for sid in cache.sequence_ids
            ],
            "refcounts": [cache.refcount(block) for block in range(NUM_BLOCKS)],
            "evictable": pool.evictable_blocks(),
            "keys": [pool.cached_key(block) for block in range(NUM_BLOCKS)],
            "stats": cache.prefix_cache_stats,
            "k bits": bits(cache.k).copy(),
            "v bits": bits(cache.v).copy(),
        }

    def assert_unchanged(self, before: dict[str, object]) -> None:
        after = self.snapshot()
        for name, old in before.items():
            new = after[name]
            same = np.array_equal(old, new) if isinstance(old, np.ndarray) else old == new
            assert same, f"a failed call changed {name}: {old} -> {new}"

    def expect_error(self, error: type[BaseException], call: Callable[[], object]) -> Exception:
        before = self.snapshot()
        with pytest.raises(error) as info:
            call()
        self.assert_unchanged(before)
        return info.value

    def expect_out_of_blocks(self, call: Callable[[], object], needed: int) -> None:
        free = self.cache.num_free_blocks
        err = self.expect_error(OutOfBlocksError, call)
        assert (err.needed, err.available) == (needed, free)

    def check_kv(self, sid: int) -> None:
        seq = self.seqs[sid]
        k, v = self.cache.gather_kv(sid)
        assert_same_bits(k, seq.k, f"gather_kv K of {sid}")
        assert_same_bits(v, seq.v, f"gather_kv V of {sid}")
        want_k, want_v = prefix_kv(seq.salt, seq.tokens)
        assert_same_bits(k, want_k, f"K of {sid} vs its token prefix")
        assert_same_bits(v, want_v, f"V of {sid} vs its token prefix")

    def write(self, requests: list[tuple[int, list[int]]], use_reserve: bool) -> bool:
        """Append ``tokens`` (with their deterministic K/V) to each ``(sid, tokens)``.

        One ``append`` (a single request), or one ``reserve`` for the batch and ``write_kv`` per
        layer. Returns False when the pool is too small, after checking that nothing changed.
        """
        cache = self.cache
        sids = [sid for sid, _ in requests]
        counts = [len(tokens) for _, tokens in requests]
        new_kv = []
        for sid, tokens in requests:
            seq = self.seqs[sid]
            new_kv.append(prefix_kv(seq.salt, seq.tokens + tokens, len(seq.tokens)))
        if use_reserve:
            ids = [tokens for _, tokens in requests]
            count_arg = 1 if set(counts) == {1} else counts

            def call() -> object:
                return cache.reserve(sids, count_arg, tokens=ids)
        else:
            ((sid, tokens),) = requests
            (k, v), *_ = new_kv

            def call() -> object:
                return cache.append(sid, k, v, tokens=tokens)

        needed = self.blocks_needed(list(zip(sids, counts, strict=True)))
        free = cache.num_free_blocks
        if needed > free:
            event("out of blocks: append" if not use_reserve else "out of blocks: reserve")
            self.expect_out_of_blocks(call, needed)
            return False

        old_tables = {sid: list(table) for sid, table in self.tables.items()}
        refs = self.refs()
        free_stack, evicted = self.allocate(needed)
        slots = call()
        if use_reserve:
            assert isinstance(slots, np.ndarray) and slots.dtype == np.int32
            assert slots.shape == (sum(counts),)
            k = np.concatenate([k for k, _ in new_kv], axis=1)
            v = np.concatenate([v for _, v in new_kv], axis=1)
            for layer in range(NUM_LAYERS):
                cupaged.write_kv(cache.k[layer], cache.v[layer], k[layer], v[layer], slots)
            cache.commit(sids)  # written: the filled blocks may serve other sequences now
        assert cache.num_free_blocks == free - needed

        order: list[int] = []
        expected_slots: list[int] = []
        for (sid, tokens), (k, v) in zip(requests, new_kv, strict=True):
            seq, old = self.seqs[sid], old_tables[sid]
            new = cache.block_table(sid)
            self.tables[sid] = new
            start = len(seq.tokens)
            assert new[: max(len(old) - 1, 0)] == old[:-1], f"{sid}: {old} became {new}"
            if old and new[len(old) - 1] != old[-1]:  # copy-on-write of the last block
                assert start % BLOCK_SIZE and refs[old[-1]] > 1, f"{sid} copied {old} -> {new}"
                event("copy-on-write")
                order.append(new[len(old) - 1])
            order += new[len(old) :]
            expected_slots += [
                new[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(start, start + len(tokens))
            ]
            seq.tokens += tokens
            seq.k = np.concatenate([seq.k, k], axis=1)
            seq.v = np.concatenate([seq.v, v], axis=1)
        if use_reserve:
            assert slots.tolist() == expected_slots
        self.check_allocation(old_tables, order, needed, free_stack, evicted)
        # Registration is per sequence from its first block that was not full before the call.
        for sid, tokens in requests:
            length = len(self.seqs[sid].tokens)
            self.register(sid, (length - len(tokens)) // BLOCK_SIZE)
        return True

    # --------------------------------------------------------------------------- rules

    @initialize(prefix=PREFIX, cut=CUT, tail=TAIL, salt=SALT)
    def first_sequence(
        self, prefix: tuple[int, ...], cut: int, tail: list[int], salt: str | None
    ) -> None:
        self.add(prefix, cut, tail, salt)

    @precondition(lambda self: len(self.seqs) < MAX_LIVE and self.prompts)
    @rule(data=st.data(), tail=TAIL, salt=SALT)
    def add_again(self, data: st.DataObject, tail: list[int], salt: str | None) -> None:
        """A prompt that starts like an earlier one (a shared system prompt): a likely hit."""
        prompt, old_salt = data.draw(st.sampled_from(self.prompts), label="earlier prompt")
        salt = data.draw(st.sampled_from([old_salt, salt]), label="salt")
        boundary = st.integers(0, len(prompt) // BLOCK_SIZE).map(lambda j: j * BLOCK_SIZE)
        cut = data.draw(boundary | st.integers(0, len(prompt)), label="cut")
        self.add(tuple(prompt), cut, tail, salt)

    @precondition(lambda self: len(self.seqs) < MAX_LIVE)
    @rule(prefix=PREFIX, cut=CUT, tail=TAIL, salt=SALT)
    def add(self, prefix: tuple[int, ...], cut: int, tail: list[int], salt: str | None) -> None:
        cache = self.cache
        prompt = list(prefix[:cut]) + tail
        self.prompts.append((prompt, salt))
        hits = self.predict_hits(prompt, salt)
        revived = [block for block in hits if block in self.lru]
        free = cache.num_free_blocks
        sid = cache.add_sequence(tokens=prompt, cache_salt=salt)
        assert isinstance(sid, int) and sid not in self.handed_out
        self.handed_out.add(sid)

        n = cache.num_cached_tokens(sid)
        assert n % BLOCK_SIZE == 0 and n <= max(len(prompt) - 1, 0), f"{n} cached of {prompt}"
        assert n == len(hits) * BLOCK_SIZE, f"{n} tokens cached, expected blocks {hits}"
        assert cache.block_table(sid) == hits
        assert cache.seq_len(sid) == n
        assert cache.num_free_blocks == free - len(revived), "a hit must take no free block"
        if hits:
            event("prefix-cache hit")
        if revived:
            event("revived an evictable block")
        self.lru = [block for block in self.lru if block not in revived]
        self.stats.hits += n // BLOCK_SIZE
        self.stats.misses += len(prompt) // BLOCK_SIZE - n // BLOCK_SIZE
        self.stats.cached_tokens += n
        k, v = prefix_kv(salt, prompt[:n])
        self.seqs[sid] = Seq(list(prompt[:n]), salt, k, v, cached=n)
        self.tables[sid] = list(hits)
        self.check_kv(sid)
        # The rest of the prompt; when it does not fit, the sequence keeps its cached blocks.
        if prompt[n:]:
            self.write([(sid, prompt[n:])], use_reserve=False)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), token=TOKENS)
    def decode_append(self, data: st.DataObject, token: int) -> None:
        """One decode step of one sequence: ``append`` one token."""
        sid = self.draw_resident(data, self.sharing_last_block())
        self.write([(sid, [token])], use_reserve=False)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def decode_reserve(self, data: st.DataObject) -> None:
        """One decode step of a batch: ``reserve`` one token each, then ``write_kv`` per layer.

        One time in four, a chunked-prefill step instead: 0 to 4 tokens each.
        """
        live = st.sampled_from(sorted(self.resident()))
        shared = self.sharing_last_block()
        if shared and data.draw(st.booleans(), label="siblings"):
            live = st.sampled_from(sorted(shared))
        sids = data.draw(st.lists(live, min_size=1, max_size=3, unique=True), label="sids")
        chunked = data.draw(st.integers(0, 3), label="chunked") == 0
        ids = st.lists(TOKENS, max_size=4) if chunked else st.lists(TOKENS, min_size=1, max_size=1)
        self.write([(sid, data.draw(ids, label="tokens")) for sid in sids], use_reserve=True)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=2, max_size=5))
    def extend(self, data: st.DataObject, tokens: list[int]) -> None:
        """Several tokens to one sequence in one ``append``."""
        sid = self.draw_resident(data, self.sharing_last_block())
        self.write([(sid, tokens)], use_reserve=False)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        partial = [sid for sid in self.resident() if len(self.seqs[sid].tokens) % BLOCK_SIZE]
        parent = self.draw_resident(data, partial)
        free = self.cache.num_free_blocks
        child = self.cache.fork(parent)
        assert isinstance(child, int) and child not in self.handed_out
        self.handed_out.add(child)
        assert self.cache.block_table(child) == self.tables[parent]
        assert self.cache.num_free_blocks == free, "a fork must not take blocks"
        assert self.cache.num_cached_tokens(child) == 0
        seq = self.seqs[parent]
        self.seqs[child] = Seq(list(seq.tokens), seq.salt, seq.k.copy(), seq.v.copy(), cached=0)
        self.tables[child] = list(self.tables[parent])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)), label="sid")
        cache = self.cache
        free = cache.num_free_blocks
        evictable = cache.pool.evictable_blocks()
        if self.seqs[sid].swapped:
            event("freed a swapped sequence")
            cache.free(sid)
            assert cache.num_free_blocks == free, "a swapped sequence holds no block"
            assert cache.pool.evictable_blocks() == evictable
        else:
            with self.release(sid):
                cache.free(sid)
        del self.seqs[sid]
        self.freed.add(sid)

    @precondition(lambda self: self.seqs and self.cache.num_free_blocks <= 2)
    @rule(data=st.data())
    def free_when_full(self, data: st.DataObject) -> None:
        """Freeing, twice as likely once the pool is nearly full, so that prefixes get reused."""
        self.free(data)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        sid = self.draw_resident(data)
        cache = self.cache
        with self.release(sid):
            cache.swap_out(sid)
        self.seqs[sid].swapped = True
        assert cache.is_swapped(sid)
        assert cache.seq_len(sid) == len(self.seqs[sid].tokens)

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.swapped()), label="sid")
        cache, seq = self.cache, self.seqs[sid]
        needed = ceil_div(len(seq.tokens), BLOCK_SIZE)
        free = cache.num_free_blocks
        if needed > free:
            event("out of blocks: swap_in")
            self.expect_out_of_blocks(lambda: cache.swap_in(sid), needed)
            assert cache.is_swapped(sid)
            return
        old_tables = {s: list(table) for s, table in self.tables.items()}
        free_stack, evicted = self.allocate(needed)
        cache.swap_in(sid)
        assert not cache.is_swapped(sid)
        assert cache.num_free_blocks == free - needed
        seq.swapped = False
        self.tables[sid] = cache.block_table(sid)
        self.check_allocation(old_tables, self.tables[sid], needed, free_stack, evicted)
        self.register(sid, 0)
        self.check_kv(sid)

    @rule(data=st.data())
    def rejected_call(self, data: st.DataObject) -> None:
        """A call that must raise and change nothing."""
        kinds = [f"dead_{call}" for call in DEAD_ID_CALLS]
        if self.resident():
            kinds += ["no_tokens", "append_token_count", "reserve_token_count", "reserve_lists"]
            kinds += ["swap_in_resident"]
        if self.swapped():
            kinds += [f"swapped_{call}" for call in SWAPPED_CALLS]
        kind = data.draw(st.sampled_from(kinds), label="kind")
        cache = self.cache
        k, v = prefix_kv(None, [0, 1, 2])
        if kind.startswith("dead_"):
            next_id = max(self.handed_out, default=-1) + 1
            ids = sorted(self.freed) + [next_id, *NEVER_HANDED_OUT]
            sid = data.draw(st.sampled_from(ids), label="dead sid")
            live = self.resident()
            calls: dict[str, Callable[[], object]] = {
                "free": lambda: cache.free(sid),
                "fork": lambda: cache.fork(sid),
                "append": lambda: cache.append(sid, k, v, tokens=[0, 1, 2]),
                # The live sequences come first: the rejected batch must not reserve for them.
                "reserve": lambda: cache.reserve([*live, sid], 1, tokens=[[0]] * (len(live) + 1)),
                "seq_len": lambda: cache.seq_len(sid),
                "block_table": lambda: cache.block_table(sid),
                "block_tables": lambda: cache.block_tables([*live, sid]),
                "gather_kv": lambda: cache.gather_kv(sid),
                "swap_out": lambda: cache.swap_out(sid),
                "swap_in": lambda: cache.swap_in(sid),
                "is_swapped": lambda: cache.is_swapped(sid),
                "num_cached_tokens": lambda: cache.num_cached_tokens(sid),
            }
            self.expect_error(KeyError, calls[kind.removeprefix("dead_")])
        elif kind.startswith("swapped_"):
            sid = data.draw(st.sampled_from(self.swapped()), label="swapped sid")
            calls = {
                "append": lambda: cache.append(sid, k, v, tokens=[0, 1, 2]),
                "reserve": lambda: cache.reserve([sid], 1, tokens=[[0]]),
                "fork": lambda: cache.fork(sid),
                "block_table": lambda: cache.block_table(sid),
                "block_tables": lambda: cache.block_tables([sid]),
                "gather_kv": lambda: cache.gather_kv(sid),
                "swap_out": lambda: cache.swap_out(sid),
            }
            err = self.expect_error(CupagedError, calls[kind.removeprefix("swapped_")])
            assert not isinstance(err, OutOfBlocksError), f"{kind}: {err!r}"
        else:
            sid = self.draw_resident(data)
            others = [other for other in self.resident() if other != sid]
            n = data.draw(st.integers(1, 3), label="n")
            wrong = data.draw(st.sampled_from([n - 1, n + 1]), label="wrong count")
            lists_off = data.draw(st.sampled_from([-1, 1]), label="lists off by")
            calls = {
                "no_tokens": lambda: cache.append(sid, k[:, :n], v[:, :n]),
                "append_token_count": lambda: cache.append(
                    sid, k[:, :n], v[:, :n], tokens=[0] * wrong
                ),
                "reserve_token_count": lambda: cache.reserve(
                    [*others, sid],
                    [1] * len(others) + [n],
                    tokens=[[0]] * len(others) + [[0] * wrong],
                ),
                "reserve_lists": lambda: cache.reserve(
                    [*others, sid], 1, tokens=[[0]] * (len(others) + 1 + lists_off)
                ),
                "swap_in_resident": lambda: cache.swap_in(sid),
            }
            error = CupagedError if kind == "swap_in_resident" else ValueError
            err = self.expect_error(error, calls[kind])
            assert not isinstance(err, OutOfBlocksError), f"{kind}: {err!r}"

    # --------------------------------------------------------------------------- checks

    @invariant()
    def matches_model(self) -> None:
        cache = self.cache
        cache.check_invariants()
        internals(cache).assert_no_call_inside()  # failed calls too: no undo left, no claim
        assert cache.sequence_ids == list(self.seqs), "sequence_ids must list oldest first"
        for sid, seq in self.seqs.items():
            assert cache.is_swapped(sid) == seq.swapped
            assert cache.seq_len(sid) == len(seq.tokens)
            assert cache.num_cached_tokens(sid) == seq.cached
            if seq.swapped:
                continue
            table = self.tables[sid]
            assert cache.block_table(sid) == table, f"table of {sid}"
            assert len(table) == ceil_div(len(seq.tokens), BLOCK_SIZE)
            self.check_kv(sid)
            assert_same_bits(table_gather(cache.k, table, len(seq.tokens)), seq.k, f"K of {sid}")
            assert_same_bits(table_gather(cache.v, table, len(seq.tokens)), seq.v, f"V of {sid}")
        refs = self.refs()
        assert cache.num_free_blocks + len(refs) == NUM_BLOCKS
        assert [cache.refcount(b) for b in range(NUM_BLOCKS)] == [
            refs[b] for b in range(NUM_BLOCKS)
        ]
        resident = self.resident()
        tables, lens = cache.block_tables(resident)
        width = max([len(self.tables[sid]) for sid in resident] + [1])
        assert tables.tolist() == [
            self.tables[sid] + [0] * (width - len(self.tables[sid])) for sid in resident
        ]
        assert lens.tolist() == [len(self.seqs[sid].tokens) for sid in resident]
        pool = cache.pool
        assert pool.evictable_blocks() == self.lru, (
            f"LRU {pool.evictable_blocks()}, model {self.lru}"
        )
        registered = [b for b in range(NUM_BLOCKS) if pool.cached_key(b) is not None]
        assert registered == sorted(self.registered), f"registered {registered}"
        assert cache.prefix_cache_stats == self.stats, f"{cache.prefix_cache_stats} vs {self.stats}"

    def teardown(self) -> None:
        free_everything(self.cache, NUM_BLOCKS)


class SaltBlindPrefixCacheMachine(PrefixCacheMachine):
    """Keys collide across salts: the hit's content check is what keeps tenants apart."""

    block_hasher = staticmethod(salt_blind_hasher)

    def key(self, salt: str | None, prefix: Sequence[int]) -> Key:
        return (tuple(prefix),)


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = SETTINGS
TestPrefixCacheSaltBlindKeys = SaltBlindPrefixCacheMachine.TestCase
TestPrefixCacheSaltBlindKeys.settings = SALT_BLIND_SETTINGS


def order_blind_hasher(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A colliding hasher: blocks whose tokens are permutations of each other share a key."""
    return blake2b_block_hash(parent, sorted(tokens))


def prefix_cache(block_hasher: Callable[[bytes, Sequence[int]], bytes] | None = None) -> PagedCache:
    return PagedCache(
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="float32",
        device="cpu",
        enable_prefix_caching=True,
        block_hasher=block_hasher,
    )


def colliding_cache() -> PagedCache:
    return prefix_cache(order_blind_hasher)


def assert_hit_holds_its_own_prefix(cache: PagedCache, prompt: list[int]) -> None:
    """Add ``prompt``; whatever it finds cached must be the K/V of its own token prefix."""
    sid = cache.add_sequence(tokens=prompt)
    n = cache.num_cached_tokens(sid)
    k, v = cache.gather_kv(sid)
    want_k, want_v = prefix_kv(None, prompt[:n])
    assert_same_bits(k, want_k, f"K of the {n} cached tokens")
    assert_same_bits(v, want_v, f"V of the {n} cached tokens")


def add_and_fill(cache: PagedCache, prompt: list[int]) -> int:
    """Add a prompt and append its uncached rest; returns the sequence id."""
    sid = cache.add_sequence(tokens=prompt)
    n = cache.num_cached_tokens(sid)
    cache.append(sid, *prefix_kv(None, prompt, n), tokens=prompt[n:])
    return sid


X, Y, C = [1, 0, 0, 0], [0, 1, 0, 0], [2, 2, 2, 2]  # X and Y collide under order_blind_hasher


def test_colliding_key_is_refused_by_the_token_check() -> None:
    cache = colliding_cache()
    add_and_fill(cache, Y + [2])
    sid = add_and_fill(cache, X + [1])  # finds Y's block under its key: the tokens differ
    assert cache.num_cached_tokens(sid) == 0
    assert cache.prefix_cache_stats == PrefixCacheStats(hits=0, misses=2, cached_tokens=0)
    k, v = cache.gather_kv(sid)
    want_k, want_v = prefix_kv(None, X + [1])
    assert_same_bits(k, want_k, "K")
    assert_same_bits(v, want_v, "V")
    # X's block is not registered (the key is Y's), so it is freed outright, not kept.
    x_block = cache.block_table(sid)[0]
    assert cache.pool.cached_key(x_block) is None
    free = cache.pool.evictable_blocks()
    cache.free(sid)
    assert cache.pool.evictable_blocks() == free
    cache.check_invariants()


def test_collision_in_the_parent_block_is_not_a_hit() -> None:
    """Under a colliding hasher, every hit must still be a block of the same token prefix.

    X and Y collide. Y's block is cached first, so X's (same key) is left unregistered, but the
    block after X, (X, C), is registered under ``hasher(key(Y) == key(X), C)``. A prompt
    ``Y + C + ...`` hits Y's block, then finds the block of ``X + C`` under its second key: only
    the digest of the whole token prefix tells the two apart.
    """
    cache = colliding_cache()
    add_and_fill(cache, Y + [2])
    add_and_fill(cache, X + C + [1])
    assert_hit_holds_its_own_prefix(cache, Y + C + [1])  # was 8 tokens with the K/V of X + C


def test_swapped_in_block_after_a_kept_head_is_still_a_hit() -> None:
    """No collision here: a prompt whose two full blocks are both cached must hit both.

    A holds P's two full blocks, registered. Swapped out, they become evictable tail first; the
    swap-in takes two free blocks and evicts the tail, so P's head block stays cached under its
    key while A's fresh copy of it stays unregistered, and A's fresh second block is registered
    under the second key with that unregistered copy as its parent. A prompt ``P[:8] + ...``
    then finds the head and, under the second key, a block whose parent is not the head.
    """
    cache = prefix_cache()
    p = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    a = add_and_fill(cache, p)
    add_and_fill(cache, [2] * 24)  # 6 full blocks: 1 block left free
    head, tail, _ = cache.block_table(a)
    cache.swap_out(a)
    assert cache.pool.evictable_blocks() == [tail, head]
    cache.swap_in(a)  # the partial block, the free one, then the tail, evicted
    assert cache.pool.evictable_blocks() == [head]
    cache.check_invariants()
    sid = cache.add_sequence(tokens=p[:8] + [0])
    assert cache.num_cached_tokens(sid) == 8  # was 4: only the head was found
    assert cache.block_table(sid) == [head, cache.block_table(a)[1]]
    k, v = cache.gather_kv(sid)
    want_k, want_v = prefix_kv(None, p[:8])
    assert_same_bits(k, want_k, "K")
    assert_same_bits(v, want_v, "V")


def test_reused_parent_block_id_is_not_a_hit() -> None:
    """Under a colliding hasher: the parent block id of a registered block may be reused.

    s's copy W of X's block is unregistered (s0 registered X first), and s's block (X, C) is
    registered with W as its parent. Once both are freed, W is the top of the free stack: the next
    sequence, Y + ..., takes W for Y's block and, evicting X's block, registers W under X's (and
    Y's) key. ``Y + C + ...`` then hits W, and under the second key the block (X, C), whose parent
    is W again.
    """
    cache = colliding_cache()
    s0 = cache.add_sequence(tokens=X[:2])
    cache.append(s0, *prefix_kv(None, X[:2]), tokens=X[:2])
    s = cache.fork(s0)
    cache.append(s0, *prefix_kv(None, X + [1], 2), tokens=X[2:] + [1])  # copies, registers X
    cache.append(s, *prefix_kv(None, X + C + [1], 2), tokens=X[2:] + C + [1])
    cache.free(s0)
    cache.free(s)
    add_and_fill(cache, Y + [0] * 29)  # 9 blocks: W first, X's block evicted last
    assert_hit_holds_its_own_prefix(cache, Y + C + [1])  # was 8 tokens with the K/V of X + C
