"""What the transfer tests share: the caches' shapes, the sender process and its commands.

The parent (the pytest process) is the receiver (decode side); a spawned process is the sender
(prefill side, ``transfer_peer.serve``). Every wait is bounded by ``WAIT_S``.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid

import numpy as np
import transfer_peer

SPEC = dict(
    num_blocks=48, block_size=16, num_layers=3, num_kv_heads=2, head_dim=64, dtype="float16"
)
WAIT_S = 60.0  # the most any step of a test waits for the other process (spawn included)


K_SCALES = np.array([0.5, 0.25, 2.0], np.float32)  # per layer (3 layers)
FP8 = {
    **SPEC,
    "dtype": "float8_e4m3",
    "k_scales": K_SCALES,
    "v_scales": np.array([1.5, 3.0, 0.125], np.float32),
}
# The sender's caches, one process for a module: a larger pool (it frees nothing).
SENDER_SPECS = {"fp16": {**SPEC, "num_blocks": 192}, "fp8": {**FP8, "num_blocks": 192}}


class Peer:
    """A sender process and its pipe; every wait bounded by ``WAIT_S``."""

    def __init__(self, specs: dict, seed: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.name = f"prefill-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.process = context.Process(
            target=transfer_peer.serve, args=(child, specs, self.name, seed), daemon=True
        )
        self.process.start()
        child.close()
        self.metadata = self.recv()

    def recv(self):
        if not self.conn.poll(WAIT_S):
            raise TimeoutError(f"the sender process sent nothing in {WAIT_S} s")
        return self.conn.recv()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(WAIT_S)
        self.conn.close()


class Sender:
    """One cache (``key``) of a sender process: its metadata, and commands to it."""

    def __init__(self, peer: Peer, key: str) -> None:
        self.peer, self.key, self.metadata = peer, key, peer.metadata[key]
        while peer.conn.poll(0):  # a failed test's answers left unread: not this test's
            peer.conn.recv()

    def post(self, command: str, *args, **kwargs) -> None:
        self.peer.conn.send((command, self.key, args, kwargs))

    def recv(self):
        return self.peer.recv()

    def result(self):
        status, value = self.recv()
        assert status == "ok", value
        return value

    def call(self, command: str, *args, **kwargs):
        self.post(command, *args, **kwargs)
        return self.result()

    def kill(self) -> None:
        self.peer.kill()


def pair(receiver, sender, key="fp16", own=False):
    cache, agent = receiver(FP8 if key == "fp8" else SPEC)
    peer = sender(key, own)
    name = agent.connect(peer.metadata)
    assert peer.call("connect", agent.metadata()) == agent.name
    return cache, agent, peer, name


def move(agent, peer, name, prompt, sid, incoming=None, mode="read"):
    """expect (unless given), send in the sender while this process waits; both stats."""
    incoming = incoming or agent.expect(prompt, peer=name, mode=mode)
    peer.post("send", sid, incoming.request, timeout=WAIT_S)
    stats = agent.wait(incoming, timeout=WAIT_S)
    return incoming, stats, peer.result()
