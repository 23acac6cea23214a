"""The other process of the transfer tests: a sender (prefill side) serving commands on a pipe.

Spawned by ``tests/transfer/test_transfer.py`` (``multiprocessing`` spawn: a fresh interpreter, as
a separate prefill worker would be); every command answers ``("ok", result)`` or ``("error",
"Type: message")``, and the parent bounds each wait.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def serve(conn: Any, specs: dict[str, dict[str, Any]], name: str, seed: int) -> None:
    """Make a CPU cache of each of ``specs`` and an agent over each (named ``{name}-{key}``),
    send ``{key: metadata}``, then serve ``(command, key, args, kwargs)``: ``connect``,
    ``prefill``, ``send``, ``scatter``, ``check`` on cache ``key``, until ``exit``."""
    os.environ["UCX_NET_DEVICES"] = "lo"  # (before NIXL starts UCX: loopback only)
    from cupaged import PagedCache
    from cupaged.transfer import KVTransferAgent

    rng = np.random.default_rng(seed)
    caches, agents = {}, {}
    try:
        for key, spec in specs.items():
            caches[key] = PagedCache(**{"device": "cpu", **spec}, enable_prefix_caching=True)
            agents[key] = KVTransferAgent(caches[key], f"{name}-{key}")
        conn.send({key: agent.metadata() for key, agent in agents.items()})
        while True:
            command, key, args, kwargs = conn.recv()
            if command == "exit":
                break
            try:
                conn.send(("ok", _run(command, caches[key], agents[key], rng, args, kwargs)))
            except Exception as error:  # noqa: BLE001  (reported to the parent, which fails)
                conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        for agent in agents.values():
            agent.close()


def _run(command: str, cache: Any, agent: Any, rng: np.random.Generator, args, kwargs) -> Any:
    if command == "connect":
        return agent.connect(*args)
    if command == "prefill":
        return prefill(cache, rng, *args)
    if command == "send":
        stats = agent.send(*args, **kwargs)
        return (
            stats.blocks_moved,
            stats.blocks_cached,
            stats.bytes_moved,
            stats.seconds,
            stats.descriptors,
        )
    if command == "scatter":
        return scatter(cache, *args)
    if command == "check":  # (the sender's pool is sound: every block free, cached or owned)
        cache.check_invariants()
        return cache.num_free_blocks
    raise ValueError(f"unknown command {command!r}")


def prefill(cache: Any, rng: np.random.Generator, prompt: list[int]) -> tuple:
    """Admit ``prompt`` and write random K/V bits (no zeros: every byte drawn) into the blocks
    it computes, as a model's prefill would; ``(sid, k, v, table)`` of the whole prompt, ``k`` and
    ``v`` as host ``uint8`` arrays (a GPU cache's copied)."""
    admission = cache.admit(prompt)
    sid, bs = admission.sid, cache.block_size
    table = cache.block_table(sid)
    for block in table[admission.num_cached_tokens // bs :]:
        for pages in (cache.k, cache.v):
            page = pages[:, block].view(np.uint8)
            bits = rng.integers(1, 255, page.shape, dtype=np.uint8)
            page[...] = bits if isinstance(page, np.ndarray) else _on_gpu(bits)
    cache.commit(sid)
    k, v = cache.gather_kv(sid)
    return sid, _host(k.view(np.uint8)), _host(v.view(np.uint8)), table


def _on_gpu(host: np.ndarray) -> Any:
    """``host`` as a CuPy array (a GPU cache's pages take no NumPy array)."""
    import cupy

    return cupy.asarray(host)


def _host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def scatter(cache: Any, n: int) -> list[int]:
    """Take ``n`` blocks and free every other one, so that later blocks are not consecutive."""
    sids = [cache.admit([7] * cache.block_size * 1 + [i]).sid for i in range(n)]
    cache.free_many(sids[::2])
    return sids[1::2]
