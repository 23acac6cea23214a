"""The transfer layer's parts that need no NIXL: runs, descriptor rows, the checked bytes."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from cupaged import PagedCache
from cupaged.transfer import TransferError, nixl_available
from cupaged.transfer.agent import KVTransferAgent
from cupaged.transfer.blocks import cache_layout, descriptor_rows, runs
from cupaged.transfer.wire import (
    Request,
    decode_ids,
    decode_metadata,
    decode_request,
    encode_ids,
    encode_metadata,
    encode_request,
    parse_message,
    parse_ready,
    ready_message,
)
from cupaged.transfer.writes import source_blocks

SPEC = dict(num_blocks=32, block_size=4, num_layers=3, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        ([], [], ([], [], [])),
        ([5], [9], ([5], [9], [1])),
        ([1, 2, 3, 4], [6, 7, 8, 2], ([1, 4], [6, 2], [3, 1])),
        ([1, 2, 3], [3, 2, 1], ([1, 2, 3], [3, 2, 1], [1, 1, 1])),
        ([0, 1, 7, 8, 9], [4, 5, 6, 7, 8], ([0, 7], [4, 6], [2, 3])),
    ],
)
def test_runs_merge_ids_consecutive_on_both_sides(src, dst, expected):
    got = runs(np.array(src, np.int64), np.array(dst, np.int64))
    assert tuple(part.tolist() for part in got) == expected


def test_descriptor_rows_address_every_layer_of_k_then_v(rng):
    cache = PagedCache(**SPEC, dtype="float16", device="cpu", enable_prefix_caching=True)
    layout = cache_layout(cache, "a")
    starts, lengths = np.array([3, 10]), np.array([2, 5])
    rows = descriptor_rows(layout, starts, lengths)
    assert rows.shape == (2 * 3 * 2, 3) and rows.dtype == np.uint64
    block = 2 * 4 * 64 * 2
    for i, (pages, layer, run) in enumerate(
        (p, layer, r) for p in (cache.k, cache.v) for layer in range(3) for r in range(2)
    ):
        first = pages[layer, starts[run]]
        assert rows[i, 0] == first.ctypes.data, i
        assert (
            rows[i, 1]
            == lengths[run] * block
            == pages[layer, starts[run] : starts[run] + lengths[run]].nbytes
        )
        assert rows[i, 2] == 0


def test_metadata_round_trips_and_every_bad_field_is_refused():
    cache = PagedCache(**SPEC, dtype="float16", device="cpu")
    layout = cache_layout(cache, "prefill-0")
    assert decode_metadata(encode_metadata(layout, b"nixl")) == (layout, b"nixl")
    header = encode_metadata(layout, b"nixl")
    for old, new, says in [
        (b'"block_size":4', b'"block_size":0', "block_size a positive int"),
        (b'"block_size":4', b'"block_size":"4"', "block_size a positive int"),
        (b'"memory":"DRAM"', b'"memory":"DISK"', "memory DRAM or VRAM"),
        (b'"k_scales":null', b'"k_scales":[[1,2]]', "k_scales"),
        (b'"name":"prefill-0"', b'"name":7', "name a str"),
    ]:
        bad = header.replace(old, new)
        bad = bad[:22] + len(bad[26:-4]).to_bytes(4, "little") + bad[26:]
        with pytest.raises(TransferError, match=says):
            decode_metadata(bad)
    with pytest.raises(TransferError, match="NIXL agent's metadata"):
        decode_metadata(encode_metadata(layout, b""))
    with pytest.raises(TransferError, match="expected bytes, got str"):
        decode_metadata("text")


def test_a_layout_names_the_first_field_that_differs():
    a = cache_layout(PagedCache(**SPEC, dtype="float16", device="cpu"), "a")
    b = cache_layout(PagedCache(**{**SPEC, "num_blocks": 8}, dtype="float16", device="cpu"), "b")
    assert a.mismatch(b) is None  # pool sizes and addresses may differ
    c = cache_layout(PagedCache(**{**SPEC, "head_dim": 128}, dtype="float16", device="cpu"), "c")
    assert a.mismatch(c) == "expected head_dim 64 (this cache), got 128 (peer 'c')"


def test_request_bytes_round_trip_and_are_checked_against_the_cache():
    request = Request("t.1", "d", "p", 1, 10, [7, 3])
    assert decode_request(encode_request(request), 4, 32) == request
    data = encode_request(request)
    for bad, says in [
        (data.replace(b"[7,3]", b"[7,3,5]"), "expected 2 distinct block ids"),
        (data.replace(b"[7,3]", b"[7,7]"), "distinct"),
        (data.replace(b"[7,3]", b"[7,32]"), "in 0 .. 31"),
        (data.replace(b'"num_tokens":10', b'"num_tokens":0'), "num_tokens >= 1"),
        (data.replace(b'"sender":"p"', b'"sender":""'), "sender a non-empty str"),
        (data[:-1], "expected JSON"),
        (b"[1]", "starting"),
    ]:
        with pytest.raises(TransferError, match=says):
            decode_request(bad, 4, 32)


def test_a_request_names_its_mode_and_the_digest_covers_it():
    pull, push = (
        Request("t.1", "d", "p", 1, 10, [7, 3]),
        Request("t.1", "d", "p", 1, 10, [7, 3], mode="write"),
    )
    assert pull.mode == "read" and pull.digest() != push.digest()
    assert decode_request(encode_request(push), 4, 32) == push
    with pytest.raises(TransferError, match="expected mode one of .* got 'copy'"):
        decode_request(encode_request(push).replace(b'"write"', b'"copy"'), 4, 32)


@pytest.mark.parametrize(
    "ids, text",
    [([], "-"), ([5], "5"), ([4, 5, 6, 9], "4-6,9"), ([9, 4, 5, 0], "9,4-5,0"), ([2, 1], "2,1")],
)
def test_offered_block_ids_travel_as_runs(ids, text):
    assert encode_ids(np.array(ids, np.int64)) == text
    assert decode_ids(text, len(ids)).tolist() == ids
    if ids:  # (never more ids than the caller expects)
        assert decode_ids(text, len(ids) - 1) is None


def test_an_offer_is_checked_against_the_request_and_the_senders_pool():
    request = Request("t.1", "d", "p", 0, 10, [7, 3, 4])
    message = ready_message(request, np.array([1, 2, 9]), hold=2.5)
    kind, tid, rest = parse_message(message)
    assert (kind, tid) == ("ready", "t.1")
    ids, hold = parse_ready(rest, request.digest(), 3, 16)
    assert ids.tolist() == [1, 2, 9] and hold == 2.5
    digest = request.digest()
    for bad in (
        rest.replace(digest, "0" * 16),  # another request's
        rest.replace("1-2,9", "1-2"),  # too few
        rest.replace("1-2,9", "1-2,2"),  # not distinct
        rest.replace("1-2,9", "1-2,16"),  # outside the sender's pool
        rest.replace("1-2,9", "1-99999999"),  # (no large array made)
        rest.replace("2500", "-1"),
        "garbage",
    ):
        with pytest.raises(TransferError, match="bad offer: expected digest"):
            parse_ready(bad, digest, 3, 16)


def test_notifications_of_others_are_not_ours():
    assert parse_message(b"cupaged-kv/1 done t.1 abc 1 2 3") == ("done", "t.1", "abc 1 2 3")
    assert parse_message(b"cupaged-kv/1 cancel t.1") == ("cancel", "t.1", "")
    assert parse_message(b"cupaged-kv/1 ready t.1 abc 5 1-3") == ("ready", "t.1", "abc 5 1-3")
    for other in (b"vllm done t.1", b"cupaged-kv/1 launch t.1", b"cupaged-kv/1 done", "text"):
        assert parse_message(other) is None


def test_the_sender_checks_its_sequence_and_fp8_scales_before_anything_moves():
    cache = PagedCache(**SPEC, dtype="float16", device="cpu", enable_prefix_caching=True)
    sid = cache.admit(list(range(10))).sid
    assert source_blocks(cache, sid, Request("t", "d", "p", 1, 10, [4, 5])).tolist() == [1, 2]
    with pytest.raises(TransferError, match="hold the request's 11 tokens, got 10"):
        source_blocks(cache, sid, Request("t", "d", "p", 0, 11, [4, 5, 6]))
    with pytest.raises(KeyError):
        source_blocks(cache, sid + 1, Request("t", "d", "p", 0, 1, [4]))
    auto = PagedCache(
        **SPEC, dtype="float8_e4m3", device="cpu", enable_prefix_caching=True, k_scales="auto"
    )
    sid = auto.admit([1, 2, 3]).sid
    fixed = [[1.0, 1.0]] * 3
    with pytest.raises(TransferError, match='this cache\'s "auto" scales still pending'):
        source_blocks(auto, sid, Request("t", "d", "p", 0, 3, [4], fixed, fixed))


def test_without_nixl_an_agent_names_the_install_command(monkeypatch):
    for name in ("nixl", "nixl._api"):  # (importing them now raises ImportError)
        monkeypatch.setitem(sys.modules, name, None)
    assert not nixl_available()
    cache = PagedCache(**SPEC, dtype="float16", device="cpu")
    with pytest.raises(ImportError, match="pip install --no-deps nixl nixl-cu12"):
        KVTransferAgent(cache, "x")
