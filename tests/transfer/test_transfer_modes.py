"""Pull and push when a side is late or dies: what can land in whose blocks (issue 41).

Push lets a sender that missed the receiver's cancel write into blocks the receiver freed and
gave to another request: shown here, the hazard docs/transfer.md's "Which mode" describes. Pull
lets nothing write into a cache but its own agent's READ, which frees a reservation only once
that READ can no longer land. A sender made late (``send(..., stall=)``) sleeps without
progressing NIXL once it has checked the request. Every wait is bounded; every child killed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

try:  # (any ImportError: a CUDA stack whose nixl-cuXX wheel is missing raises a plain one)
    from nixl import _api as nixl_api
except ImportError as error:
    pytest.skip(
        f"NIXL not usable ({error}): pip install --no-deps nixl nixl-cu12", allow_module_level=True
    )

from transfer_pair import SPEC, WAIT_S, move, pair  # noqa: E402

from cupaged.transfer import TransferError  # noqa: E402

MODES = ("read", "write")
RECEIVER_S = 1.0  # the receiver's wait in the late-sender tests
LATE_S = 2.5  # the late sender's sleep: past the receiver's wait and its clean-up


def take_every_free_block(cache, rng):
    """A new request B on every free block, its K/V written (as its own prefill would) and
    committed: ``(sid, its blocks, a copy of their K, of their V)``."""
    bs = cache.block_size
    sid = cache.admit(rng.integers(0, 30000, cache.num_free_blocks * bs).tolist()).sid
    blocks = cache.block_table(sid)
    for pages in (cache.k, cache.v):
        for block in blocks:
            pages[:, block].view(np.uint8)[...] = rng.integers(1, 255, dtype=np.uint8)
    cache.commit(sid)
    return sid, blocks, cache.k[:, blocks].copy(), cache.v[:, blocks].copy()


def block_tokens(pages, blocks):
    """``pages[:, blocks]`` as ``[num_layers, len(blocks) * block_size, heads, head_dim]`` bytes
    (the layout ``gather_kv`` returns)."""
    part = pages[:, blocks]  # [layers, n, heads, block_size, head_dim]
    layers, n, heads, bs, dim = part.shape
    return part.transpose(0, 1, 3, 2, 4).reshape(layers, n * bs, heads, dim).view(np.uint8)


def sender_answer(peer, agent):
    """The sender's answer to its last command, the receiver progressing meanwhile (a receiver
    keeps serving: its progress is what completes a late sender's write)."""
    end = time.monotonic() + WAIT_S
    while not peer.peer.conn.poll(0.01):
        agent.progress()
        assert time.monotonic() < end, f"the sender answered nothing in {WAIT_S} s"
    return peer.recv()


@pytest.mark.parametrize("mode", MODES)
def test_a_late_sender_writes_into_another_requests_blocks_in_push_never_in_pull(
    receiver, sender, rng, mode
):
    cache, agent, peer, name = pair(receiver, sender)
    bs = SPEC["block_size"]
    prompt = rng.integers(0, 30000, 4 * bs + 3).tolist()
    sid, k, v, _ = peer.call("prefill", prompt)
    free_before = cache.num_free_blocks
    incoming = agent.expect(prompt, peer=name, mode=mode)
    blocks = cache.block_table(incoming.sid)
    peer.post("send", sid, incoming.request, timeout=WAIT_S, stall=LATE_S)
    with pytest.raises(TransferError, match="timed out.*freed the 5 block"):
        agent.wait(incoming, timeout=RECEIVER_S)
    cache.check_invariants()
    assert cache.num_free_blocks == free_before
    other, other_blocks, k_before, v_before = take_every_free_block(cache, rng)
    assert set(blocks) <= set(other_blocks)  # B holds A's freed blocks now

    status, message = sender_answer(peer, agent)  # the sender wakes up
    cache.check_invariants()
    if mode == "write":
        # The hazard of pushing: the sender had checked the request before the cancel came,
        # and its write landed in B's blocks (B's K/V is now A's, bit for bit).
        assert status == "ok", message
        full = blocks[:4]
        np.testing.assert_array_equal(block_tokens(cache.k, full), k[:, : 4 * bs])
        np.testing.assert_array_equal(block_tokens(cache.v, full), v[:, : 4 * bs])
        assert not np.array_equal(cache.k[:, other_blocks], k_before)
    else:
        # Pulling: the late offer finds no one waiting; nothing reads, nothing writes.
        assert status == "error" and "gave up" in message, message
        np.testing.assert_array_equal(cache.k[:, other_blocks], k_before)
        np.testing.assert_array_equal(cache.v[:, other_blocks], v_before)
    assert agent.quarantined == []
    cache.free(other)
    cache.check_invariants()
    assert cache.num_free_blocks == cache.num_blocks
    assert peer.call("check") > 0


class SlowReads:
    """NIXL as a slow transport shows it: every READ of this process reported in flight
    (``"PROC"``) until :meth:`finish`, whatever it really is. Loopback completes a READ as it is
    posted, so a READ still in flight at the deadline is made this way; the sender stays real."""

    def __init__(self, monkeypatch) -> None:
        self.stuck, agent = True, nixl_api.nixl_agent
        transfer, check = agent.transfer, agent.check_xfer_state

        def slow_transfer(nixl, handle, *args):
            state = transfer(nixl, handle, *args)
            return "PROC" if self.stuck and state == "DONE" else state

        def slow_check(nixl, handle):
            state = check(nixl, handle)
            return "PROC" if self.stuck and state == "DONE" else state

        monkeypatch.setattr(agent, "transfer", slow_transfer)
        monkeypatch.setattr(agent, "check_xfer_state", slow_check)

    def finish(self) -> None:
        self.stuck = False


def test_a_read_in_flight_at_the_deadline_keeps_its_blocks_until_it_ends(
    receiver, sender, rng, monkeypatch
):
    cache, agent, peer, name = pair(receiver, sender)
    bs = SPEC["block_size"]
    prompt = rng.integers(0, 30000, 4 * bs + 3).tolist()
    sid, *_ = peer.call("prefill", prompt)
    free_before = cache.num_free_blocks
    slow = SlowReads(monkeypatch)
    incoming = agent.expect(prompt, peer=name)
    blocks = cache.block_table(incoming.sid)
    peer.post("send", sid, incoming.request, timeout=WAIT_S)
    with pytest.raises(TransferError, match="had not ended by the deadline.*quarantined"):
        agent.wait(incoming, timeout=RECEIVER_S)
    # Not freed: the READ may still land. Owned by the sequence the agent keeps, invisible.
    assert agent.quarantined == [incoming.sid]
    cache.check_invariants()
    assert cache.num_free_blocks == free_before - 5
    assert cache.block_table(incoming.sid) == blocks
    other, other_blocks, k_before, v_before = take_every_free_block(cache, rng)
    assert not set(blocks) & set(other_blocks)  # B cannot get them
    status, message = peer.recv()  # the receiver's cancel ends the sender's hold
    assert status == "error" and "gave up" in message, message
    agent.progress()
    assert agent.quarantined == [incoming.sid]  # (still reported in flight)

    slow.finish()  # the READ ends: the next poll frees its blocks
    agent.progress()
    assert agent.quarantined == []
    cache.check_invariants()
    np.testing.assert_array_equal(cache.k[:, other_blocks], k_before)
    np.testing.assert_array_equal(cache.v[:, other_blocks], v_before)
    cache.free(other)
    assert cache.num_free_blocks == cache.num_blocks
    again = cache.admit(prompt)  # nothing of the abandoned request is a prefix hit
    assert again.num_cached_tokens == 0
    cache.free(again.sid)
    cache.check_invariants()
    assert peer.call("check") > 0


def test_a_sender_killed_during_its_hold_leaves_the_receiver_clean(receiver, sender, rng):
    cache, agent, peer, name = pair(receiver, sender, own=True)
    bs = SPEC["block_size"]
    first = rng.integers(0, 30000, 2 * bs + 1).tolist()  # wires the connection up both ways
    sid, *_ = peer.call("prefill", first)
    incoming, stats, _ = move(agent, peer, name, first, sid)
    cache.free(incoming.sid)
    prompt = rng.integers(0, 30000, 4 * bs + 3).tolist()
    sid, *_ = peer.call("prefill", prompt)
    free_before = cache.num_free_blocks
    incoming = agent.expect(prompt, peer=name)
    peer.post("send", sid, incoming.request, timeout=WAIT_S)
    time.sleep(1.0)  # the sender offers and holds; this side has not read yet
    peer.kill()
    with pytest.raises(TransferError, match="ended in ERR.*freed the 5 block"):
        agent.wait(incoming, timeout=5.0)
    assert agent.quarantined == []
    cache.check_invariants()
    assert cache.num_free_blocks == free_before
    assert cache.sequence_ids == []
    again = cache.admit(prompt)
    assert again.num_cached_tokens == 0
    cache.free(again.sid)
    cache.check_invariants()


def test_a_sender_holds_its_blocks_for_its_hold_and_no_read_commits_after_it(receiver, sender, rng):
    cache, agent, peer, name = pair(receiver, sender)
    bs = SPEC["block_size"]
    first = rng.integers(0, 30000, bs + 1).tolist()  # (a wired connection: the offer arrives)
    sid, *_ = peer.call("prefill", first)
    cache.free(move(agent, peer, name, first, sid)[0].sid)
    prompt = rng.integers(0, 30000, 3 * bs).tolist()
    sid, *_ = peer.call("prefill", prompt)
    free_before = cache.num_free_blocks
    incoming = agent.expect(prompt, peer=name)
    peer.post("send", sid, incoming.request, timeout=0.5)  # this side reads nothing meanwhile
    status, message = peer.recv()
    assert status == "error" and "within the hold of 0.5 s" in message, message
    with pytest.raises(TransferError, match="hold"):  # (its offer, or its "fail", says so)
        agent.wait(incoming, timeout=5.0)
    assert agent.quarantined == []
    cache.check_invariants()
    assert cache.num_free_blocks == free_before
    assert cache.admit(prompt).num_cached_tokens == 0
    assert peer.call("check") > 0


def test_an_offer_that_may_come_after_its_hold_ended_is_never_read(receiver, sender, rng):
    # The receiver counts the sender's hold from its own expect(), the earliest the offer can
    # have left: an offer whose hold may have ended by the time it arrives reads nothing.
    cache, agent, peer, name = pair(receiver, sender)
    bs = SPEC["block_size"]
    first = rng.integers(0, 30000, bs + 1).tolist()  # (a wired connection: the offer arrives)
    sid, *_ = peer.call("prefill", first)
    cache.free(move(agent, peer, name, first, sid)[0].sid)
    prompt = rng.integers(0, 30000, 2 * bs + 1).tolist()
    sid, *_ = peer.call("prefill", prompt)
    free_before = cache.num_free_blocks
    incoming = agent.expect(prompt, peer=name)
    peer.post("send", sid, incoming.request, timeout=0.5, stall=1.0)  # offers 1 s late
    with pytest.raises(TransferError, match="the offer came after the sender's hold: nothing"):
        agent.wait(incoming, timeout=WAIT_S)
    status, message = peer.recv()  # (the receiver's cancel, or the end of the hold)
    assert status == "error" and ("gave up" in message or "hold of 0.5 s" in message), message
    assert agent.quarantined == []
    cache.check_invariants()
    assert cache.num_free_blocks == free_before
    assert cache.admit(prompt).num_cached_tokens == 0
