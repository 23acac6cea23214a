"""write_kv and copy_blocks: bit-exact against the oracles of ``cupaged.attention.reference`` (themselves
checked against plain loops), and every argument check."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import DTYPES, cpu_stride_threads, poison, random_array, recorded_cpu_launches

import cupaged
from cupaged._arrays import checks as _checks
from cupaged._arrays.checks import check_slots
from cupaged.attention.reference import reference_copy_blocks, reference_write_kv

SHAPE = (6, 2, 4, 16)  # [num_blocks, num_kv_heads, block_size, head_dim]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_write_kv_scatters_by_slot_and_skips_minus_one(rng, xp, dtype, slot_dtype):
    k_cache, v_cache = poison(SHAPE, dtype), poison(SHAPE, dtype)
    k = random_array(rng, (5, 2, 16), dtype)
    v = random_array(rng, (5, 2, 16), dtype)
    slots = np.array([9, -1, 0, 23, 4], slot_dtype)  # blocks 2, -, 0, 5, 1
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    reference_write_kv(expected_k, expected_v, k, v, slots)

    caches = xp.asarray(k_cache), xp.asarray(v_cache)
    cupaged.write_kv(*caches, xp.asarray(k), xp.asarray(v), xp.asarray(slots), checked=True)

    got_k, got_v = (cupaged.to_numpy(c) for c in caches)
    np.testing.assert_array_equal(got_k.view(np.uint8), expected_k.view(np.uint8))  # NaN-safe
    np.testing.assert_array_equal(got_v.view(np.uint8), expected_v.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers", [(), (3,)], ids=["one-layer", "all-layers"])
def test_copy_blocks_copies_every_layer(rng, xp, dtype, layers):
    k_cache = random_array(rng, (*layers, *SHAPE), dtype)
    v_cache = random_array(rng, (*layers, *SHAPE), dtype)
    src, dst = np.array([4, 0, 2], np.int32), np.array([1, 5, 3], np.int32)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    reference_copy_blocks(expected_k, expected_v, src, dst)

    caches = xp.asarray(k_cache), xp.asarray(v_cache)
    cupaged.copy_blocks(*caches, xp.asarray(src), xp.asarray(dst), checked=True)

    got_k, got_v = (cupaged.to_numpy(c) for c in caches)
    np.testing.assert_array_equal(got_k, expected_k)
    np.testing.assert_array_equal(got_v, expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_oracles_equal_plain_loops(rng, xp, dtype):
    """reference_write_kv and reference_copy_blocks, on either array module, against a loop over
    the tokens and the pairs (whole-cache copies over every layer, padding slots skipped)."""
    k_cache, v_cache = random_array(rng, (3, *SHAPE), dtype), random_array(rng, (3, *SHAPE), dtype)
    k, v = random_array(rng, (4, 2, 16), dtype), random_array(rng, (4, 2, 16), dtype)
    slots = np.array([22, -1, 5, 8], np.int64)  # blocks 5, -, 1, 2
    src, dst = np.array([5, 1], np.int32), np.array([0, 3], np.int32)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected_k[0, slot // 4, :, slot % 4] = k[t]
            expected_v[0, slot // 4, :, slot % 4] = v[t]
    for s, d in zip(src, dst, strict=True):
        expected_k[:, d], expected_v[:, d] = expected_k[:, s], expected_v[:, s]

    got_k, got_v = xp.asarray(k_cache), xp.asarray(v_cache)
    reference_write_kv(got_k[0], got_v[0], xp.asarray(k), xp.asarray(v), xp.asarray(slots))
    reference_copy_blocks(got_k, got_v, xp.asarray(src), xp.asarray(dst))
    for got, expected in ((got_k, expected_k), (got_v, expected_v)):
        got = cupaged.to_numpy(got)
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("threads", [32, 96])
def test_stride_kernels_with_several_threads_on_the_cpu_backend(rng, threads):
    """The CPU backend runs write_kv and copy_blocks with one thread per block (a fiber start costs
    more than the loop it saves); the GPU runs warps that stride over the words. Both kernels are
    run here on the CPU backend with several threads too (each thread striding over 2-16 words), so
    that the GPU's partition of the words is checked there."""
    shape = (6, 4, 16, 64)  # a block of 8 KiB: 512 16-byte words; a token's row: 64 float4
    with cpu_stride_threads(threads):
        k_cache, v_cache = poison(shape, "float32"), poison(shape, "float32")
        k, v = random_array(rng, (3, 4, 64), "float32"), random_array(rng, (3, 4, 64), "float32")
        slots = np.array([37, 0, 95], np.int32)
        expected_k, expected_v = k_cache.copy(), v_cache.copy()
        for t, slot in enumerate(slots):
            expected_k[slot // 16, :, slot % 16], expected_v[slot // 16, :, slot % 16] = k[t], v[t]
        cupaged.write_kv(k_cache, v_cache, k, v, slots)
        np.testing.assert_array_equal(k_cache.view(np.uint8), expected_k.view(np.uint8))
        np.testing.assert_array_equal(v_cache.view(np.uint8), expected_v.view(np.uint8))

        k_cache, v_cache = random_array(rng, shape, "float16"), random_array(rng, shape, "float16")
        src, dst = np.array([4, 0], np.int32), np.array([1, 5], np.int32)
        expected_k, expected_v = k_cache.copy(), v_cache.copy()
        expected_k[dst], expected_v[dst] = k_cache[src], v_cache[src]
        cupaged.copy_blocks(k_cache, v_cache, src, dst)
        np.testing.assert_array_equal(k_cache, expected_k)
        np.testing.assert_array_equal(v_cache, expected_v)


def test_stride_launches_take_helper_threads_by_bytes_on_the_cpu_backend():
    """On the CPU backend a copy or a write runs one thread per block whatever its size, and takes
    the runtime's helper threads only for a launch of many bytes in large blocks, or of very many
    bytes in any (helpers cost more than they save on small launches; the runtime's own rule counts
    CUDA threads, not bytes)."""
    from cupaged.kernels.cpu import threads as cpu_threads
    from cupaged.kernels.launch_copies import (
        CPU_STRIDE_THREADS,
        copy_blocks_launch,
        write_kv_launch,
    )

    enough, block = cpu_threads.POOL_MIN_BYTES, cpu_threads.POOL_MIN_BLOCK_BYTES
    for blocks in (1, 64, 4096, 1 << 16):
        *_, threads = write_kv_launch("float16", np.int32, blocks, 256, True, 2, "cpu")
        assert threads == (CPU_STRIDE_THREADS,) == (1,)
        *_, threads, _ = copy_blocks_launch(4096, True, blocks, 1, "cpu")
        assert threads == (1,)
    assert cpu_threads.stride_workers(enough // block, block) == enough // block
    assert cpu_threads.stride_workers(enough // block - 1, block) == 1  # too few bytes
    assert cpu_threads.stride_workers(2 * enough // block, block // 2) == 1  # blocks too small
    large = cpu_threads.POOL_LARGE_BYTES
    assert cpu_threads.stride_workers(large // 256, 256) == large // 256  # past the caches
    assert cpu_threads.stride_workers(large // 256 - 1, 256) == 1
    assert cpu_threads.stride_workers(1, enough) == 1  # one block: one thread anyway
    *_, threads = write_kv_launch("float16", np.int32, 1, 256, True, 2, "cuda")
    assert threads == (32,)  # the GPU's warps whatever the size


def test_large_stride_launches_run_on_helper_threads_and_stay_exact(rng):
    """A write and a copy at the byte threshold (4 MiB in 4 KiB and 32 KiB blocks): the launches
    ask for helper threads, and the result is bit-exact against plain loops."""
    from cupaged.kernels.cpu import current_options
    from cupaged.kernels.cpu import threads as cpu_threads

    forced = current_options().workers  # CUPAGED_CPU_WORKERS sets every launch's OS threads
    heads, block_size, head_dim = 8, 16, 128  # a token's K and V rows: 4 KiB
    tokens = cpu_threads.POOL_MIN_BYTES // (2 * heads * head_dim * 2)
    block_bytes = heads * block_size * head_dim * 2  # 32 KiB
    pairs = cpu_threads.POOL_MIN_BYTES // (2 * block_bytes)  # K and V: 4 MiB in all
    shape = (2 * pairs + 8, heads, block_size, head_dim)  # room for the tokens and the pairs
    k_cache, v_cache = poison(shape, "float16"), poison(shape, "float16")
    k = random_array(rng, (tokens, heads, head_dim), "float16")
    v = random_array(rng, (tokens, heads, head_dim), "float16")
    slots = rng.permutation(shape[0] * block_size)[:tokens].astype(np.int32)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    expected_k[slots // block_size, :, slots % block_size] = k
    expected_v[slots // block_size, :, slots % block_size] = v
    with recorded_cpu_launches() as launches:
        cupaged.write_kv(k_cache, v_cache, k, v, slots)
    assert [workers for _, workers in launches] == [forced or min(tokens, cpu_threads.cpu_count())]
    np.testing.assert_array_equal(k_cache.view(np.uint16), expected_k.view(np.uint16))
    np.testing.assert_array_equal(v_cache.view(np.uint16), expected_v.view(np.uint16))

    src = rng.permutation(shape[0])[:pairs].astype(np.int32)
    dst = np.setdiff1d(np.arange(shape[0]), src)[rng.permutation(shape[0] - pairs)[:pairs]]
    dst = dst.astype(np.int32)
    expected_k[dst], expected_v[dst] = k_cache[src], v_cache[src]
    with recorded_cpu_launches() as launches:
        cupaged.copy_blocks(k_cache, v_cache, src, dst)
    np.testing.assert_array_equal(k_cache.view(np.uint16), expected_k.view(np.uint16))
    np.testing.assert_array_equal(v_cache.view(np.uint16), expected_v.view(np.uint16))
    copies = [forced or min(2 * pairs, cpu_threads.cpu_count())]  # K and V: a block each
    assert [workers for _, workers in launches] == copies


def test_attention_launches_take_helper_threads_from_two_blocks_on_the_cpu_backend(rng):
    """Attention blocks are heavy on the CPU backend: a decode or prefill launch may use one OS
    thread per block (the runtime caps it at its CPUs), and the result does not depend on it."""
    from cupaged.attention import layer as _attention
    from cupaged.kernels.cpu import launch_options
    from cupaged.kernels.cpu import threads as cpu_threads
    from cupaged.kernels.launch_decode import decode_launch
    from cupaged.kernels.launch_prefill import prefill_launch

    assert cpu_threads.attention_workers((2, 3)) == 6
    assert cpu_threads.attention_workers((1, 1, 1)) == 1
    prefill = prefill_launch(
        "float16",
        2,
        2,
        4,
        128,
        16,
        8,
        query_start_loc=np.array([0, 8, 16]),
        context_lens=np.array([8, 8]),
        total_query_tokens=16,
    )
    for source, launch in (
        ("paged_attention.cu", decode_launch("float16", 2, 4, 128, 16, 8)),
        ("paged_prefill.cu", prefill),
    ):
        kernel = _attention.attention_kernel("cpu", source, launch, 4, 128)
        blocks = int(np.prod(launch.grid))
        assert kernel.workers == min(blocks, cpu_threads.cpu_count()), source
    batch, context, block_size = 4, 64, 16
    blocks = batch * context // block_size
    k_cache = random_array(rng, (blocks, 2, block_size, 128), "float16")
    v_cache = random_array(rng, (blocks, 2, block_size, 128), "float16")
    q = random_array(rng, (batch, 8, 128), "float16")
    tables = rng.permutation(blocks).astype(np.int32).reshape(batch, -1)
    lens = rng.integers(1, context + 1, batch).astype(np.int32)
    with recorded_cpu_launches() as launches:  # the launch table's choice
        cupaged.paged_attention(q, k_cache, v_cache, tables, lens)
    decode = [  # either kernel: G = 4 takes the tensor cores on sm_80/sm_90, not on a T4
        workers
        for name, workers in launches
        if name.startswith(("cupaged::paged_decode<", "cupaged::paged_decode_mma<"))
    ]
    assert decode == [min(2 * batch, cpu_threads.cpu_count())]  # 2 KV heads x >= 1 item each
    # One KV head (MQA): the helper threads come from the items too, not the heads alone.
    with recorded_cpu_launches() as launches:
        cupaged.paged_attention(q, k_cache[:, :1].copy(), v_cache[:, :1].copy(), tables, lens)
    decode = [
        workers for name, workers in launches if name.startswith("cupaged::paged_decode_mma<")
    ]
    assert decode == [min(batch, cpu_threads.cpu_count())]
    outs = []
    for workers in (2, 1):  # two OS threads forced (whatever the CPUs), then one
        with launch_options(workers=workers):
            outs.append(cupaged.paged_attention(q, k_cache, v_cache, tables, lens))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_empty_inputs_are_no_ops(rng):
    k_cache = random_array(rng, SHAPE, "float16")
    before = k_cache.copy()
    empty = np.zeros((0, 2, 16), np.float16)
    cupaged.write_kv(k_cache, k_cache.copy(), empty, empty, np.zeros(0, np.int32), checked=True)
    none = np.zeros(0, np.int32)
    cupaged.copy_blocks(k_cache, k_cache.copy(), none, none, checked=True)
    np.testing.assert_array_equal(k_cache, before)


def write_args(rng, **change):
    args = dict(
        k_cache=random_array(rng, SHAPE, "float32"),
        v_cache=random_array(rng, SHAPE, "float32"),
        k=random_array(rng, (3, 2, 16), "float32"),
        v=random_array(rng, (3, 2, 16), "float32"),
        slot_mapping=np.array([0, 5, 9], np.int32),
    )
    return args | change


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            dict(k=np.ones((3, 4, 16), np.float32)),
            ValueError,
            r"expected k of shape \(num_tokens, num_kv_heads=2, head_dim=16\), got \(3, 4, 16\)",
        ),
        (
            dict(v=np.ones((2, 2, 16), np.float32)),
            ValueError,
            r"expected v of shape \(num_tokens=3, num_kv_heads=2, head_dim=16\), got \(2, 2, 16\)",
        ),
        (
            dict(slot_mapping=np.zeros(4, np.int32)),
            ValueError,
            r"expected slot_mapping of shape \(num_tokens=3\), got \(4,\)",
        ),
        (
            dict(slot_mapping=np.zeros(3, np.float32)),
            TypeError,
            "expected slot_mapping of dtype int32 or int64, got float32",
        ),
        (
            dict(k=np.ones((3, 2, 16), np.float16)),
            TypeError,
            r"expected k of dtype float32 \(the cache's dtype\), got float16",
        ),
        (
            dict(v_cache=np.ones(SHAPE, np.float16)),
            TypeError,
            r"expected v_cache of dtype float32 \(k_cache's dtype\), got float16",
        ),
        (
            dict(v_cache=np.ones((6, 2, 4, 8), np.float32)),
            ValueError,
            r"expected v_cache of shape \(num_blocks=6, num_kv_heads=2, block_size=4, head_dim=16\)",
        ),
        (
            dict(slot_mapping=np.array([0, 24, 1], np.int32)),
            ValueError,
            r"expected slot_mapping values in \[0, 24\) \(num_blocks \* block_size\) or -1, got \[24\]",
        ),
        (
            dict(slot_mapping=np.array([0, -2, 1], np.int32)),
            ValueError,
            r"expected slot_mapping values in \[0, 24\) .* or -1, got \[-2\]",
        ),
        (
            dict(slot_mapping=np.array([3, 1, 3], np.int32)),
            ValueError,
            "expected distinct slots in slot_mapping, got a slot written twice",
        ),
        (dict(k=[0.0]), TypeError, "expected a NumPy or CuPy array, got list"),
    ],
)
def test_write_kv_rejects_bad_arguments_before_writing(rng, change, error, message):
    cupaged.write_kv(**write_args(rng))  # valid shapes first: their checks are remembered
    args = write_args(rng, **change)
    before = args["k_cache"].copy(), args["v_cache"].copy()
    for _ in range(2):  # a failing check is never remembered: it raises every time
        with pytest.raises(error, match=message):
            cupaged.write_kv(**args)  # checked by default
    np.testing.assert_array_equal(args["k_cache"], before[0])
    np.testing.assert_array_equal(args["v_cache"], before[1])


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([0, 6], [1, 2], r"expected block ids in \[0, 6\)"),
        ([0, 1], [-1, 2], r"expected block ids in \[0, 6\)"),
        ([0, 1], [2, 2], "expected distinct destination blocks, got dst \\[2, 2\\]"),
        ([0, 1], [1, 2], "expected no block both a source and a destination, got src \\[0, 1\\]"),
    ],
)
def test_copy_blocks_rejects_bad_ids_by_default(rng, src, dst, message):
    k_cache = random_array(rng, SHAPE, "float16")
    before = k_cache.copy()
    with pytest.raises(ValueError, match=message):
        cupaged.copy_blocks(
            k_cache, k_cache.copy(), np.array(src, np.int32), np.array(dst, np.int32)
        )
    np.testing.assert_array_equal(k_cache, before)


def test_copy_blocks_shape_and_dtype_errors(rng):
    k_cache = random_array(rng, SHAPE, "float16")
    ids = np.array([0], np.int32)
    with pytest.raises(ValueError, match=r"expected k_cache of shape \(\[num_layers,\] num_blocks"):
        cupaged.copy_blocks(k_cache[0], k_cache[0], ids, ids)
    with pytest.raises(TypeError, match=r"expected v_cache of dtype float16 \(k_cache's dtype\)"):
        cupaged.copy_blocks(k_cache, k_cache.astype(np.float32), ids, ids)
    with pytest.raises(ValueError, match=r"expected dst of shape \(num_copies=1\), got \(2,\)"):
        cupaged.copy_blocks(k_cache, k_cache.copy(), ids, np.array([1, 2], np.int32))
    with pytest.raises(TypeError, match="expected src of dtype int32 or int64, got float64"):
        cupaged.copy_blocks(k_cache, k_cache.copy(), ids.astype(float), ids)


# ---- Checked by default, before any narrowing; read-only outputs (issue 10) -------------------------


@pytest.mark.parametrize("bad", [2**32 + 1, 2**33, -(2**32)])
def test_int64_slots_are_checked_before_they_are_narrowed(rng, bad):
    args = write_args(rng, slot_mapping=np.array([0, bad, 9], np.int64))
    before = args["k_cache"].copy()
    with pytest.raises(ValueError, match="expected slot_mapping values in"):
        cupaged.write_kv(**args)
    np.testing.assert_array_equal(args["k_cache"], before)


# The Python path for a few slots, the array path past _checks.SMALL_INDEX_ARRAY.
@pytest.mark.parametrize("n", [5, _checks.SMALL_INDEX_ARRAY + 1])
def test_slot_checks_refuse_the_same_slots_on_both_paths(rng, n):
    capacity = 6 * 4 * 16  # 6 blocks of 16 tokens, times 4: room for the array path's slots
    slots = rng.permutation(capacity)[:n].astype(np.int64)
    slots[0] = -1  # padding passes
    check_slots(slots, capacity)
    for bad, message in [
        (capacity, "expected slot_mapping values in"),
        (-2, "values in"),
        (2**32 + 3, "values in"),
        (int(slots[1]), "written twice"),
    ]:
        wrong = slots.copy()
        wrong[-1] = bad
        with pytest.raises(ValueError, match=message):
            check_slots(wrong, capacity)


# The Python path for a few ids, the array path past _checks.SMALL_INDEX_ARRAY.
@pytest.mark.parametrize("n", [3, _checks.SMALL_INDEX_ARRAY + 1])
def test_int64_copy_pairs_are_checked_before_they_are_narrowed(rng, n):
    k_cache = random_array(rng, (320, 2, 4, 16), "float16")
    before = k_cache.copy()
    src = np.arange(n, dtype=np.int64)
    dst = np.arange(n, 2 * n, dtype=np.int64)
    src[1] = 2**32 + 1  # would be block 1 after a cast to int32
    with pytest.raises(ValueError, match=r"expected block ids in \[0, 320\)"):
        cupaged.copy_blocks(k_cache, k_cache.copy(), src, dst)
    src[1], dst[-1] = 1, 2  # 2 is also a source
    with pytest.raises(ValueError, match="expected no block both a source and a destination"):
        cupaged.copy_blocks(k_cache, k_cache.copy(), src, dst)
    dst[-1] = dst[0]
    with pytest.raises(ValueError, match="expected distinct destination blocks"):
        cupaged.copy_blocks(k_cache, k_cache.copy(), src, dst)
    np.testing.assert_array_equal(k_cache, before)


def test_many_slots_are_checked_on_the_array_path(rng):
    k_cache = random_array(rng, (64, 2, 4, 16), "float32")
    tokens = random_array(rng, (40, 2, 16), "float32")
    slots = np.arange(40, dtype=np.int64) * 3
    slots[7] = 256  # one past the end
    with pytest.raises(ValueError, match=r"got \[256\]"):
        cupaged.write_kv(k_cache, k_cache.copy(), tokens, tokens, slots)
    slots[7] = slots[8]
    with pytest.raises(ValueError, match="expected distinct slots"):
        cupaged.write_kv(k_cache, k_cache.copy(), tokens, tokens, slots)
    slots[7] = -1
    cupaged.write_kv(k_cache, k_cache.copy(), tokens, tokens, slots)


def test_unchecked_calls_still_work_for_valid_arguments(rng):
    args = write_args(rng)
    cupaged.write_kv(**args, checked=False)
    np.testing.assert_array_equal(args["k_cache"][2, :, 1], args["k"][2])  # slot 9
    k_cache = random_array(rng, SHAPE, "float16")
    v_cache = k_cache.copy()
    cupaged.copy_blocks(k_cache, v_cache, np.array([0]), np.array([3]), checked=False)
    np.testing.assert_array_equal(k_cache[3], k_cache[0])


def _read_only(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x.flags.writeable = False
    return x


def _over_bytes(x: np.ndarray) -> np.ndarray:
    return np.frombuffer(x.tobytes(), x.dtype).reshape(x.shape)


@pytest.mark.parametrize("make", [_read_only, _over_bytes], ids=["writeable-false", "bytes"])
@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_read_only_caches_are_refused(rng, make, which):
    args = write_args(rng)
    args[which] = make(args[which])
    data = bytes(args[which].data)
    with pytest.raises(ValueError, match=f"expected {which} writable"):
        cupaged.write_kv(**args)
    caches = dict(k_cache=args["k_cache"], v_cache=args["v_cache"])
    with pytest.raises(ValueError, match=f"expected {which} writable"):
        cupaged.copy_blocks(**caches, src=np.array([0]), dst=np.array([1]))
    assert bytes(args[which].data) == data


def test_read_only_inputs_are_fine(rng):
    args = write_args(rng)
    for name in ("k", "v", "slot_mapping"):
        args[name] = _read_only(args[name])
    cupaged.write_kv(**args)
    np.testing.assert_array_equal(args["k_cache"][1, :, 1], args["k"][1])  # slot 5
