"""Fixtures of the transfer tests: the module's sender process, a sender of one's own (killed at
the end), and receivers (a CPU cache with prefix caching and its agent, closed at the end)."""

from __future__ import annotations

import os
import uuid

import pytest
from transfer_pair import SENDER_SPECS, SPEC, Peer, Sender

from cupaged import PagedCache
from cupaged.transfer import KVTransferAgent


@pytest.fixture(scope="module")
def sender_process():
    """The module's sender process (spawned once: a fresh interpreter costs seconds; not once
    per session: other tests assert that no child process is left)."""
    peer = Peer(SENDER_SPECS, seed=41)
    try:
        yield peer
    finally:
        peer.kill()


@pytest.fixture
def sender(sender_process):
    """``sender(key)``: a cache of the module's sender process; ``sender(key, own=True)``: of a
    process of its own (one a test kills), killed at the end."""
    started = []

    def start(key="fp16", own=False):
        if not own:
            return Sender(sender_process, key)
        peer = Peer(SENDER_SPECS, seed=len(started))
        started.append(peer)
        return Sender(peer, key)

    try:
        yield start
    finally:
        for peer in started:
            peer.kill()


@pytest.fixture
def receiver(monkeypatch):
    """A CPU cache with prefix caching and its agent (a unique name: xdist workers run side by
    side)."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")

    def make(spec=SPEC):
        cache = PagedCache(**{"device": "cpu", **spec}, enable_prefix_caching=True)
        agent = KVTransferAgent(cache, f"decode-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        made.append(agent)
        return cache, agent

    made = []
    yield make
    for agent in made:
        agent.close()
