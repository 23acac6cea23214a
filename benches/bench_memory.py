"""Memory simulation: contiguous reservations against paging, over a lognormal request workload.

No kernel runs: for a pool of a fixed size, how many requests fit at once, and what fraction of the
bytes they hold is waste, when each sequence reserves ``max_len`` tokens (contiguous) or holds
``ceil(len / block_size)`` blocks (paged, block sizes 1/8/16/32/128). The table is printed and kept
in ``extra_info``; ``python benches/bench_memory.py --plot FILE`` draws it.
"""

from __future__ import annotations

import sys

import numpy as np

from cupaged import CacheSpec

BLOCK_SIZES = (1, 8, 16, 32, 128)
MAX_LEN = 4096
POOL_BYTES = 40 * 2**30  # the KV budget of one 80 GB GPU after weights


def workload(n: int = 10_000, seed: int = 0) -> np.ndarray:
    """Sequence lengths (prompt + output): lognormal, median 600 tokens, clipped to MAX_LEN."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(600), 0.9, n), 1, MAX_LEN).astype(int)


def simulate(lengths: np.ndarray, block_size: int | None) -> dict[str, float]:
    """Waste and concurrency of paged (``block_size``) or contiguous (``None``) storage."""
    spec = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16",
                     block_size=block_size or 1)  # fmt: skip
    if block_size is None:
        held = np.full(len(lengths), MAX_LEN)
    else:
        held = -(-lengths // block_size) * block_size
    per_sequence = held.mean() * spec.bytes_per_token
    return {
        "waste_pct": round(100 * (1 - lengths.sum() / held.sum()), 2),
        "concurrent_sequences": int(POOL_BYTES // per_sequence),
        "mean_tokens_held": round(float(held.mean()), 1),
    }


def table() -> list[tuple[str, dict[str, float]]]:
    lengths = workload()
    rows = [("contiguous", simulate(lengths, None))]
    rows += [(f"paged, block {bs}", simulate(lengths, bs)) for bs in BLOCK_SIZES]
    return rows


def test_memory_simulation(benchmark):
    rows = benchmark.pedantic(table, rounds=3, iterations=1)
    for name, row in rows:
        benchmark.extra_info[name] = row
    contiguous = rows[0][1]
    paged16 = dict(rows)["paged, block 16"]
    assert paged16["waste_pct"] < 5 < contiguous["waste_pct"]
    assert paged16["concurrent_sequences"] > 3 * contiguous["concurrent_sequences"]


def main(argv: list[str]) -> None:
    rows = table()
    print(f"{'storage':<18} {'waste %':>8} {'sequences in 40 GiB':>20} {'mean tokens held':>17}")
    for name, row in rows:
        print(f"{name:<18} {row['waste_pct']:>8.2f} {row['concurrent_sequences']:>20,} "
              f"{row['mean_tokens_held']:>17,.1f}")  # fmt: skip
    if len(argv) == 2 and argv[0] == "--plot":
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [name for name, _ in rows]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.bar(names, [row["waste_pct"] for _, row in rows])
        left.set_ylabel("waste %")
        right.bar(names, [row["concurrent_sequences"] for _, row in rows])
        right.set_ylabel("sequences in 40 GiB")
        for axis in (left, right):
            axis.tick_params(axis="x", rotation=45)
        fig.suptitle(f"lognormal lengths (median 600), contiguous reserves {MAX_LEN}")
        fig.tight_layout()
        fig.savefig(argv[1], dpi=100)


if __name__ == "__main__":
    main(sys.argv[1:])
