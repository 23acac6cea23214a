"""Cascade through the cache (issue 40): the samples of a forked prompt are one group of the
step's decode plan, found from the cache's own tables, with the plain plan's results."""

from __future__ import annotations

import numpy as np
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
