"""KV blocks moved between two processes on NIXL over loopback (issue 41).

The parent (this pytest process) is the receiver (decode side); a spawned process is the sender
(prefill side, ``transfer_peer.serve``; ``transfer_pair`` and ``conftest`` hold what the tests
share). UCX sees only ``lo``; every wait is bounded and every child is killed in ``finally``.
"""

from __future__ import annotations

import numpy as np
import pytest

try:  # (any ImportError: a CUDA stack whose nixl-cuXX wheel is missing raises a plain one)
    import nixl._api  # noqa: F401
except ImportError as error:
    pytest.skip(
        f"NIXL not usable ({error}): pip install --no-deps nixl nixl-cu12", allow_module_level=True
    )

from transfer_pair import FP8, K_SCALES, SPEC, WAIT_S, Peer, Sender, move, pair  # noqa: E402

from cupaged.transfer import TransferError  # noqa: E402
from cupaged.transfer.blocks import runs  # noqa: E402

MODES = ("read", "write")  # pull (the default), push


@pytest.mark.parametrize("mode", MODES)
def test_scattered_blocks_of_every_layer_arrive_bit_for_bit_and_a_cached_prefix_stays(
    receiver, sender, rng, mode
):
    cache, agent, peer, name = pair(receiver, sender)
    bs = SPEC["block_size"]
    held = peer.call("scatter", 6)  # both sides' free blocks scattered, so runs break
    filler = [cache.admit([5] * bs + [i]).sid for i in range(5)]
    cache.free_many(filler[::2])
    prompt = rng.integers(0, 30000, 5 * bs + 9).tolist()  # 5 full blocks and a partial one
    sid, k, v, table = peer.call("prefill", prompt)

    incoming, stats, sent = move(agent, peer, name, prompt, sid, mode=mode)
    assert (incoming.blocks_cached, incoming.blocks_to_move) == (0, 6)
    got_k, got_v = cache.gather_kv(incoming.sid)
    np.testing.assert_array_equal(got_k.view(np.uint8), k)
    np.testing.assert_array_equal(got_v.view(np.uint8), v)
    assert cache.seq_len(incoming.sid) == len(prompt)
    src_runs = runs(np.array(table), np.array(cache.block_table(incoming.sid)))[0].size
    assert src_runs > 1  # scattered: the runs break
    assert stats.descriptors == sent[4] == 2 * SPEC["num_layers"] * src_runs
    block_bytes = 2 * SPEC["num_layers"] * SPEC["num_kv_heads"] * bs * SPEC["head_dim"] * 2
    assert stats.bytes_moved == sent[2] == 6 * block_bytes
    cache.check_invariants()

    # A second request sharing 3 full blocks: the receiver holds them (committed), so they stay.
    second = prompt[: 3 * bs] + rng.integers(0, 30000, 2 * bs + 1).tolist()
    sid2, k2, v2, _ = peer.call("prefill", second)
    incoming2, stats2, sent2 = move(agent, peer, name, second, sid2, mode=mode)
    assert (incoming2.blocks_cached, incoming2.blocks_to_move) == (3, 3)
    assert (stats2.blocks_moved, stats2.blocks_cached, sent2[0], sent2[1]) == (3, 3, 3, 3)
    assert cache.block_table(incoming2.sid)[:3] == cache.block_table(incoming.sid)[:3]
    got_k, got_v = cache.gather_kv(incoming2.sid)
    np.testing.assert_array_equal(got_k.view(np.uint8), k2)
    np.testing.assert_array_equal(got_v.view(np.uint8), v2)
    cache.check_invariants()
    cache.free_many([incoming.sid, incoming2.sid])
    cache.check_invariants()
    assert held


def test_a_sender_killed_before_its_notification_leaves_nothing_visible(receiver, sender, rng):
    cache, agent, peer, name = pair(receiver, sender, own=True)
    bs = SPEC["block_size"]
    free_before = cache.num_free_blocks
    prompt = rng.integers(0, 30000, 4 * bs + 3).tolist()
    sid, *_ = peer.call("prefill", prompt)
    incoming = agent.expect(prompt, peer=name, mode="write")
    assert cache.num_free_blocks == free_before - 5
    # The blocks are written but the sender dies before it says so.
    peer.post("send", sid, incoming.request, timeout=WAIT_S, notify=False)
    with pytest.raises(TransferError, match="timed out.*freed the 5 block"):
        agent.wait(incoming, timeout=3.0)
    assert peer.result()[0] == 5  # (the writes had completed: written, never visible)
    peer.kill()
    cache.check_invariants()
    assert cache.num_free_blocks == free_before
    assert cache.sequence_ids == []
    again = cache.admit(prompt)  # nothing of the abandoned request is a prefix hit
    assert again.num_cached_tokens == 0
    cache.free(again.sid)
    cache.check_invariants()


def _spec(**changes):
    return {**SPEC, **changes}


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(dtype="float32"), "dtype"),
        (dict(block_size=8), "block_size"),
        (dict(num_kv_heads=4), "num_kv_heads"),
        (dict(num_layers=2), "num_layers"),
        (dict(head_dim=128), "head_dim"),
    ],
)
def test_mismatched_caches_are_refused_before_anything_moves(receiver, change, named):
    cache, agent = receiver()
    _, other = receiver(_spec(**change))
    with pytest.raises(TransferError, match=f"expected {named} .* got "):
        agent.connect(other.metadata())
    with pytest.raises(TransferError, match=f"expected {named} .* got "):
        other.connect(agent.metadata())
    assert agent.peers == [] and other.peers == []


@pytest.mark.parametrize(
    "data, says",
    [
        (b"", "bad peer metadata"),
        (b"garbage" * 10, "bad peer metadata"),
        (b"cupaged-kv-metadata/1\n\xff\xff\xff\x7f{}", "header"),
        (b"cupaged-kv-metadata/1\n\x02\x00\x00\x00{}", "expected name"),
    ],
)
def test_bad_metadata_is_refused(receiver, data, says):
    _, agent = receiver()
    with pytest.raises(TransferError, match=says):
        agent.connect(data)


def test_bad_request_bytes_are_refused_and_the_receiver_is_freed(receiver, sender, rng):
    cache, agent, peer, name = pair(receiver, sender)
    prompt = rng.integers(0, 30000, 40).tolist()
    sid, *_ = peer.call("prefill", prompt)
    incoming = agent.expect(prompt, peer=name)
    good = incoming.request
    bad = [
        b"not a request",
        good[:-5],
        good.replace(b'"first_block":0', b'"first_block":-1'),
        good.replace(b'"num_tokens":40', b'"num_tokens":400'),
        good.replace(f'"sender":"{name}"'.encode(), b'"sender":"someone-else"'),
    ]
    for data in bad:
        peer.post("send", sid, data, timeout=5.0)
        status, message = peer.recv()
        assert status == "error" and "TransferError" in message, message
    # A request for more tokens than the sequence holds: refused, and the receiver told at once.
    peer.post("send", sid + 1000, good, timeout=5.0)
    status, message = peer.recv()
    assert status == "error" and "KeyError" in message, message
    cache.check_invariants()
    incoming2 = agent.expect(prompt + [1] * 30, peer=name)
    peer.post("send", sid, incoming2.request, timeout=5.0)
    with pytest.raises(TransferError, match="sender failed: .*expected sequence .* 70 tokens"):
        agent.wait(incoming2, timeout=WAIT_S)
    assert peer.recv()[0] == "error"
    agent.cancel(incoming)
    cache.check_invariants()
    assert cache.num_free_blocks == cache.num_blocks


def test_fp8_blocks_arrive_bit_for_bit_between_caches_of_equal_scales(receiver, sender, rng):
    cache, agent, peer, name = pair(receiver, sender, "fp8")
    prompt = rng.integers(0, 30000, 2 * SPEC["block_size"] + 5).tolist()
    sid, k, v, table = peer.call("prefill", prompt)
    incoming, stats, sent = move(agent, peer, name, prompt, sid)
    assert stats.blocks_moved == 3
    src_runs = runs(np.array(table), np.array(cache.block_table(incoming.sid)))[0].size
    assert src_runs == 1  # (both pools fresh: consecutive ids, merged into one run)
    assert stats.descriptors == sent[4] == 2 * SPEC["num_layers"]
    got_k, got_v = cache.gather_kv(incoming.sid)
    np.testing.assert_array_equal(got_k.view(np.uint8), k)
    np.testing.assert_array_equal(got_v.view(np.uint8), v)
    assert cache.kv_scales(2)[0].tolist() == [2.0, 2.0]  # the scales the bytes were made with
    cache.check_invariants()


def test_fp8_caches_of_other_or_pending_scales_are_refused(receiver):
    cache, agent = receiver(FP8)
    _, other = receiver(_spec(dtype="float8_e4m3", k_scales=K_SCALES, v_scales=1.0))
    with pytest.raises(TransferError, match="fp8 scales"):
        agent.connect(other.metadata())
    # "auto" scales: not known until the first write, so connecting is allowed but a receiver
    # whose scales are still pending refuses to reserve (the moved bytes would be misread).
    pending, waiting = receiver(_spec(dtype="float8_e4m3", k_scales="auto", v_scales="auto"))
    name = waiting.connect(agent.metadata())
    with pytest.raises(TransferError, match="pending"):
        waiting.expect([1, 2, 3], peer=name)
    assert pending.num_free_blocks == pending.num_blocks
    pending.check_invariants()


@pytest.mark.gpu
def test_gpu_caches_move_blocks_between_registered_device_memory(receiver, sender, rng):
    """VRAM registration: CuPy caches on both sides (skipped without a GPU)."""
    from cupaged.backend import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA GPU (CuPy sees none)")
    gpu = {**SPEC, "device": "cuda"}
    cache, agent = receiver(gpu)
    peer = Sender(Peer({"gpu": gpu}, seed=3), "gpu")
    try:
        name = agent.connect(peer.metadata)
        assert peer.call("connect", agent.metadata()) == agent.name
        prompt = rng.integers(0, 30000, 3 * SPEC["block_size"] + 1).tolist()
        sid, k, v, _ = peer.call("prefill", prompt)
        incoming, stats, _ = move(agent, peer, name, prompt, sid)
        assert stats.blocks_moved == 4
        got_k, got_v = cache.gather_kv(incoming.sid)
        np.testing.assert_array_equal(got_k.view(np.uint8).get(), k)
        np.testing.assert_array_equal(got_v.view(np.uint8).get(), v)
        cache.check_invariants()
    finally:
        peer.kill()


def test_expect_reserves_all_or_nothing_and_close_frees_what_still_waits(receiver):
    from cupaged import OutOfBlocksError

    cache, agent = receiver()
    _, other = receiver()
    name = agent.connect(other.metadata())
    bs, free = SPEC["block_size"], cache.num_free_blocks
    with pytest.raises(OutOfBlocksError):
        agent.expect([3] * (free * bs + 1), peer=name)
    assert cache.num_free_blocks == free and cache.sequence_ids == []
    with pytest.raises(TransferError, match="expected a connected peer"):
        agent.expect([1, 2], peer="nobody")
    first = agent.expect(list(range(2 * bs + 1)), peer=name)
    agent.cancel(first)
    with pytest.raises(ValueError, match="done or cancelled"):
        agent.wait(first, timeout=0.1)
    agent.expect(list(range(3 * bs)), peer=name)
    assert cache.num_free_blocks == free - 3
    agent.close()  # frees the reservation still waiting
    cache.check_invariants()
    assert cache.num_free_blocks == free and cache.sequence_ids == []
    with pytest.raises(ValueError, match="closed"):
        agent.metadata()
