"""The demo's numbers: per-step records, the memory report, and how they are shown.

Paged vs contiguous, at every step of a run::

    paged       blocks_in_use * bytes_per_block            (shared blocks counted once)
    contiguous  running * max_len * bytes_per_token        (a max-length slab per sequence)
    waste       1 - stored / held                          paged: empty slots of the blocks held
                                                           contiguous: unused tail of each slab

Waste is aggregated over the whole run (sums over steps, so busy steps weigh more).
"""

from __future__ import annotations

import io
import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import CacheSpec, PagedCache
from ..serving import StepState


@dataclass(frozen=True, slots=True)
class StepRecord:
    """The cache's state after one engine step."""

    step: int
    running: int  # sequences decoding
    swapped: int  # sequences preempted to host memory
    tokens: int  # tokens stored by the running sequences (a shared prefix counts per sequence)
    blocks_in_use: int  # physical blocks referenced (shared ones once)
    filled_slots: int  # token slots of those blocks that hold a token

    @classmethod
    def after(cls, cache: PagedCache, state: StepState) -> StepRecord:
        """The record of the step the engine reports in ``state`` (its ``on_step``)."""
        sids = [seq.sid for seq in state.running]
        lengths = [cache.seq_len(sid) for sid in sids]
        fill: dict[int, int] = {}  # block -> its filled slots (a shared block counted once)
        for sid, length in zip(sids, lengths, strict=True):
            for j, block in enumerate(cache.block_table(sid)):
                filled = min(cache.block_size, length - j * cache.block_size)
                fill[block] = max(fill.get(block, 0), filled)
        return cls(
            step=state.step,
            running=len(sids),
            swapped=state.num_swapped,
            tokens=sum(lengths),
            blocks_in_use=cache.num_blocks - cache.num_free_blocks,
            filled_slots=sum(fill.values()),
        )


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Paged against contiguous for one run."""

    peak_blocks: int
    peak_paged_bytes: int
    peak_contiguous_bytes: int
    paged_waste_pct: float
    contiguous_waste_pct: float
    paged_capacity: int  # sequences the pool holds at this run's mean blocks per sequence
    contiguous_capacity: int  # max-length slabs that fit in the same bytes
    prefix_blocks_saved: int
    fork_blocks_saved: int

    @classmethod
    def compute(
        cls,
        spec: CacheSpec,
        num_blocks: int,
        max_len: int,
        steps: list[StepRecord],
        prefix_blocks_saved: int = 0,
        fork_blocks_saved: int = 0,
    ) -> MemoryReport:
        busy = [s for s in steps if s.running]
        slab = max_len * spec.bytes_per_token
        held_slots = sum(s.blocks_in_use for s in busy) * spec.block_size
        reserved_tokens = sum(s.running for s in busy) * max_len
        sequence_steps = sum(s.running for s in busy)
        mean_blocks = sum(s.blocks_in_use for s in busy) / sequence_steps if sequence_steps else 0
        return cls(
            peak_blocks=max((s.blocks_in_use for s in steps), default=0),
            peak_paged_bytes=max((s.blocks_in_use for s in steps), default=0)
            * spec.bytes_per_block,
            peak_contiguous_bytes=max((s.running for s in steps), default=0) * slab,
            paged_waste_pct=_pct(1 - sum(s.filled_slots for s in busy) / held_slots)
            if held_slots
            else 0.0,
            contiguous_waste_pct=_pct(1 - sum(s.tokens for s in busy) / reserved_tokens)
            if reserved_tokens
            else 0.0,
            paged_capacity=int(num_blocks // mean_blocks) if mean_blocks else 0,
            contiguous_capacity=num_blocks * spec.bytes_per_block // slab,
            prefix_blocks_saved=prefix_blocks_saved,
            fork_blocks_saved=fork_blocks_saved,
        )


def _pct(fraction: float) -> float:
    return round(100 * fraction, 2)


def write_output(path: str | Path, data: bytes) -> None:
    """Write ``data`` into the regular file ``path`` (made, or emptied first), never waiting.

    What the command line writes when a run ends goes through here: a FIFO would make the write
    wait for a reader forever, and a device take the bytes or fail only then, so anything but a
    regular file is refused unwritten. (The commands refuse such a path when parsing, through
    ``cupaged.models.output_file``; this covers one put there during the run.)

    Raises:
        OSError: the file cannot be opened or written (a FIFO without a reader: ``ENXIO``).
        ValueError: ``path`` is not a regular file.
    """
    # O_NONBLOCK: opening a FIFO returns at once (ENXIO without a reader) instead of waiting.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o666)
    with os.fdopen(fd, "wb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"expected a regular file to write, got {str(path)!r}")
        f.truncate(0)  # after the check: a device or FIFO is left as it was
        f.write(data)


def write_json(
    path: str | Path, summary: dict[str, Any], report: MemoryReport, steps: list[StepRecord]
) -> None:
    """Every number of the run, and the per-step series, as JSON (:func:`write_output`)."""
    document = {"summary": summary, "memory": asdict(report), "steps": [asdict(s) for s in steps]}
    write_output(path, (json.dumps(document, indent=2) + "\n").encode())


def plot_series(
    spec: CacheSpec, max_len: int, steps: list[StepRecord], num_blocks: int
) -> dict[str, Any]:
    """The curves of the memory plot, one value per step (MiB, or waste in %).

    Waste is undefined at a step where nothing runs (no slot is held): it is NaN there, which
    matplotlib leaves out of the curve, rather than a 0 % that was never measured.
    """
    mib = 2**20
    nan = float("nan")
    return {
        "step": [s.step for s in steps],
        "paged": [s.blocks_in_use * spec.bytes_per_block / mib for s in steps],
        "contiguous": [s.running * max_len * spec.bytes_per_token / mib for s in steps],
        "stored": [s.tokens * spec.bytes_per_token / mib for s in steps],
        "pool": num_blocks * spec.bytes_per_block / mib,
        "paged_waste": [
            100 * (1 - s.filled_slots / (s.blocks_in_use * spec.block_size))
            if s.running and s.blocks_in_use
            else nan
            for s in steps
        ],
        "contiguous_waste": [
            100 * (1 - s.tokens / (s.running * max_len)) if s.running else nan for s in steps
        ],
    }


def memory_figure(spec: CacheSpec, max_len: int, steps: list[StepRecord], num_blocks: int) -> Any:
    """A matplotlib figure of bytes held over time, paged vs contiguous, the pool's size, and the
    waste of each; the legends sit right of the plots, clear of the curves.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from error
    series = plot_series(spec, max_len, steps, num_blocks)
    x = series["step"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    top.plot(x, series["contiguous"], label="contiguous reservation")
    top.plot(x, series["paged"], label="paged (blocks in use)")
    stored = "K/V of every sequence\n(shared prefixes per sequence)"
    top.plot(x, series["stored"], label=stored, linestyle="--")
    top.axhline(series["pool"], color="black", linestyle=":", label=f"pool ({num_blocks} blocks)")
    top.set_ylabel("MiB")
    top.set_title("KV-cache memory per step")
    bottom.plot(x, series["contiguous_waste"], label="contiguous waste")
    bottom.plot(x, series["paged_waste"], label="paged waste")
    bottom.set_ylabel("waste %")
    bottom.set_xlabel("engine step (waste undefined where nothing runs)")
    for axes in (top, bottom):
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def write_plot(
    path: str | Path, spec: CacheSpec, max_len: int, steps: list[StepRecord], num_blocks: int
) -> None:
    """Save :func:`memory_figure` as a PNG (or the format that the file's suffix names, as
    matplotlib reads it), through :func:`write_output`.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    fig = memory_figure(spec, max_len, steps, num_blocks)
    import matplotlib.pyplot as plt

    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=100, format=Path(path).suffix[1:].lower() or "png")
    finally:
        plt.close(fig)
    write_output(path, image.getvalue())
