"""Cascade through the cache (issue 40): the samples of a forked prompt are one group of the
step's decode plan, found from the cache's own tables, with the plain plan's results."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, random_array
from test_cache import kv

import cupaged
from cupaged import PagedCache


def test_forked_samples_share_their_prompt_in_the_step_plan(rng):
    cache = PagedCache(
        64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
        device="cpu",
    )  # fmt: skip
    prompt = cache.add_sequence()
    cache.append(prompt, *kv(cache, rng, 70))  # 4 full blocks and 6 tokens of a fifth
    samples = [prompt] + [cache.fork(prompt) for _ in range(5)]
    other = cache.add_sequence()
    cache.append(other, *kv(cache, rng, 33))
    batch = [*samples, other]
    for _ in range(3):  # three decode steps: copy-on-write splits the partial block
        slots = cache.reserve(batch)
        k, v = kv(cache, rng, len(batch))
        for layer in range(2):
            cupaged.write_kv(cache.k[layer], cache.v[layer], k[layer], v[layer], slots)
    q = random_array(rng, (len(batch), 8, 64), "float16")
    tables, lens = cache.block_tables(batch)
    for layer in range(2):
        plain = cache.decode_plan(batch, 8, cascade=False).run(q, cache.k[layer], cache.v[layer])
        plan = cache.decode_plan(batch, 8, cascade=True)
        got = plan.run(q, cache.k[layer], cache.v[layer])
        expected = cupaged.reference_attention(
            q.astype(np.float32), cache.k[layer].astype(np.float32),
            cache.v[layer].astype(np.float32), tables, lens,
        )  # fmt: skip
        assert_close(got, expected, "float16")
        assert_close(plain, expected, "float16")
    [node] = plan.cascade.nodes  # the six samples share the prompt's four full blocks
    assert node.rows.tolist() == list(range(6)) and (node.begin, node.end) == (0, 64)
    assert plan.kv_bytes_read < plan.kv_bytes_plain
    assert cache.decode_plan(batch, 8).cascade is None  # None: a few KB is not worth a launch
    cache.check_invariants()


def test_host_block_tables_are_the_device_tables_on_the_host(rng):
    """What PagedCache.decode_plan hands a GPU plan's cascade planner: the same ids and lengths,
    for ids, a batch and a step plan (a stale step plan refused as for the device tables)."""
    cache = PagedCache(
        64, block_size=4, num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16",
        device="cpu",
    )  # fmt: skip
    sids = [cache.add_sequence() for _ in range(3)]
    for sid, n in zip(sids, (5, 13, 1), strict=True):
        cache.append(sid, *kv(cache, rng, n))
    batch = cache.batch(sids)
    step = cache.step(batch, tables=True)
    for source in (sids, batch, step):
        tables, lens = cache.block_tables(source)
        host_tables, host_lens = cache.block_tables(source, host=True)
        assert isinstance(host_tables, np.ndarray) and isinstance(host_lens, np.ndarray)
        np.testing.assert_array_equal(host_lens, lens)
        for row, n in enumerate(lens.tolist()):
            used = -(-n // 4)
            np.testing.assert_array_equal(host_tables[row, :used], tables[row, :used])
    cache.step(batch)  # a later step: the first plan is stale
    with pytest.raises(ValueError, match="stale"):
        cache.block_tables(step, host=True)
