"""Cascade decode: a prefix that several rows of a step share is read once for all of them.

Decode is bound by the K/V bytes it reads, and rows that share leading blocks (forks for parallel
sampling and beam search, prompts that hit the prefix cache, a GRPO group of one prompt) read the
same blocks again, row after row. The block tables say which: the same block id at the same
position of two rows is one block (a block's contents at a position are fixed by what precedes
it; ``PagedCache`` shares a block only through a fork or the prefix cache). So the shared part of
a step is a tree of block ids, found here from the tables alone, with no token compared::

    rows   blocks (ids)                 the tree's nodes (tokens, block_size 4)
    0      7  8  9 | 11 12              {0, 1, 2}: [0, 12)         read once for three rows
    1      7  8  9 | 11 13              {0, 1}:    [12, 16)        read once for two rows
    2      7  8  9 | 14                 own:  row 0 [16, len0), row 1 [16, len1), row 2 [12, len2)
    3      5  6                         own:  row 3 [0, len3)

Each node's range is attended by every member's query at once (``cuda/cascade.cu``: the members'
query heads are the rows of tensor-core products, or of CUDA-core ones over a float32 cache,
over each K/V tile, read once per tile of ``rows_per_tile`` query rows), each row's own ranges by ``paged_decode`` as items of the work
list, and the pieces of a row, its nodes and its own items, are merged by their log-sum-exp
(``paged_decode_merge``): the softmax of a row over the union of disjoint key ranges is their
partial softmaxes weighted by ``exp(lse - max lse)``. A row's pieces take consecutive slots of the
work list (its ``seq_items``), those of its nodes marked idle (``seq = -1``) for ``paged_decode``,
whose partial rows the shared level writes instead::

    slots     0      1      2      3      4      5  ...
    row 0     node0  node1  own                             seq_items[0] = {0, 3}
    row 1                          node0  node1  own        seq_items[1] = {3, 3}

When a node pays: per KV head, a node of ``n`` rows and ``L`` tokens costs the plain plan
``n * L`` token rows of K and V (``2 * head_dim`` elements each); the cascade reads them once per
tile of query rows, ``ceil(n * G / rows_per_tile) * L``, and adds, per member and per piece of the
node, a partial row and its log-sum-exp written and read back (``G * (head_dim + 1)`` float32
values, twice). A node is taken when that is fewer bytes; a step takes cascade (``cascade=None``)
when the nodes it takes save at least :data:`MIN_SAVED_BYTES` per layer, about what one more
kernel launch costs in DRAM time, and never when no row shares a block (the plain plan, as
before). The plan counts both figures (:attr:`CascadeWork.bytes_read`, ``bytes_plain``).

Window, soft-cap, ALiBi, sinks and fp8 keep their meaning: the shared level masks each row's keys
before its own window and applies soft-cap and ALiBi with the row's own query position; sinks
join the merge's denominator once; fp8 scales are applied as ``paged_decode`` applies them, so
every piece is merged alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._util import cdiv
from ..backend import array_module, to_numpy
from ..kernels.args import CascadeSharedArgs, merge_record, with_fields
from ..kernels.launch_cascade import cascade_launch
from ..kernels.launch_decode import MAX_GRID_YZ, decode_merge_launch
from .layer import attention_kernel, target

# A step takes cascade (cascade=None) when it saves at least this many bytes of K/V per layer: a
# launch more (the shared level) costs a few microseconds of a GPU's time, in which an H100 or
# H200 reads about this much.
MIN_SAVED_BYTES = 8 << 20

# A shared node is cut into pieces of at least this many tokens to fill the GPU (each piece is
# one more partial row per member, merged; as MIN_SPLIT_TOKENS for split-K).
MIN_SHARED_PIECE = 512


@dataclass(frozen=True, slots=True)
class Node:
    """Rows that share every block of a token range: ``rows`` (int64, ascending) attend keys
    ``[begin, end)`` through the same block ids."""

    rows: np.ndarray
    begin: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.begin


def first_attended(lens: np.ndarray, window_left: int) -> np.ndarray:
    """The first key each row's query attends (int64): 0, or ``len - 1 - window_left``."""
    lens = lens.astype(np.int64)
    if window_left < 0:
        return np.zeros_like(lens)
    return np.maximum(lens - 1 - window_left, 0)


def shared_nodes(
    tables: np.ndarray, lens: np.ndarray, block_size: int, window_left: int = -1
) -> list[Node]:
    """The tree of shared ranges of a step, as a list of nodes, parents before children.

    Rows are grouped by the id of their first block, then each group is extended block by block
    while every member holds the same id and the block lies within every member's length (the
    shortest member ends the node, mid-block if its length does: a partial block is shared up to
    there); the members that go on are grouped again by their next id. A group of one row shares
    nothing. Ids below 0 (a window's released entries) are never shared, but rows that hold one
    at the same position before all of their windows go on to the next block together (forks
    of a sliding-window cache release alike). With a window, a node
    starts at the first key any member attends (the kernel masks the others' earlier keys), and
    a node no member attends is dropped.

    Args:
        tables: ``[num_rows, max_blocks]`` int host array, entries past a row's length ignored.
        lens: ``[num_rows]`` int host array, each in ``[0, max_blocks * block_size]``.
        block_size: tokens per block.
        window_left: the plan's window (``-1``: none).
    """
    lens = np.asarray(lens, dtype=np.int64)
    tables = np.asarray(tables)
    first = first_attended(lens, window_left)
    nodes: list[Node] = []
    if tables.shape[0] < 2:
        return nodes
    live = np.flatnonzero(lens > 0)
    pending: list[tuple[np.ndarray, int]] = [(live, 0)]  # rows sharing every block before t
    while pending:
        rows, t = pending.pop()
        column = t // block_size
        ids = tables[rows, column]
        order = np.argsort(ids, kind="stable")
        rows, ids = rows[order], ids[order]
        # Runs of one id, of two rows or more (most steps of a batch that shares nothing end
        # here, without a Python loop over the rows).
        starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
        sizes = np.diff(np.append(starts, ids.size))
        shared = (sizes >= 2) & (ids[starts] >= 0)
        # A run of released entries (a window's -1) lies before its rows' windows: those whose
        # window starts past the block go on to the next one, which they may still share.
        released = (sizes >= 2) & (ids[starts] < 0)
        after = (column + 1) * block_size
        for start, size in zip(starts[released].tolist(), sizes[released].tolist(), strict=True):
            part = rows[start : start + size]
            part = part[(first[part] >= after) & (lens[part] > after)]
            if part.size >= 2:
                pending.append((part, after))
        for start, size in zip(starts[shared].tolist(), sizes[shared].tolist(), strict=True):
            part = rows[start : start + size]
            shortest = int(lens[part].min())
            columns = tables[part, column : cdiv(shortest, block_size)]
            differs = np.flatnonzero((columns != columns[0]).any(axis=0))
            end = shortest if differs.size == 0 else (column + int(differs[0])) * block_size
            end = min(end, shortest)
            begin = max(t, int(first[part].min()))
            if begin < end:
                nodes.append(Node(part, begin, end))
            rest = part[lens[part] > end]
            if rest.size >= 2:
                pending.append((rest, end))
    nodes.sort(key=lambda node: (node.begin, int(node.rows[0])))
    return nodes


def shares_a_first_block(tables: np.ndarray, lens: np.ndarray) -> bool:
    """Whether two rows of non-zero length hold the same first block id: every shared range
    starts there, so a step where none do shares nothing (the common case, checked first)."""
    firsts = np.sort(np.asarray(tables)[:, 0][np.asarray(lens) > 0])
    return bool((firsts[1:] == firsts[:-1]).any())


def checked_host_tables(
    host_tables: Any, tables: Any, lens: Any, block_size: int, verify: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """A plan's ``host_tables`` for the planner (:func:`shared_nodes`), checked, or ``None``.

    The shared level reads the block ids of its ranges from the plan's ``tables`` over the rows
    and ranges that the host copies give, so copies of other rows or longer lengths would
    steer it past what the plan's checks covered. Their shapes are checked always (``[num_seqs,
    any width]`` holding each length's blocks, ``[num_seqs]``); ``verify`` (a plan that checks
    its tables) holds them equal to ``tables`` and ``lens`` too: the lengths, and the ids each
    length reaches (on the tables' device, one synchronisation).

    Raises:
        TypeError: not a pair of integer host arrays.
        ValueError: other shapes, lengths past the copies' width, or (verify) unequal copies.
    """
    if host_tables is None:
        return None
    try:
        host, host_lens = (np.asarray(x) for x in host_tables)
    except (TypeError, ValueError):
        raise TypeError(
            f"expected host_tables as (block_tables, context_lens), NumPy arrays, got "
            f"{type(host_tables).__name__}"
        ) from None
    num_seqs = lens.shape[0]
    for name, array, ndim in (("block_tables", host, 2), ("context_lens", host_lens, 1)):
        if array.dtype.kind not in "iu":
            raise TypeError(f"expected host_tables' {name} of an integer dtype, got {array.dtype}")
        if array.ndim != ndim or array.shape[0] != num_seqs:
            raise ValueError(
                f"expected host_tables' {name} of {ndim} axes, {num_seqs} rows (the plan's), "
                f"got shape {array.shape}"
            )
    width = host.shape[1] * block_size
    if num_seqs and (host_lens.min() < 0 or host_lens.max() > width):
        raise ValueError(
            f"expected host_tables' context_lens in [0, {width}] (their tables' width), got "
            f"{int(host_lens.min())} .. {int(host_lens.max())}"
        )
    if verify and num_seqs:
        xp = array_module(tables)
        host_lens_dev = xp.asarray(host_lens)
        columns = min(cdiv(int(host_lens.max()), block_size), tables.shape[1])
        reached = (
            xp.arange(columns)[None, :] < (host_lens_dev[:, None] + block_size - 1) // block_size
        )
        differ = (xp.asarray(host[:, :columns]) != tables[:, :columns]) & reached
        if bool((host_lens_dev != lens).any() | differ.any()):
            raise ValueError(
                "expected host_tables equal to block_tables and context_lens (the lengths, and "
                "the ids each length reaches), got copies that differ"
            )
    return host, host_lens


def node_pays(node: Node, group: int, head_dim: int, kv_bytes: int, rows_per_tile: int) -> int:
    """Bytes of one KV head that the node saves per layer (negative: it costs), the module
    docstring's arithmetic: K/V rows not read, less the partial rows written and read back."""
    members = node.rows.size
    row_bytes = 2 * head_dim * kv_bytes
    reads = cdiv(members * group, rows_per_tile)
    pieces = max(1, node.tokens // MIN_SHARED_PIECE)
    partials = members * pieces * group * (head_dim + 1) * 4 * 2
    return (members - reads) * node.tokens * row_bytes - partials


@dataclass(frozen=True, slots=True)
class CascadeWork:
    """The host plan of a cascade step: every array the kernels read, and the bytes counted.

    Attributes:
        work: ``[capacity, 4]`` int32 ``paged_decode``'s items ``{seq, begin, end, count}``, the
            slots of shared pieces idle (``seq = -1``).
        seq_items: ``[num_rows, 2]`` int32 ``{first, count}``: a row's consecutive slots.
        tiles: ``[num_tiles, 4]`` int32 ``{first_row, num_rows, begin, end}``: the shared
            level's thread blocks per KV head; its rows index ``members`` times ``group``.
        members: ``[num_members, 2]`` int32 ``{seq, slot}``: a piece's rows and where each
            writes its partial row.
        bytes_read: K/V bytes the cascade reads per layer (every KV head).
        bytes_plain: K/V bytes the plain plan reads per layer.
        nodes: the shared nodes taken.
        rows_per_tile: query rows of one shared-level thread block.
    """

    work: np.ndarray
    seq_items: np.ndarray
    tiles: np.ndarray
    members: np.ndarray
    bytes_read: int
    bytes_plain: int
    nodes: tuple[Node, ...]
    rows_per_tile: int

    @property
    def capacity(self) -> int:
        return int(self.work.shape[0])


def plan_cascade(
    tables: np.ndarray,
    lens: np.ndarray,
    *,
    block_size: int,
    window_left: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    kv_bytes: int,
    rows_per_tile: int,
    tile: int,
    fill_blocks: int,
    force: bool,
    nodes: list[Node] | None = None,
) -> CascadeWork | None:
    """The cascade of one step, or ``None`` when it does not pay (``force``: whenever a row
    shares a block; ``None`` then only when none does).

    Args:
        tables, lens: the step's host block tables and lengths (:func:`shared_nodes`).
        block_size, window_left: the cache's.
        group: query heads per KV head; num_kv_heads, head_dim: the layer's.
        kv_bytes: bytes of one cache element.
        rows_per_tile: query rows of one shared-level thread block (its launch's).
        tile: tokens per stage of the kernels: pieces and items are cut at multiples of it.
        fill_blocks: thread blocks per KV head that fill the GPU: long shared nodes and long
            own ranges are cut into pieces until each level has about this many.
        force: take every node that shares a block (``cascade=True``), paying or not.
        nodes: the step's :func:`shared_nodes`, when the caller has them already.
    """
    lens = np.asarray(lens, dtype=np.int64)
    if nodes is None:
        if not shares_a_first_block(tables, lens):
            return None
        nodes = shared_nodes(tables, lens, block_size, window_left)
    if not force:
        nodes = [n for n in nodes if node_pays(n, group, head_dim, kv_bytes, rows_per_tile) > 0]
    if not nodes:
        return None
    num_rows = lens.shape[0]
    first = first_attended(lens, window_left)
    row_bytes = 2 * head_dim * kv_bytes * num_kv_heads
    bytes_plain = int((lens - first).sum()) * row_bytes

    # Each row's pieces: its nodes, then its own ranges (the gaps between them). A row's nodes
    # are a chain (parents first: the nodes are in order of their first key).
    lens_list, first_list = lens.tolist(), first.tolist()
    row_nodes: list[list[int]] = [[] for _ in range(num_rows)]
    for index, node in enumerate(nodes):
        for row in node.rows.tolist():
            row_nodes[row].append(index)
    own: list[list[tuple[int, int]]] = []
    for row in range(num_rows):
        ranges, at = [], first_list[row]
        for index in row_nodes[row]:
            node = nodes[index]
            if node.begin > at:
                ranges.append((at, node.begin))
            at = max(at, node.end)
        if at < lens_list[row]:
            ranges.append((at, lens_list[row]))
        own.append(ranges)

    shared_tokens = sum(cdiv(n.rows.size * group, rows_per_tile) * n.tokens for n in nodes)
    own_tokens = sum(e - b for ranges in own for b, e in ranges)
    bytes_read = (shared_tokens + own_tokens) * row_bytes
    if not force and bytes_plain - bytes_read < MIN_SAVED_BYTES:
        return None

    # Pieces of shared nodes: enough to fill the GPU, of at least MIN_SHARED_PIECE tokens.
    tiles_per_layer = sum(cdiv(n.rows.size * group, rows_per_tile) for n in nodes)
    cuts = max(1, cdiv(fill_blocks, tiles_per_layer))
    node_pieces = [_cut(n.begin, n.end, cuts, MIN_SHARED_PIECE, tile) for n in nodes]
    # Own ranges: the device planner's rule, chunks of the balanced size over the spare items;
    # a row with a node and no own key gets an empty item, so that its count is 2 or more and
    # the merge writes it; a row with neither, its one (empty) item.
    own_chunk = _round_up(max(256, cdiv(max(own_tokens, 1), max(fill_blocks, 1))), tile)
    own_items = [
        [p for b, e in ranges for p in _chunks(b, e, own_chunk)]
        or [(lens_list[row], lens_list[row])]
        for row, ranges in enumerate(own)
    ]

    # Slots: a row's node pieces (in chain order), then its own items.
    pieces = [len(p) for p in node_pieces]
    shared_slots = [sum(pieces[i] for i in row_nodes[row]) for row in range(num_rows)]
    counts = np.array([s + len(i) for s, i in zip(shared_slots, own_items, strict=True)])
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    work = np.full((int(counts.sum()), 4), -1, np.int32)
    work[:, 1:] = 0
    items = [
        (row, begin, end, count)
        for row, (row_items, count) in enumerate(zip(own_items, counts.tolist(), strict=True))
        for begin, end in row_items
    ]
    own_counts = counts - shared_slots  # a row's own slots follow its shared ones
    own_before = np.cumsum(own_counts) - own_counts
    own_slots = np.repeat(starts + shared_slots - own_before, own_counts) + np.arange(len(items))
    work[own_slots] = np.array(items, np.int32).reshape(-1, 4)
    seq_items = np.stack([starts, counts], axis=1).astype(np.int32)

    # Members: a node piece's rows and the slot each writes: its row's first slot, plus the
    # pieces of the row's earlier nodes, plus the piece's index.
    before: dict[tuple[int, int], int] = {}
    for row in range(num_rows):
        offset = int(starts[row])
        for index in row_nodes[row]:
            before[index, row] = offset
            offset += pieces[index]
    members, tiles, count = [], [], 0
    for index, node in enumerate(nodes):
        rows = node.rows.tolist()
        base = np.array([before[index, row] for row in rows], np.int64)
        n = pieces[index]  # members of piece p: the node's rows, slots base + p
        slots = (base[None, :] + np.arange(n)[:, None]).ravel()
        members.append(np.stack([np.tile(node.rows, n), slots], axis=1))
        total = len(rows) * group
        for begin, end in node_pieces[index]:
            for offset in range(0, total, rows_per_tile):
                size = min(rows_per_tile, total - offset)
                tiles.append((count * group + offset, size, begin, end))
            count += len(rows)
    return CascadeWork(
        work=work,
        seq_items=seq_items,
        tiles=np.array(tiles, np.int32).reshape(-1, 4),
        members=np.concatenate(members).astype(np.int32),
        bytes_read=bytes_read,
        bytes_plain=bytes_plain,
        nodes=tuple(nodes),
        rows_per_tile=rows_per_tile,
    )


def _round_up(n: int, multiple: int) -> int:
    return cdiv(n, multiple) * multiple


def _cut(begin: int, end: int, pieces: int, least: int, tile: int) -> list[tuple[int, int]]:
    """``[begin, end)`` in at most ``pieces`` ranges of at least ``least`` tokens (whole tiles),
    the last one shorter."""
    size = _round_up(max(least, cdiv(end - begin, pieces)), tile)
    return _chunks(begin, end, size)


def _chunks(begin: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(b, min(b + size, end)) for b in range(begin, end, size)]


def shared_level(
    device: str,
    decode_args: Any,
    dtype: str,
    q_dtype: str,
    layout: tuple[int, ...],
    group: int,
    variants: Any,
    required: bool,
) -> SharedLevel:
    """A decode plan's shared level (``cascade_shared``), planned and loaded at the first step
    that shares a block, so that a plan whose steps share none costs next to nothing more than
    the plain one (``cascade=None``).

    Raises:
        ValueError: a shape the kernel does not take, when the plan requires a cascade
            (``cascade=True``): checked here, at once.
    """
    level = SharedLevel(device, decode_args, dtype, q_dtype, layout, group, variants, required)
    if required:
        level.launch()
    return level


class SharedLevel:
    """The shared level of a plan's cascades: ``cascade_shared``'s launch, its kernel and the
    arguments every step's launch shares (the plan's tables, lengths, scale and variants, taken
    from its ``paged_decode`` record by name), each made when a step first needs it;
    :meth:`levels` lays a step's :class:`CascadeWork` onto the device."""

    __slots__ = ("_args", "_decode_args", "_kernels", "_launches", "_shape", "required")

    def __init__(
        self,
        device: str,
        decode_args: Any,
        dtype: str,
        q_dtype: str,
        layout: tuple[int, ...],
        group: int,
        variants: Any,
        required: bool,
    ) -> None:
        self._shape = (device, dtype, q_dtype, layout, group, variants)
        self._decode_args = decode_args
        self._launches: dict[int | None, Any] = {}  # by a step's largest group (rows)
        self._kernels: dict[int, Any] = {}  # by rows per tile
        self._args: Any = None
        self.required = required  # cascade=True: every shared block taken

    def launch(self, rows: int | None = None) -> Any:
        """The kernel's launch (``CascadeLaunch``) for a step whose largest group has ``rows``
        query rows (members x G: a smaller tile where they fit one, the same bytes for less
        work), or ``None`` for a shape the kernel does not take.

        Raises:
            ValueError: that shape, when the plan requires a cascade.
        """
        if rows not in self._launches:
            device, dtype, q_dtype, layout, group, variants = self._shape
            _, num_kv_heads, block_size, head_dim = layout
            try:
                self._launches[rows] = cascade_launch(
                    dtype, num_kv_heads, group, head_dim, block_size, target(device), variants,
                    q_dtype=q_dtype, rows=rows,
                )  # fmt: skip
            except ValueError as error:
                if self.required:
                    raise ValueError(f"cascade=True: {error}") from None
                self._launches[rows] = None  # never again
        return self._launches[rows]

    def plan(
        self,
        tables: tuple[Any, Any],
        host_tables: tuple[np.ndarray, np.ndarray] | None,
        records: tuple[Any, Any],
        *,
        kv_bytes: int,
        tile: int,
        fill_blocks: int,
    ) -> CascadeLevels | None:
        """A step's cascade (:func:`plan_cascade`), laid onto the device with the plan's
        ``paged_decode`` and merge ``records``; ``None`` when nothing is shared, too little
        (``cascade=None``), or the work list passes CUDA's grid limit. ``tables``: the plan's
        ``(block_tables, context_lens)``, read where they lie on the host (the CPU backend's);
        on a GPU their host copies ``host_tables`` (:func:`checked_host_tables`), or, without
        them, the tables read back for a required cascade only (else ``None``)."""
        if array_module(tables[0]) is np:
            host_tables = tables
        elif host_tables is None and self.required:  # (cascade=True: one read-back)
            host_tables = (to_numpy(tables[0]), to_numpy(tables[1]))
        if host_tables is None:
            return None
        tables, lens = host_tables
        if not shares_a_first_block(tables, lens):
            return None
        _, _, _, layout, group, variants = self._shape
        _, num_kv_heads, block_size, head_dim = layout
        nodes = shared_nodes(tables, lens, block_size, variants.window_left)
        # The largest group's query rows pick the tile (a smaller one where they fit).
        if not nodes or (launch := self.launch(max(n.rows.size for n in nodes) * group)) is None:
            return None
        work = plan_cascade(
            tables,
            lens,
            block_size=block_size,
            window_left=variants.window_left,
            group=group,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            kv_bytes=kv_bytes,
            rows_per_tile=launch.rows_per_tile,
            tile=tile,
            fill_blocks=fill_blocks,
            force=self.required,
            nodes=nodes,
        )
        if work is None or max(work.capacity, work.tiles.shape[0]) > MAX_GRID_YZ:
            return None
        return self.levels(work, *records)

    def levels(self, work: CascadeWork, decode_args: Any, merge_args: Any) -> CascadeLevels:
        """A step's cascade on the device: its own work list, slots and partial buffers, and
        the records of ``paged_decode`` and its merge (the plan's, with those in place)."""
        device, _, _, layout, group, _ = self._shape
        head_dim = layout[3]
        launch = self.launch(work.rows_per_tile)  # (rows per tile: its own tile)
        if launch.rows_per_tile not in self._kernels:
            grid = (layout[1], 2)  # the CPU backend's threads: a launch has many tiles
            kernel = attention_kernel(device, "cascade.cu", launch, group, head_dim, grid)
            self._kernels[launch.rows_per_tile] = kernel
        if self._args is None:
            self._args = merge_record(
                self._decode_args, CascadeSharedArgs, tiles=None, members=None
            )
        xp = array_module(decode_args.block_tables)
        capacity, num_q_heads = work.capacity, int(merge_args.num_q_heads)
        partial_out = xp.empty((capacity, num_q_heads, head_dim), np.float32)
        partial_lse = xp.empty((capacity, num_q_heads), np.float32)
        own = dict(partial_out=partial_out, partial_lse=partial_lse)
        shared = with_fields(
            self._args, tiles=xp.asarray(work.tiles), members=xp.asarray(work.members), **own
        )
        decode = with_fields(decode_args, work=xp.asarray(work.work), **own)
        merge = with_fields(merge_args, seq_items=xp.asarray(work.seq_items), **own)
        rows = work.seq_items.shape[0]
        merge_launch = decode_merge_launch(head_dim, num_q_heads, rows, capacity)
        return CascadeLevels(self, work, shared, decode, (merge, *merge_launch))

    def run(self, args: Any, rows_per_tile: int, num_kv_heads: int, num_tiles: int) -> None:
        """``cascade_shared`` of ``rows_per_tile`` rows over ``num_tiles`` tiles of every KV
        head."""
        launch = self._launches[rows_per_tile]
        grid = (num_kv_heads, num_tiles)
        kernel = self._kernels[rows_per_tile]
        kernel(grid, launch.block, tuple(args), shared_mem=launch.shared_mem)


@dataclass(frozen=True, slots=True)
class DecodeGeometry:
    """How a plan launches ``paged_decode`` and its merge, whatever the work list's length."""

    grid_x: int
    block: tuple[int, ...]
    shared_mem: int


class CascadeLevels:
    """One step's cascade, launched per layer: the shared level, then ``paged_decode`` over
    each row's own items (the shared slots idle), then the merge of every row's pieces."""

    __slots__ = (
        "_decode",
        "_merge",
        "_merge_block",
        "_merge_grid",
        "_shared",
        "_shared_args",
        "work",
    )

    def __init__(
        self,
        shared: SharedLevel,
        work: CascadeWork,
        shared_args: Any,
        decode: Any,
        merge: tuple[Any, tuple[int, int], tuple[int, int]],
    ) -> None:
        self._shared = shared
        self._shared_args = shared_args
        self._decode = decode
        # The merge's record, grid and block (decode_merge_launch: once per step).
        self._merge, self._merge_grid, self._merge_block = merge
        self.work = work

    def run(
        self,
        kernels: tuple[Any, Any],
        geometry: DecodeGeometry,
        layer: tuple[Any, Any, Any, Any],
        scales: Any,
        sinks: Any,
    ) -> None:
        """One layer: ``layer`` is ``(out, q, k_cache, v_cache)``, ``scales`` a run's
        :class:`~cupaged.kernels.args.ScaleArgs` or ``None``, ``sinks`` the layer's or
        ``None``; ``kernels`` the plan's decode kernel and merge (with the sinks bit when
        ``sinks`` are given)."""
        out, q, k_cache, v_cache = layer
        kernel, merge = kernels
        scale_fields = {} if scales is None else scales.named()
        shared = with_fields(
            self._shared_args, q=q, k_cache=k_cache, v_cache=v_cache, **scale_fields
        )
        num_kv_heads = int(shared.num_kv_heads)
        work = self.work
        self._shared.run(shared, work.rows_per_tile, num_kv_heads, work.tiles.shape[0])
        decode = self._decode.filled(out, q, k_cache, v_cache, scales, sinks)
        grid = (geometry.grid_x, self.work.capacity)
        kernel(grid, geometry.block, decode, shared_mem=geometry.shared_mem)
        merge(self._merge_grid, self._merge_block, self._merge.filled(out, sinks))
