"""The inputs that crashed the process or read outside the arrays (issue 10, "At the kernel boundary").

Each case builds fresh random arrays, makes one public call and returns what happened: ``"refused
<Error>: <message>"`` for a clear exception, ``"correct"`` when the call must succeed and match the
reference. Run as ``python kernel_safety_cases.py CASE...`` (one line per case on stdout, exit 0),
by tests/kernels/test_safety_kernels.py (one child per case, so a crash fails one test) and by
tests/kernels/test_sanitizer.py (every case in one child of the ASan build, which must report nothing).
"""

from __future__ import annotations

import sys

import numpy as np

import cupaged

BLOCK_SIZE, NUM_BLOCKS, HEAD_DIM = 16, 8, 64


def _attention_inputs(lens, table_width=3, dtype=np.int32):
    """A batch over an 8-block cache; tables of ``table_width`` entries (48 tokens)."""
    rng = np.random.default_rng(len(lens))
    k = rng.standard_normal((NUM_BLOCKS, 2, BLOCK_SIZE, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    q = rng.standard_normal((len(lens), 4, HEAD_DIM)).astype(np.float32)
    tables = np.stack([rng.permutation(NUM_BLOCKS)[:table_width] for _ in lens]).astype(dtype)
    return q, k, v, tables, np.array(lens, dtype)


def _attend_with_block(block_id, dtype=np.int32):
    q, k, v, tables, lens = _attention_inputs([40, 5], dtype=dtype)
    tables[0, 2] = block_id  # reached by sequence 0's tokens 32..39
    return cupaged.paged_attention(q, k, v, tables, lens)


def _attend_with_length(length, dtype=np.int32, **kwargs):
    q, k, v, tables, lens = _attention_inputs([5, 5], dtype=dtype)
    lens[0] = length
    return cupaged.paged_attention(q, k, v, tables, lens, **kwargs)


def _write_slot(slot, dtype=np.int64):
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((NUM_BLOCKS, 2, BLOCK_SIZE, HEAD_DIM)).astype(np.float32)
    new = rng.standard_normal((2, 2, HEAD_DIM)).astype(np.float32)
    cupaged.write_kv(cache, cache.copy(), new, new, np.array([3, slot], dtype))


def _copy(src, dst, dtype=np.int32):
    rng = np.random.default_rng(2)
    cache = rng.standard_normal((2, NUM_BLOCKS, 2, BLOCK_SIZE, HEAD_DIM)).astype(np.float32)
    cupaged.copy_blocks(cache, cache.copy(), np.array(src, dtype), np.array(dst, dtype))


def _understated_max_context_len(checked):
    q, k, v, tables, lens = _attention_inputs([128, 100, 1], table_width=NUM_BLOCKS)
    expected = cupaged.reference_attention(q, k, v, tables, lens)
    for hint in (0, 1, 16, 32):
        for splits in (None, 1, 3):
            out = cupaged.paged_attention(q, k, v, tables, lens, max_context_len=hint,
                                          num_splits=splits, checked=checked)  # fmt: skip
            np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    return "correct"


def _read_only_out():
    q, k, v, tables, lens = _attention_inputs([20, 3])
    out = np.frombuffer(bytes(q.nbytes), np.float32).reshape(q.shape)
    cupaged.paged_attention(q, k, v, tables, lens, out=out)


def _write_into_bytes():
    rng = np.random.default_rng(3)
    frozen = bytes(NUM_BLOCKS * 2 * BLOCK_SIZE * HEAD_DIM * 4)
    cache = np.frombuffer(frozen, np.float32).reshape(NUM_BLOCKS, 2, BLOCK_SIZE, HEAD_DIM)
    new = rng.standard_normal((1, 2, HEAD_DIM)).astype(np.float32)
    try:
        cupaged.write_kv(cache, cache, new, new, np.array([0], np.int32))
    finally:
        assert frozen == bytes(len(frozen)), "the immutable bytes object was written"


def _copy_read_only():
    cache = np.zeros((NUM_BLOCKS, 2, BLOCK_SIZE, HEAD_DIM), np.float32)
    cache.flags.writeable = False
    cupaged.copy_blocks(cache, cache, np.array([0]), np.array([1]))


CASES = {
    "block_id_1e6": lambda: _attend_with_block(10**6),
    "block_id_minus_1e6": lambda: _attend_with_block(-(10**6)),
    "block_id_num_blocks": lambda: _attend_with_block(NUM_BLOCKS),
    "block_id_minus_1": lambda: _attend_with_block(-1),
    "block_id_2_32_plus_1_int64": lambda: _attend_with_block(2**32 + 1, np.int64),
    "context_49_of_48": lambda: _attend_with_length(49),
    "context_5000": lambda: _attend_with_length(5000),
    "context_2_31_minus_1_max_32": lambda: _attend_with_length(2**31 - 1, max_context_len=32),
    "context_negative": lambda: _attend_with_length(-5),
    "context_2_32_plus_5_int64": lambda: _attend_with_length(2**32 + 5, np.int64),
    "max_context_len_understated": lambda: _understated_max_context_len(True),
    "max_context_len_understated_unchecked": lambda: _understated_max_context_len(False),
    "slot_1e6": lambda: _write_slot(10**6),
    "slot_2_33": lambda: _write_slot(2**33),
    "slot_one_past_the_end": lambda: _write_slot(NUM_BLOCKS * BLOCK_SIZE, np.int32),
    "slot_minus_2": lambda: _write_slot(-2, np.int32),
    "copy_src_1e6": lambda: _copy([10**6], [1]),
    "copy_dst_1e6": lambda: _copy([1], [10**6]),
    "copy_src_minus_3": lambda: _copy([-3], [1]),
    "copy_src_2_32_plus_1_int64": lambda: _copy([2**32 + 1], [2], np.int64),
    "read_only_out": _read_only_out,
    "write_kv_into_bytes": _write_into_bytes,
    "copy_blocks_read_only": _copy_read_only,
}


def run(name: str) -> str:
    try:
        result = CASES[name]()
    except (ValueError, TypeError) as error:
        return f"refused {type(error).__name__}: {error}"
    return result if result == "correct" else "accepted (no exception)"


if __name__ == "__main__":
    for case in sys.argv[1:] or list(CASES):
        print(f"{case}: {run(case)}", flush=True)
