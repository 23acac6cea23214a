"""Every public error path: clear messages, and nothing changes when a call is rejected."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_array
from test_cache import assert_unchanged, kv, make_cache, snapshot

import cupaged
from cupaged import CupagedError, PagedCache
from cupaged import backend as _backend


@pytest.fixture
def cache(rng):
    cache = make_cache(num_blocks=8)
    sid = cache.add_sequence()
    cache.append(sid, *kv(cache, rng, 5))
    return cache


def test_freeing_twice_names_the_freed_sequence(cache):
    cache.free(0)
    with pytest.raises(KeyError, match="sequence 0 was already freed"):
        cache.free(0)
    assert cache.num_free_blocks == 8
    cache.check_invariants()


@pytest.mark.parametrize("call", ["fork", "free", "seq_len", "block_table", "gather_kv"])
@pytest.mark.parametrize("sid", [99, -1, "0", None, True, [0]])
def test_unknown_sequence_ids_raise_key_error(cache, call, sid):
    before = snapshot(cache)
    with pytest.raises(KeyError, match="unknown sequence id"):
        getattr(cache, call)(sid)
    assert_unchanged(cache, before)


def test_unknown_ids_in_batches_raise_key_error_and_change_nothing(cache, rng):
    before = snapshot(cache)
    with pytest.raises(KeyError, match="unknown sequence id 7"):
        cache.reserve([0, 7])
    with pytest.raises(KeyError, match="unknown sequence id 7"):
        cache.block_tables([0, 7])
    with pytest.raises(KeyError):
        cache.append(7, *kv(cache, rng, 1))
    assert_unchanged(cache, before)


def test_k_and_v_of_different_shapes(cache, rng):
    before = snapshot(cache)
    k, _ = kv(cache, rng, 3)
    _, v = kv(cache, rng, 2)
    with pytest.raises(
        ValueError,
        match=r"expected k and v of the same shape, got k \(2, 3, 2, 64\) "
        r"and v \(2, 2, 2, 64\)",
    ):
        cache.append(0, k, v)
    assert_unchanged(cache, before)


@pytest.mark.parametrize(
    "shape, message",
    [
        (
            (1, 3, 2, 64),
            r"expected k of shape \(num_layers=2, n_tokens, num_kv_heads=2, "
            r"head_dim=64\), got \(1, 3, 2, 64\)",
        ),
        ((2, 3, 4, 64), r"got \(2, 3, 4, 64\)"),
        ((2, 3, 2, 8), r"got \(2, 3, 2, 8\)"),
        ((3, 2, 64), r"got \(3, 2, 64\)"),
    ],
)
def test_wrong_shapes_name_expected_and_got(cache, rng, shape, message):
    before = snapshot(cache)
    bad = random_array(rng, shape, "float32")
    with pytest.raises(ValueError, match=message):
        cache.append(0, bad, bad)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int32"])
def test_wrong_dtypes_name_expected_and_got(cache, rng, dtype):
    before = snapshot(cache)
    k, v = kv(cache, rng, 2)
    bad = k.astype(dtype) if dtype != "bfloat16" else random_array(rng, k.shape, "bfloat16")
    expected_name = "bfloat16" if dtype == "bfloat16" else dtype
    with pytest.raises(TypeError, match=f"expected k of dtype float32 .*got {expected_name}"):
        cache.append(0, bad, v)
    with pytest.raises(TypeError, match=f"expected v of dtype float32 .*got {expected_name}"):
        cache.append(0, k, bad)
    assert_unchanged(cache, before)


def test_non_arrays_are_rejected(cache, rng):
    k, v = kv(cache, rng, 1)
    with pytest.raises(TypeError, match="expected a NumPy or CuPy array, got list"):
        cache.append(0, k.tolist(), v)
    cache.check_invariants()


def test_reserve_argument_errors_change_nothing(cache):
    cache.add_sequence()
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"expected distinct sequence ids, got \[0, 1, 0\]"):
        cache.reserve([0, 1, 0])
    with pytest.raises(ValueError, match=r"expected one token count per sequence \(2\), got 3"):
        cache.reserve([0, 1], [1, 2, 3])
    with pytest.raises(
        ValueError,
        match=r"expected num_tokens in 0 \.\. \d+ \(what the pool can ever hold\), got -1",
    ):
        cache.reserve([0, 1], [1, -1])
    with pytest.raises(TypeError, match="expected num_tokens to be an int"):
        cache.reserve([0, 1], 1.5)
    assert_unchanged(cache, before)


def test_batch_reserve_that_cannot_finish_reserves_for_none(cache):
    others = [cache.add_sequence() for _ in range(3)]
    before = snapshot(cache)  # 6 blocks free; sequence 0 has 3 free slots in its last block
    with pytest.raises(cupaged.OutOfBlocksError, match="reserving 19 token.* needs 7 .* got 6"):
        cache.reserve([0, *others], num_tokens=[4, 5, 5, 5])
    assert_unchanged(cache, before)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(dtype="int8"), TypeError, "expected dtype one of"),
        (dict(dtype="uint16"), TypeError, "expected dtype one of"),
        (dict(device="gpu"), ValueError, "expected device 'cuda', 'cpu' or None, got 'gpu'"),
        (dict(block_size=0), ValueError, "expected block_size >= 1, got 0"),
        (dict(num_blocks=0), ValueError, "expected num_blocks >= 1, got 0"),
        (dict(head_dim=2.5), TypeError, "expected head_dim to be an int"),
        (dict(num_blocks=2**27, block_size=32), ValueError, r"num_blocks \* block_size <= "),
        (
            dict(head_dim=100),
            ValueError,
            r"expected head_dim in 64..256, a multiple of 16 \(64, 80",
        ),
        (dict(head_dim=8), ValueError, "expected head_dim in 64..256"),
        (dict(block_size=512), ValueError, r"expected block_size in 1..256, got 512"),
    ],
)
def test_constructor_errors(kwargs, error, message):
    args = (
        dict(
            num_blocks=4,
            block_size=4,
            num_layers=1,
            num_kv_heads=1,
            head_dim=64,
            dtype="float32",
            device="cpu",
        )
        | kwargs
    )
    with pytest.raises(error, match=message):
        PagedCache(**args)


def test_cuda_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(_backend, "cuda_available", lambda: False)
    with pytest.raises(CupagedError, match="device='cuda' was requested but"):
        PagedCache(4, head_dim=64, device="cuda")
    assert PagedCache(4, head_dim=64, device=None).device == "cpu"


def test_dtype_spellings():
    import ml_dtypes

    for spelling in ("bfloat16", "bf16", ml_dtypes.bfloat16):
        assert PagedCache(2, head_dim=64, dtype=spelling, device="cpu").k.dtype == np.uint16
    for spelling in ("float16", np.float16, "half"):
        assert PagedCache(2, head_dim=64, dtype=spelling, device="cpu").k.dtype == np.float16


def test_the_attention_shape_check_has_an_explicit_opt_out():
    cache = PagedCache(4, block_size=512, head_dim=100, dtype="float32", device="cpu",
                       attention_kernels=False)  # fmt: skip
    sid = cache.add_sequence()
    k = np.ones((1, 3, 1, 100), np.float32)
    cache.append(sid, k, k)  # the bookkeeping and the K/V write work at any shape
    assert cache.gather_kv(sid)[0].shape == (1, 3, 1, 100)
    tables, lens = cache.block_tables([sid])
    with pytest.raises(ValueError, match="expected head_dim in 64..256"):
        cupaged.paged_attention(
            np.ones((1, 1, 100), np.float32), cache.k[0], cache.v[0], tables, lens
        )


def test_bools_are_not_sequence_ids(cache):
    second = cache.add_sequence()
    assert second == 1
    with pytest.raises(KeyError, match="unknown sequence id True"):
        cache.free(True)
    assert cache.sequence_ids == [0, 1]
