"""KV blocks moved between two processes over NIXL (:mod:`cupaged.transfer`, docs/transfer.md)
against an in-process NumPy copy of as many blocks of the same size.

A sender process holds sequences of ``TOKENS`` tokens; this process is the receiver. One timed
round is what a decode worker pays for ``requests`` requests: ``expect`` each (reserve its
blocks), ship the requests through the pipe, then per request, in the ``mode`` of the transfer:
``read`` (pull, the default) the sender offers its blocks, ``wait`` READs every block of every
layer, commits and tells the sender it may let them go; ``write`` (push) the sender writes them
and notifies, ``wait`` commits. Every request moves ``TOKENS`` tokens: 64 blocks of 32 KiB at
block size 16, 4 of 512 KiB at 256 (the same 2 MiB); ``QUICK_TOKENS`` when untimed. The receiver's cache has no prefix caching,
so every round moves every block; its free blocks are in order (``runs``: a request's blocks are
one run) or shuffled (``scattered``: about one descriptor per block per layer per K/V). UCX on
loopback (``UCX_NET_DEVICES=lo``), no progress thread.

``numpy`` copies as many blocks, each of every layer's K and V, between two arrays of the same
layout in this process, one copy per request (a slice for ``runs``, fancy indexing between random
block ids for ``scattered``): the floor a transfer compares with.

``extra_info``: the bytes moved (each block's K and V of every layer once: ``bandwidth.py``),
decimal GB/s and blocks per second of the round, the shapes; for NIXL also the mode, the
descriptors and the sender's own time and GB/s, of the last round (push: post to completion of
its writes; pull: its offer to the receiver's "done", the hold). The blocks
that arrive are checked bit for bit, so ``pytest benches --benchmark-disable`` (one untimed round
of each) tests the transfer too.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection

import numpy as np
import pytest
from bandwidth import gb_per_s, transfer_bytes
from timing import median_seconds, repeats

from cupaged import CacheSpec, PagedCache
from cupaged.transfer import KVTransferAgent, nixl_available

if not nixl_available():
    pytest.skip("needs NIXL: pip install --no-deps nixl nixl-cu12", allow_module_level=True)

BLOCK_SIZES = (16, 256)
REQUESTS = (1, 8, 64)
LAYOUTS = ("runs", "scattered")  # a request's blocks on the receiver: consecutive, or not
IMPLS = [("nixl", "read"), ("nixl", "write"), ("numpy", "-")]  # NIXL pulling, pushing; the floor
MAX_REQUESTS = max(REQUESTS)
TOKENS = 1024  # per request: 64 blocks of 16 tokens, 4 of 256
QUICK_TOKENS = 256  # per request when untimed (--benchmark-disable): 16 blocks, or 1
SHAPE = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")  # 2 KiB a token
ROUNDS = 10
TIMEOUT = 60.0  # seconds a message, or a request's writes, may take
# Pushing, the receiver waits longer than the sender writes: a slow write ends at the sender,
# never at a receiver freeing blocks still being written (docs/transfer.md). Pulling, any order
# is safe (the sender's hold is TIMEOUT).
WAIT_TIMEOUT = 2 * TIMEOUT


def make_cache(block_size: int, prefix_caching: bool, tokens: int) -> PagedCache:
    blocks = MAX_REQUESTS * tokens // block_size + 1
    return PagedCache(
        blocks, block_size=block_size, device="cpu", enable_prefix_caching=prefix_caching, **SHAPE
    )


def sequence_kv(block_size: int, i: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The K and V of the sender's sequence ``i``: ``[num_layers, tokens, num_kv_heads,
    head_dim]`` float16 each, seeded (so the receiver can check what arrived), normal positive
    numbers drawn as bits (quicker than drawing floats)."""
    rng = np.random.default_rng([block_size, i])
    shape = (2, SHAPE["num_layers"], tokens, SHAPE["num_kv_heads"], SHAPE["head_dim"])
    k, v = rng.integers(0x0400, 0x7C00, shape, dtype=np.uint16).view(np.float16)
    return k, v


def receive(link: Connection, timeout: float = TIMEOUT):
    if not link.poll(timeout):
        raise TimeoutError(f"expected a message from the other process within {timeout:g} s")
    return link.recv()


def sender(link: Connection, distinct: int, tokens: int) -> None:
    """The sending process: a cache and an agent per block size, ``distinct`` sequences of
    ``tokens`` tokens in each
    (request ``i`` is sent from sequence ``i % distinct``); sends what the receiver asks for until
    told to stop."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    agents, sids = {}, {}
    try:
        for bs in BLOCK_SIZES:
            cache = make_cache(bs, prefix_caching=False, tokens=tokens)
            sids[bs] = []
            for i in range(distinct):
                sid = cache.add_sequence()
                cache.append(sid, *sequence_kv(bs, i, tokens))
                sids[bs].append(sid)
            agents[bs] = KVTransferAgent(cache, name=f"sender-{bs}")
        link.send({bs: agent.metadata() for bs, agent in agents.items()})
        peers = {key: agents[key[0]].connect(m) for key, m in receive(link).items()}
        while (message := receive(link))[0] == "send":
            _, key, requests = message
            assert peers[key]  # (connected above)
            stats = [
                agents[key[0]].send(sids[key[0]][i % distinct], request, timeout=TIMEOUT)
                for i, request in enumerate(requests)
            ]
            link.send([(s.seconds, s.descriptors) for s in stats])
    finally:
        for agent in agents.values():
            agent.close()


def scatter(cache: PagedCache, rng: np.random.Generator) -> None:
    """Leave ``cache``'s free blocks in a random order, so that a request's blocks are scattered
    (one descriptor each per layer per K/V) instead of one run: every block taken by a one-block
    prompt, then all given back in a random order."""
    sids = [cache.admit([0] * cache.block_size).sid for _ in range(cache.num_free_blocks)]
    cache.free_many(rng.permutation(sids).tolist())


class Receiver:
    """This process's side, for each block size and each layout of the blocks a request gets
    (``"runs"``: consecutive ids, one run per request; ``"scattered"``): a cache without prefix
    caching and its agent; and the sender process, connected. The sender sends from
    ``distinct`` sequences per block size; a request is ``tokens`` tokens."""

    def __init__(self, distinct: int, tokens: int) -> None:
        self.distinct, self.tokens = distinct, tokens
        os.environ["UCX_NET_DEVICES"] = "lo"  # (this process's agents start below)
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        ctx = multiprocessing.get_context("spawn")
        self.link, there = ctx.Pipe()
        self.process = ctx.Process(
            target=sender, args=(there, distinct, tokens), name="bench-transfer-sender"
        )
        self.process.start()
        there.close()
        rng = np.random.default_rng(0)
        self.caches, self.agents = {}, {}
        for bs in BLOCK_SIZES:
            for layout in LAYOUTS:
                cache = make_cache(bs, prefix_caching=False, tokens=tokens)
                self.caches[(bs, layout)] = cache
                if layout == "scattered":
                    scatter(cache, rng)
                self.agents[(bs, layout)] = KVTransferAgent(cache, name=f"receiver-{bs}-{layout}")
        metadata = receive(self.link, 300)
        self.peers = {key: agent.connect(metadata[key[0]]) for key, agent in self.agents.items()}
        self.link.send({key: agent.metadata() for key, agent in self.agents.items()})
        self.prompt = list(range(tokens))  # no prefix caching here: the same prompt every time

    def round(self, key: tuple[int, str], n: int, mode: str) -> tuple[list, list]:
        """Move ``n`` requests of :attr:`tokens` tokens into the cache of ``key`` (block size,
        layout) in ``mode``; the incomings and the sender's ``(seconds, descriptors)`` of each."""
        agent = self.agents[key]
        incomings = [agent.expect(self.prompt, peer=self.peers[key], mode=mode) for _ in range(n)]
        self.link.send(("send", key, [incoming.request for incoming in incomings]))
        for incoming in incomings:
            agent.wait(incoming, timeout=WAIT_TIMEOUT)
        return incomings, receive(self.link)

    def free(self, key: tuple[int, str], incomings: list) -> None:
        self.caches[key].free_many([incoming.sid for incoming in incomings])

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self.link.send(("stop",))
                self.process.join(timeout=10)
            for agent in self.agents.values():
                agent.close()
        finally:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(timeout=5)


@pytest.fixture(scope="module")
def receiver(pytestconfig):
    # Timed: every request from its own source blocks (none warm in a cache from the last one).
    # Untimed (CI's --benchmark-disable): fewer and shorter, for a run of a few seconds.
    if pytestconfig.getoption("benchmark_disable", False):
        side = Receiver(distinct=8, tokens=QUICK_TOKENS)
    else:
        side = Receiver(distinct=MAX_REQUESTS, tokens=TOKENS)
    try:
        yield side
    finally:
        side.close()


def assert_arrived(cache: PagedCache, sid: int, bs: int, i: int, tokens: int) -> None:
    """The receiver's sequence ``sid`` holds the sender's sequence ``i`` bit for bit."""
    k, v = sequence_kv(bs, i, tokens)
    table = cache.block_table(sid)
    for name, tokens, array in (("K", k, cache.k), ("V", v, cache.v)):
        # [layers, tokens, heads, dim] -> [layers, blocks, heads, bs, dim], the cache's layout
        L, _, H, D = tokens.shape  # noqa: N806
        expected = tokens.reshape(L, -1, bs, H, D).transpose(0, 1, 3, 2, 4)
        np.testing.assert_array_equal(array[:, table], expected, err_msg=f"{name} of request {i}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("requests", REQUESTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("impl, mode", IMPLS)
def test_transfer(benchmark, receiver, impl, mode, block_size, requests, layout):
    tokens = receiver.tokens
    blocks = requests * tokens // block_size
    spec = CacheSpec(block_size=block_size, **SHAPE)
    block_bytes = SHAPE["num_kv_heads"] * block_size * SHAPE["head_dim"] * 2  # one layer's K
    nbytes = transfer_bytes(blocks, SHAPE["num_layers"], block_bytes)
    assert nbytes == blocks * spec.bytes_per_block
    benchmark.group = f"transfer: block_size={block_size} requests={requests} layout={layout}"
    info = benchmark.extra_info
    info.update(SHAPE, impl=impl, mode=mode, block_size=block_size, requests=requests, layout=layout,
                blocks=blocks, tokens_per_request=tokens, bytes=nbytes, device="cpu",
                transport="NIXL over UCX, loopback" if impl == "nixl" else "in-process")  # fmt: skip
    if impl == "nixl":
        key = (block_size, layout)
        last: dict[str, list] = {"incomings": []}

        def free_last():
            receiver.free(key, last["incomings"])

        def move():
            last["incomings"], last["sender"] = receiver.round(key, requests, mode)

        benchmark.pedantic(
            move, setup=free_last, rounds=repeats(benchmark, ROUNDS), warmup_rounds=1
        )
        incomings, sent = last["incomings"], last["sender"]
        cache = receiver.caches[key]
        for i in sorted({0, requests - 1}):
            assert_arrived(cache, incomings[i].sid, block_size, i % receiver.distinct, tokens)
        receiver.free(key, incomings)
        cache.check_invariants()
        sender_seconds = sum(seconds for seconds, _ in sent)
        info["descriptors"] = sum(d for _, d in sent)
        info["sender_seconds_last_round"] = sender_seconds
        info["sender_gbps_last_round"] = gb_per_s(nbytes, sender_seconds)
    else:
        rng = np.random.default_rng(block_size)
        shape = (
            2,
            SHAPE["num_layers"],
            blocks,
            SHAPE["num_kv_heads"],
            block_size,
            SHAPE["head_dim"],
        )
        src = rng.integers(0, 2**16, shape, dtype=np.uint16)  # float16 bits: the bytes only
        dst = np.zeros_like(src)
        per = tokens // block_size
        if layout == "runs":  # request i: blocks i * per ... (i + 1) * per - 1, both sides
            src_ids = dst_ids = [slice(i * per, (i + 1) * per) for i in range(requests)]
        else:
            src_ids = rng.permutation(blocks).reshape(requests, per)
            dst_ids = rng.permutation(blocks).reshape(requests, per)

        def copy():
            for s, d in zip(src_ids, dst_ids, strict=True):
                dst[:, :, d] = src[:, :, s]  # K and V, every layer, of one request's blocks

        benchmark.pedantic(copy, rounds=repeats(benchmark, ROUNDS), warmup_rounds=1)
        for i in sorted({0, requests - 1}):
            np.testing.assert_array_equal(dst[:, :, dst_ids[i]], src[:, :, src_ids[i]])
    seconds = median_seconds(benchmark)
    info["blocks_per_s"] = blocks / seconds
    info["gbps"] = gb_per_s(nbytes, seconds)
