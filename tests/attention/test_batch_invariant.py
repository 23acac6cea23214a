"""``batch_invariant=True`` (DESIGN §3, docs/batch-invariance.md): a sequence's output is bitwise
the same in any batch and at any position in it, on one device and build.

The CPU backend runs a thread block's work on one OS thread in a fixed order, so equal bits are
a real check there: a sequence whose reduction order changed with the batch shows it in its
last bits. Each case draws a pool of 64 sequences of random lengths (a zero-length one, a
one-token one, and long ones that the fixed chunk cuts into several pieces), then runs each
sequence in batches of 64, 7 and 1, at different positions, among others of any length, and
holds every run of a sequence to the same bits (outputs NaN-poisoned first), and the batch of
64 to the float64 reference through ``assert_close``. The default mode is shown to differ on a
case built for it (a long sequence that a busy batch cuts into larger pieces), so the tests can
fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, poison, random_array, random_paged_batch
from test_variants_decode import variant_arrays

import cupaged
from cupaged.backend import to_numpy
from cupaged.dtypes import from_float
from cupaged.kernels.launch_decode import INVARIANT_SPLIT_TOKENS, MAX_GRID_YZ

NUM_KV_HEADS = 2
HEAD_DIM = 64
BLOCK_SIZE = 16
POOL = 64
LONG = (1500, 900)  # cut into 6 and 4 pieces of 256 tokens
K_SCALE, V_SCALE = 0.8, 1.3  # an fp8 cache's scales
VARIANTS = {
    "plain": {},
    "window": dict(window_left=300),
    "soft_cap": dict(logits_soft_cap=2.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "all": dict(window_left=600, logits_soft_cap=2.5, alibi=True, sinks=True),
}
# (cache dtype, GQA group, variant): every dtype plain and with every variant at once (fp8:
# float8_e4m3 under float16 queries), each variant alone; groups of 8 at 16 bits take the
# tensor-core kernels.
CASES = [
    ("float32", 2, "plain"),
    ("float32", 2, "all"),
    ("float16", 8, "plain"),
    ("float16", 8, "all"),
    ("bfloat16", 4, "plain"),
    ("bfloat16", 4, "all"),
    ("float8_e4m3", 8, "plain"),
    ("float8_e4m3", 2, "all"),
    ("float32", 1, "window"),
    ("float16", 2, "soft_cap"),
    ("bfloat16", 8, "alibi"),
    ("float32", 4, "sinks"),
]


def bits(x) -> np.ndarray:
    """``x`` on the host as unsigned integers of its width: equal bits, NaN included."""
    x = np.ascontiguousarray(to_numpy(x))
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def q_dtype_of(dtype: str) -> str:
    return "float16" if dtype.startswith("float8") else dtype


def pool_lengths(rng: np.random.Generator) -> list[int]:
    """64 lengths: the long ones first, then 0, 1 and random lengths up to 600."""
    rest = rng.integers(2, 600, POOL - len(LONG) - 2).tolist()
    return [*LONG, 0, 1, *rest]


def decode_pool(rng, dtype, group):
    """A pool of sequences over one cache: ``(q, k, v, tables, lens, scales)`` (NumPy), fp8 K/V
    written as a write does (``x / scale``) under float16 queries."""
    q, k, v, tables, lens, scales = decode_pool_of(rng, pool_lengths(rng), dtype, group)
    if dtype.startswith("float8"):
        q = random_array(rng, q.shape, "float16")
    return q, k, v, tables, lens, scales


def batches(rng, target: int) -> list[np.ndarray]:
    """Row orders of the pool: the whole pool with ``target`` first and then last, the pool cut
    into batches of 7 (and one of 1), ``target`` at each of the 7 positions of a batch of 7
    among random others, and ``target`` alone."""
    others = np.array([i for i in range(POOL) if i != target])
    runs = [
        np.array([target, *rng.permutation(others)]),
        np.array([*rng.permutation(others), target]),
    ]
    shuffled = rng.permutation(POOL)
    runs += [shuffled[i : i + 7] for i in range(0, POOL, 7)]
    for position in range(7):
        run = rng.choice(others, 6, replace=False).tolist()
        runs.append(np.array(run[:position] + [target] + run[position:]))
    runs.append(np.array([target]))
    return runs


def every_row_the_same(outputs: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """Assert that every sequence's rows over all ``(rows, output)`` runs have one bit
    pattern; return how many runs the sequence seen most often was in."""
    seen: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    for rows, out in outputs:
        out = bits(out)
        for position, row in enumerate(rows.tolist()):
            if row in seen:
                assert np.array_equal(seen[row], out[position]), (
                    f"expected sequence {row}'s output bitwise equal in every batch, got a "
                    f"difference in a batch of {len(rows)} at position {position}"
                )
            else:
                seen[row] = out[position]
            counts[row] = counts.get(row, 0) + 1
    assert sorted(seen) == list(range(POOL))
    return max(counts.values())


# ---- decode ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, group, variant", CASES)
def test_decode_rows_are_bitwise_the_same_in_any_batch(rng, dtype, group, variant):
    q, k, v, tables, lens, scales = decode_pool(rng, dtype, group)
    kwargs = variant_arrays(rng, q.shape[1], VARIANTS[variant])
    q_dtype = q_dtype_of(dtype)
    outputs = []
    for rows in batches(rng, 0) + batches(rng, 1)[:2]:
        out = poison((len(rows), *q.shape[1:]), q_dtype)
        got = cupaged.paged_attention(
            q[rows], k, v, tables[rows], lens[rows], out=out, batch_invariant=True,
            **kwargs, **scales,
        )  # fmt: skip
        outputs.append((rows, got))
    assert every_row_the_same(outputs) >= 10  # the long sequence: 2 + 1 + 7 + 1 runs
    expected = cupaged.reference_attention(
        q, k, v, tables, lens, compute_dtype="float64", out_dtype="float64", **kwargs, **scales
    )
    rows, got = outputs[0]
    assert_close(got, expected[rows], q_dtype)

    # A plan re-planned for another order of the same size (update: the same buffers, a CUDA
    # graph's replay) gives the same bits as the one-shot calls.
    sinks = kwargs.pop("sinks", None)
    first, second = outputs[0][0], outputs[1][0]
    plan = cupaged.DecodePlan(
        tables[first], lens[first], k, q.shape[1], batch_invariant=True, q_dtype=q_dtype,
        **kwargs,
    )  # fmt: skip
    items = plan.num_items
    plan.update(tables[second], lens[second])
    assert plan.num_items == items
    out = poison((POOL, *q.shape[1:]), q_dtype)
    again = plan.run(q[second], k, v, sinks=sinks, out=out, **scales)
    assert np.array_equal(bits(again), bits(outputs[1][1]))


def test_decode_pieces_are_fixed_and_the_work_list_holds_any_lengths(rng):
    """Every piece but a sequence's last holds the fixed chunk, from its first attended token;
    the capacity is ``num_seqs * (1 + ceil(attended / chunk))`` of the table's width
    (window-capped), so the planner never grows the chunk, whatever the lengths."""
    q, k, v, tables, lens, _ = decode_pool(rng, "float32", 2)
    width = tables.shape[1] * BLOCK_SIZE
    for window in (-1, 300):
        plan = cupaged.DecodePlan(tables, lens, k, q.shape[1], batch_invariant=True,
                                  window_left=window)  # fmt: skip
        chunk = INVARIANT_SPLIT_TOKENS  # the float32 kernel's tile (16) divides it
        attended = width if window < 0 else min(width, window + 1)
        assert plan.num_items == POOL * (1 + -(-attended // chunk)) and plan.batch_invariant
        work = plan.work()
        for s, length in enumerate(lens.tolist()):
            first = 0 if window < 0 else max(0, length - 1 - window)
            pieces = work[work[:, 0] == s]
            count = max(1, -(-(length - first) // chunk))
            assert len(pieces) == count and (pieces[:, 3] == count).all()
            assert pieces[:, 1].tolist() == [first + j * chunk for j in range(count)]
            assert pieces[-1, 2] == length
        # Every sequence as long as the table: exactly the capacity, no chunk growth.
        plan.update(tables, np.full(POOL, width, np.int32), checked=False)
        assert (plan.work()[:, 0] >= 0).sum() == plan.num_items - POOL
        sizes = np.diff(plan.work()[:, 1:3], axis=1)
        assert sizes.max() == min(chunk, attended)


def test_decode_default_mode_differs_with_the_batch(rng):
    """The default split is balanced by tokens over the batch: a long sequence among many long
    ones gets larger pieces than alone, and other bits; batch_invariant keeps them."""
    lengths = [1500] + rng.integers(300, 700, POOL - 1).tolist()
    q, k, v, tables, lens, _ = random_paged_batch(rng, lengths, 4, HEAD_DIM, 4, 16, "float32")
    alone, busy = np.array([0]), np.arange(POOL)
    results = {}
    for invariant in (False, True):
        for rows in (alone, busy):
            plan = cupaged.DecodePlan(tables[rows], lens[rows], k, q.shape[1],
                                      batch_invariant=invariant)  # fmt: skip
            work = plan.work()
            out = plan.run(q[rows], k, v, out=poison((len(rows), 16, HEAD_DIM), "float32"))
            results[invariant, len(rows)] = (work[work[:, 0] == 0], bits(out)[0])
    (work_alone, row_alone), (work_busy, row_busy) = results[False, 1], results[False, POOL]
    assert len(work_alone) > len(work_busy)  # the busy batch cut it into fewer, larger pieces
    assert not np.array_equal(row_alone, row_busy)  # and its bits changed
    (work_alone, row_alone), (work_busy, row_busy) = results[True, 1], results[True, POOL]
    assert np.array_equal(work_alone, work_busy) and np.array_equal(row_alone, row_busy)


def test_decode_refusals(rng):
    q, k, v, tables, lens, _ = decode_pool(rng, "float32", 2)
    with pytest.raises(ValueError, match=r"expected num_splits=None with batch_invariant=True"):
        cupaged.paged_attention(q, k, v, tables, lens, num_splits=2, batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant"):
        cupaged.DecodePlan(tables, lens, k, q.shape[1], batch_invariant="yes")
    # The work list is one grid axis: a wide table of many sequences outgrows it.
    wide = np.zeros((POOL, MAX_GRID_YZ // POOL * INVARIANT_SPLIT_TOKENS // BLOCK_SIZE), np.int32)
    with pytest.raises(ValueError, match=r"with batch_invariant=True .* narrower table"):
        cupaged.DecodePlan(wide, np.zeros(POOL, np.int32), k, q.shape[1], batch_invariant=True)


# ---- prefill -----------------------------------------------------------------------------------

PREFILL_VARIANTS = {**VARIANTS, "window": dict(window_left=40), "all": dict(
    window_left=70, logits_soft_cap=2.5, alibi=True, sinks=True)}  # fmt: skip


def prefill_pool(rng, dtype, group):
    """64 sequences over one cache, each with its own query rows: ``(queries, k, v, tables,
    lens, scales)``, ``queries[s]`` sequence ``s``'s ``[n_s, num_q_heads, head_dim]`` rows (the
    last ``n_s`` of its ``lens[s]`` tokens). Long prompts, chunks after a cached prefix (some
    past the fixed decode chunk), decode rows and an empty one."""
    counts = [37, 5, 0, 1, 1, *rng.integers(1, 24, POOL - 5).tolist()]
    past = [0, 700, 30, 0, 300, *rng.integers(0, 200, POOL - 5).tolist()]
    lengths = [n + p for n, p in zip(counts, past, strict=True)]
    q, k, v, tables, lens, scales = decode_pool_of(rng, lengths, dtype, group)
    num_q_heads = q.shape[1]
    q_dtype = q_dtype_of(dtype)
    queries = [random_array(rng, (n, num_q_heads, HEAD_DIM), q_dtype) for n in counts]
    return queries, k, v, tables, lens, scales


def decode_pool_of(rng, lengths, dtype, group):
    """``decode_pool`` of given lengths."""
    store = "float32" if dtype.startswith("float8") else dtype
    q, k, v, tables, lens, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, HEAD_DIM, group, BLOCK_SIZE, store
    )
    scales = {}
    if dtype.startswith("float8"):
        k, v = from_float(k / K_SCALE, dtype), from_float(v / V_SCALE, dtype)
        scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    return q, k, v, tables, lens, scales


def packed(queries, rows):
    """The packed query rows of the sequences ``rows`` in that order, and their starts."""
    counts = [len(queries[s]) for s in rows]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return np.concatenate([queries[s] for s in rows]), starts


def per_sequence(out, starts) -> list[np.ndarray]:
    out = bits(out)
    return [out[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


@pytest.mark.parametrize("dtype, group, variant", CASES)
def test_prefill_rows_are_bitwise_the_same_in_any_batch(rng, dtype, group, variant):
    queries, k, v, tables, lens, scales = prefill_pool(rng, dtype, group)
    kwargs = variant_arrays(rng, queries[0].shape[1], PREFILL_VARIANTS[variant])
    q_dtype = q_dtype_of(dtype)
    outputs = []
    for rows in batches(rng, 0) + batches(rng, 1)[:2]:
        q, starts = packed(queries, rows)
        out = poison(q.shape, q_dtype)
        got = cupaged.paged_prefill(
            q, k, v, tables[rows], lens[rows], starts, out=out, batch_invariant=True,
            **kwargs, **scales,
        )  # fmt: skip
        outputs.append((rows, per_sequence(got, starts)))
    seen: dict[int, list[np.ndarray]] = {}
    for rows, pieces in outputs:
        for position, (row, piece) in enumerate(zip(rows.tolist(), pieces, strict=True)):
            first = seen.setdefault(row, piece)
            assert np.array_equal(first, piece), (
                f"expected sequence {row}'s rows bitwise equal in every batch, got a "
                f"difference in a batch of {len(rows)} at position {position}"
            )
    assert sorted(seen) == list(range(POOL))
    rows = outputs[0][0]
    q, starts = packed(queries, rows)
    expected = cupaged.reference_prefill(
        q, k, v, tables[rows], lens[rows], starts, compute_dtype="float64", out_dtype="float64",
        **kwargs, **scales,
    )  # fmt: skip
    got = np.concatenate(outputs[0][1]).view(poison((1,), q_dtype).dtype)
    assert_close(got, expected, q_dtype)


def test_prefill_default_mode_differs_with_the_batch(rng):
    """The default splits the KV ranges of a batch too small to fill the GPU (split-K, pieces
    from the batch's tokens), and not those of a busy batch: a few queries over a long context
    get other bits alone than among many sequences; batch_invariant keeps them."""
    counts = [4, *rng.integers(9, 24, POOL - 1).tolist()]
    lengths = [3000, *(n + int(rng.integers(0, 200)) for n in counts[1:])]
    _, k, v, tables, lens, _ = decode_pool_of(rng, lengths, "float32", 2)
    queries = [random_array(rng, (n, 2 * NUM_KV_HEADS, HEAD_DIM), "float32") for n in counts]
    results = {}
    for invariant in (False, True):
        for rows in (np.array([0]), np.arange(POOL)):
            q, starts = packed(queries, rows)
            plan = cupaged.PrefillPlan(tables[rows], lens[rows], starts, k, q.shape[1],
                                       batch_invariant=invariant)  # fmt: skip
            out = plan.run(q, k, v, out=poison(q.shape, "float32"))
            results[invariant, len(rows)] = (plan.num_splits, per_sequence(out, starts)[0])
    (splits_alone, alone), (splits_busy, busy) = results[False, 1], results[False, POOL]
    assert splits_alone > 1 == splits_busy and not np.array_equal(alone, busy)
    (splits_alone, alone), (splits_busy, busy) = results[True, 1], results[True, POOL]
    assert splits_alone == splits_busy == 1 and np.array_equal(alone, busy)


def test_prefill_refusals(rng):
    queries, k, v, tables, lens, _ = prefill_pool(rng, "float32", 2)
    q, starts = packed(queries, np.arange(POOL))
    with pytest.raises(ValueError, match=r"expected num_splits=None with batch_invariant=True"):
        cupaged.paged_prefill(q, k, v, tables, lens, starts, num_splits=1, batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant"):
        cupaged.PrefillPlan(tables, lens, starts, k, q.shape[1], batch_invariant=1)
    plan = cupaged.PrefillPlan(tables, lens, starts, k, q.shape[1], batch_invariant=True)
    assert plan.batch_invariant and plan.num_splits == 1


# ---- the cache's plans and the model -----------------------------------------------------------


@pytest.fixture
def made_plans(monkeypatch) -> list[tuple[str, bool]]:
    """``(class name, batch_invariant)`` of every DecodePlan and PrefillPlan made meanwhile."""
    made = []
    for cls in (cupaged.DecodePlan, cupaged.PrefillPlan):

        def init(self, *args, _real=cls.__init__, **kwargs):
            _real(self, *args, **kwargs)
            made.append((type(self).__name__, self.batch_invariant))

        monkeypatch.setattr(cls, "__init__", init)
    return made


@pytest.mark.parametrize("invariant", [False, True])
def test_the_cache_and_the_model_pass_batch_invariant_on(rng, made_plans, invariant):
    from cupaged.models import Llama, LlamaConfig

    config = LlamaConfig(num_layers=1, hidden=64, num_q_heads=4, num_kv_heads=NUM_KV_HEADS,
                         head_dim=HEAD_DIM, ffn=32, vocab_size=50, rms_eps=1e-5,
                         rope_base=10000.0)  # fmt: skip
    shapes = {
        "token_embd.weight": (50, 64), "output_norm.weight": (64,), "output.weight": (50, 64),
        "blk.0.attn_norm.weight": (64,), "blk.0.attn_q.weight": (256, 64),
        "blk.0.attn_k.weight": (128, 64), "blk.0.attn_v.weight": (128, 64),
        "blk.0.attn_output.weight": (64, 256), "blk.0.ffn_norm.weight": (64,),
        "blk.0.ffn_gate.weight": (32, 64), "blk.0.ffn_up.weight": (32, 64),
        "blk.0.ffn_down.weight": (64, 32),
    }  # fmt: skip
    weights = {name: rng.standard_normal(shape).astype(np.float32) * 0.2
               for name, shape in shapes.items()}  # fmt: skip
    model = Llama(config, weights, np, dtype="float32", batch_invariant=invariant)
    cache = model.make_cache(num_blocks=16, block_size=BLOCK_SIZE)
    prompts = [rng.integers(0, 50, n).tolist() for n in (20, 7)]
    admissions = [cache.admit(prompt) for prompt in prompts]
    logits = model.prefill(cache, admissions, prompts)
    batch = cache.batch([a.sid for a in admissions])
    model.decode(cache, batch, np.argmax(logits, axis=1).tolist())
    # A step of decode rows only through forward: the decode kernel, or (invariant) the prefill
    # kernel that a mixed step runs them through.
    sids = batch.sids.tolist()
    step = cache.step(sids, num_tokens=[1, 1], tokens=[[3], [4]], tables=True)
    positions = [cache.seq_len(sid) - 1 for sid in sids]
    model.forward(cache, step, np.array([3, 4]), np.array(positions), np.array([0, 1]))
    last = "PrefillPlan" if invariant else "DecodePlan"
    assert made_plans == [("PrefillPlan", invariant), ("DecodePlan", invariant), (last, invariant)]
    # The cache's plan methods take it as a keyword.
    made_plans.clear()
    cache.decode_plan(batch, 4, batch_invariant=invariant)
    cache.prefill_plan(batch, 4, num_tokens=[1, 1], batch_invariant=invariant)
    assert made_plans == [("DecodePlan", invariant), ("PrefillPlan", invariant)]


def test_the_device_paths_keep_the_bits(rng, xp):
    """The library's CUDA paths (the strict stand-in here, a GPU where there is one): a long
    sequence's decode row and a chunk's prefill rows, alone and at the end of the pool."""
    q, k, v, tables, lens, _ = decode_pool(rng, "float16", 4)
    queries, *_ = prefill_pool(rng, "float16", 4)
    queries = [x[: min(len(x), int(n))] for x, n in zip(queries, lens, strict=True)]
    kwargs = variant_arrays(rng, q.shape[1], VARIANTS["all"])
    dev = {name: xp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in kwargs.items()}
    k, v = xp.asarray(k), xp.asarray(v)
    decode_rows, prefill_rows = [], []
    for rows in (np.array([0]), np.array([*range(1, POOL), 0])):
        got = cupaged.paged_attention(
            xp.asarray(q[rows]), k, v, xp.asarray(tables[rows]), xp.asarray(lens[rows]),
            batch_invariant=True, **dev,
        )  # fmt: skip
        decode_rows.append(bits(got)[-1])
        packed_q, starts = packed(queries, rows)
        got = cupaged.paged_prefill(
            xp.asarray(packed_q), k, v, xp.asarray(tables[rows]), xp.asarray(lens[rows]),
            xp.asarray(starts), batch_invariant=True, **dev,
        )  # fmt: skip
        prefill_rows.append(per_sequence(got, starts)[-1])
    assert np.array_equal(*decode_rows) and np.array_equal(*prefill_rows)


def widened(tables: np.ndarray, rows: np.ndarray, width: int) -> np.ndarray:
    """``tables[rows]`` cut or padded (with block 0, past every length) to ``width`` columns."""
    wide = np.zeros((len(rows), width), np.int32)
    used = min(width, tables.shape[1])
    wide[:, :used] = tables[rows][:, :used]
    return wide


@pytest.mark.parametrize("dtype, group", [("float32", 2), ("float16", 8)])
def test_rows_keep_their_bits_whatever_the_tables_width(rng, dtype, group):
    """A step's tables are as wide as its longest sequence needs (``PagedCache.block_tables``
    pads to the batch's most blocks), so the width changes with the batch: a batch-invariant
    sequence's bits must not. The first sequence (decode: split into pieces and merged) alone
    in tables of its own width and wider, and among the pool in tables wider still."""
    q, k, v, tables, lens, _ = decode_pool(rng, dtype, group)
    sinks = variant_arrays(rng, q.shape[1], VARIANTS["sinks"])["sinks"]
    own = -(-int(lens[0]) // BLOCK_SIZE)
    widths = ((np.array([0]), own), (np.array([0]), own + 3),
              (np.arange(POOL), tables.shape[1] + 40))  # fmt: skip
    rows_bits = []
    for rows, width in widths:
        out = poison((len(rows), *q.shape[1:]), dtype)
        got = cupaged.paged_attention(q[rows], k, v, widened(tables, rows, width), lens[rows],
                                      batch_invariant=True, sinks=sinks, out=out)  # fmt: skip
        rows_bits.append(bits(got)[0])
    queries, k, v, tables, lens, _ = prefill_pool(rng, dtype, group)
    own = -(-int(lens[0]) // BLOCK_SIZE)
    widths = ((np.array([0]), own), (np.array([0]), own + 3),
              (np.arange(POOL), tables.shape[1] + 40))  # fmt: skip
    prefill_bits = []
    for rows, width in widths:
        packed_q, starts = packed(queries, rows)
        got = cupaged.paged_prefill(
            packed_q, k, v, widened(tables, rows, width), lens[rows], starts,
            batch_invariant=True, sinks=sinks, out=poison(packed_q.shape, dtype),
        )  # fmt: skip
        prefill_bits.append(per_sequence(got, starts)[0])
    for got in rows_bits[1:]:
        assert np.array_equal(rows_bits[0], got), "expected a decode row's bits at any width"
    for got in prefill_bits[1:]:
        assert np.array_equal(prefill_bits[0], got), "expected prefill rows' bits at any width"
