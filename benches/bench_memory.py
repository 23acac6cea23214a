"""Memory simulation: contiguous reservations against paging, over lognormal request workloads.

No kernel runs: for a pool of a fixed size, how many requests fit at once, and what fraction of the
bytes they hold is waste, when each sequence reserves ``max_len`` tokens (contiguous) or holds
``ceil(len / block_size)`` blocks (paged, block sizes 1/8/16/32/128).

A second, long-context workload (lengths up to 32k) serves a Mistral-like model whose every layer
attends a sliding window of 4,096 tokens (``window_left = 4095``): there a sequence needs only
the K/V of its window, so everything before it is waste. It compares contiguous 32k reservations,
a contiguous ring buffer of the window (Mistral's own rolling cache), paging without releases and
paging with a sliding-window cache (``PagedCache(..., window_left=4095)``, which keeps
``CacheSpec.blocks_for(n, window_left)`` blocks). The table is printed and kept in
``extra_info``; ``python benches/bench_memory.py --plot FILE`` draws it.
"""

from __future__ import annotations

import sys

import numpy as np

from cupaged import CacheSpec

BLOCK_SIZES = (1, 8, 16, 32, 128)
MAX_LEN = 4096
POOL_BYTES = 40 * 2**30  # the KV budget of one 80 GB GPU after weights
LONG_MAX_LEN = 32768
WINDOW_LEFT = 4095  # Mistral's sliding_window = 4096: a query sees itself and 4,095 keys before
LONG_BLOCK_SIZE = 16


def workload(n: int = 10_000, seed: int = 0, median: int = 600, max_len: int = MAX_LEN):
    """Sequence lengths (prompt + output): lognormal around ``median`` tokens, clipped to
    ``max_len``."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), 0.9, n), 1, max_len).astype(int)


def long_workload(n: int = 10_000, seed: int = 0) -> np.ndarray:
    """Long-context lengths: lognormal, median 8,192 tokens, clipped to 32,768 (78 % of them
    longer than the window)."""
    return workload(n, seed, median=8192, max_len=LONG_MAX_LEN)


def model(block_size: int, dtype: str = "float16") -> CacheSpec:
    """The 32-layer, 8-KV-head, head_dim 128 model of both workloads (Llama-2-13B-like GQA;
    Mistral 7B has the same KV shape), its cache float16 or fp8 (docs/fp8.md: half the bytes)."""
    return CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=dtype,
                     block_size=block_size)  # fmt: skip


def simulate(
    lengths: np.ndarray,
    block_size: int | None,
    *,
    max_len: int = MAX_LEN,
    window_left: int = -1,
    storage: str = "paged",
    dtype: str = "float16",
) -> dict[str, float]:
    """Waste and concurrency of one storage scheme.

    ``storage``: ``"contiguous"`` (``max_len`` tokens reserved per sequence), ``"ring"`` (a
    contiguous ring buffer of the window, ``min(max_len, window_left + 1)`` tokens), ``"paged"``
    (``ceil(len / block_size)`` blocks, nothing released) or ``"paged+window"`` (the blocks a
    sliding-window cache holds after a decode step). With ``window_left >= 0`` the model attends
    a sliding window, so a sequence needs only its last ``window_left + 1`` tokens: the rest of
    what it holds counts as waste.
    """
    spec = model(block_size or 1, dtype)
    if storage == "contiguous":
        held = np.full(len(lengths), max_len)
    elif storage == "ring":
        held = np.full(len(lengths), min(max_len, window_left + 1))
    elif storage == "paged":
        held = -(-lengths // spec.block_size) * spec.block_size
    elif storage == "paged+window":
        blocks = [spec.blocks_for(int(n), window_left=window_left) for n in lengths]
        held = np.asarray(blocks) * spec.block_size
    else:
        raise ValueError(f"expected a storage scheme, got {storage!r}")
    needed = lengths if window_left < 0 else np.minimum(lengths, window_left + 1)
    per_sequence = held.mean() * spec.bytes_per_token
    return {
        "waste_pct": round(100 * (1 - needed.sum() / held.sum()), 2),
        "concurrent_sequences": int(POOL_BYTES // per_sequence),
        "mean_tokens_held": round(float(held.mean()), 1),
    }


def table() -> list[tuple[str, dict[str, float]]]:
    lengths = workload()
    rows = [("contiguous", simulate(lengths, None, storage="contiguous"))]
    rows += [(f"paged, block {bs}", simulate(lengths, bs)) for bs in BLOCK_SIZES]
    fp8 = dict(dtype="float8_e4m3")  # the same workload in an fp8 cache (one byte an element)
    rows += [
        ("fp8: contiguous", simulate(lengths, None, storage="contiguous", **fp8)),
        ("fp8: paged, block 16", simulate(lengths, 16, **fp8)),
    ]
    long, bs = long_workload(), LONG_BLOCK_SIZE
    window = dict(max_len=LONG_MAX_LEN, window_left=WINDOW_LEFT)
    rows += [
        ("32k window: contiguous", simulate(long, None, storage="contiguous", **window)),
        (f"32k window: ring {WINDOW_LEFT + 1}", simulate(long, None, storage="ring", **window)),
        (f"32k window: paged, block {bs}", simulate(long, bs, **window)),
        (f"32k window: paged+window, block {bs}",
         simulate(long, bs, storage="paged+window", **window)),
    ]  # fmt: skip
    return rows


def test_memory_simulation(benchmark):
    rows = benchmark.pedantic(table, rounds=3, iterations=1)
    for name, row in rows:
        benchmark.extra_info[name] = row
    by_name = dict(rows)
    contiguous = rows[0][1]
    paged16 = by_name["paged, block 16"]
    assert paged16["waste_pct"] < 5 < contiguous["waste_pct"]
    assert paged16["concurrent_sequences"] > 3 * contiguous["concurrent_sequences"]
    # fp8 halves the bytes of every token: twice the sequences, the same waste
    fp8 = by_name["fp8: paged, block 16"]
    twice = 2 * paged16["concurrent_sequences"]
    assert twice <= fp8["concurrent_sequences"] <= twice + 1  # (whole sequences, rounded down)
    assert fp8["waste_pct"] == paged16["waste_pct"]
    fp8_contiguous = by_name["fp8: contiguous"]["concurrent_sequences"]
    assert fp8_contiguous == 2 * contiguous["concurrent_sequences"]
    # The long-context workload of a sliding-window model: releasing what the window no longer
    # sees beats paging alone, which beats 32k reservations; it also beats a ring buffer of the
    # window, which reserves the whole window for the 22 % of sequences shorter than it.
    held = {name.split(": ", 1)[1].split(",")[0]: row["concurrent_sequences"]
            for name, row in rows if name.startswith("32k window")}  # fmt: skip
    assert held["paged+window"] > held[f"ring {WINDOW_LEFT + 1}"] > held["paged"]
    assert held["paged"] > held["contiguous"]
    assert held["paged+window"] > 2 * held["paged"]


def main(argv: list[str]) -> None:
    rows = table()
    print(f"{'storage':<36} {'waste %':>8} {'sequences in 40 GiB':>20} {'mean tokens held':>17}")
    for name, row in rows:
        print(f"{name:<36} {row['waste_pct']:>8.2f} {row['concurrent_sequences']:>20,} "
              f"{row['mean_tokens_held']:>17,.1f}")  # fmt: skip
    if len(argv) == 2 and argv[0] == "--plot":
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        short = [(name, row) for name, row in rows if not name.startswith("32k window")]
        long = [(name.split(": ", 1)[1], row) for name, row in rows if name.startswith("32k")]
        fig, axes = plt.subplots(2, 2, figsize=(10, 8))
        titles = (
            f"lognormal lengths (median 600), contiguous reserves {MAX_LEN}",
            f"up to {LONG_MAX_LEN:,} tokens (median 8,192), a window of {WINDOW_LEFT + 1:,}",
        )
        for (left, right), part, title in zip(axes, (short, long), titles, strict=True):
            names = [name for name, _ in part]
            left.bar(names, [row["waste_pct"] for _, row in part])
            left.set_ylabel("waste %")
            right.bar(names, [row["concurrent_sequences"] for _, row in part])
            right.set_ylabel("sequences in 40 GiB")
            left.set_title(title, fontsize=9, loc="left")
            for axis in (left, right):
                axis.tick_params(axis="x", rotation=30)
                plt.setp(axis.get_xticklabels(), ha="right")
        fig.tight_layout()
        fig.savefig(argv[1], dpi=100)


if __name__ == "__main__":
    main(sys.argv[1:])
