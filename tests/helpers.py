"""Shared test axes, the single tolerance table, and random inputs.

Imported as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import time

import ml_dtypes
import numpy as np

from cupaged.backend import cuda_available, to_numpy
from cupaged.dtypes import to_float
from cupaged.errors import CupagedError, KernelError

DTYPES = ("float32", "float16", "bfloat16")
GQA_RATIOS = (1, 4, 8)
BLOCK_SIZES = (1, 4, 16)

# DESIGN.md §6: kernel or reference output vs a float64 NumPy reference.
TOLERANCES = {
    "float32": dict(atol=1e-5, rtol=1e-5),
    "float16": dict(atol=1e-3, rtol=1e-3),
    "bfloat16": dict(atol=1e-2, rtol=1.6e-2),
}


def seed_of(nodeid: str) -> int:
    """The ``rng`` fixture's seed for a test: a digest of its id, the same in every process and
    run (``hash()`` of a string is salted per process)."""
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:4], "little")


def lengths_for(block_size: int) -> list[int]:
    """Ragged and boundary context lengths for a block size."""
    return sorted({1, max(block_size - 1, 1), block_size, block_size + 1, 97})


def assert_close(actual, expected, dtype: str) -> None:
    """Compare ``actual`` with a float64 reference ``expected`` through the tolerance table.

    Either side may hold any cache element type (bfloat16 bits, fp8 with ``ml_dtypes``) and be
    on either device: each comes to the host explicitly (:func:`host_float64`), as a CuPy array
    must before ``np.testing`` sees it."""
    np.testing.assert_allclose(host_float64(actual), host_float64(expected), **TOLERANCES[dtype])


def host_float64(x) -> np.ndarray:
    """``x`` (any cache element type, NumPy or device array) as float64 NumPy values."""
    return to_numpy(x if x.dtype == np.float64 else to_float(x, np.float64))


def the_work(*args, **kwargs):
    """Stands for a command's work (a model load, a demo) that must not start."""
    raise AssertionError("expected the command to stop before the work, but the work started")


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """``cupaged argv`` in this process: its exit status and its one line of stderr (no
    traceback; Ctrl-C must have become a status)."""
    import pytest

    from cupaged.__main__ import main

    try:
        status = main(argv)
    except SystemExit as exit_info:  # the parsers' refusals
        status = exit_info.code
    except KeyboardInterrupt:  # pytest would stop the whole session on it
        pytest.fail("expected main to turn Ctrl-C into a status, got KeyboardInterrupt")
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    return status, lines[0]


def torch_devices(torch) -> list:
    """The devices of a PyTorch test's ``device`` parameter: ``"cpu"``, and ``"cuda"`` marked
    ``gpu`` and skipped unless both CuPy and PyTorch see a CUDA GPU."""
    import pytest

    seen = cuda_available() and torch.cuda.is_available()
    reason = "needs a CUDA GPU seen by both CuPy and PyTorch"
    cuda = pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not seen, reason=reason)]
    )
    return ["cpu", cuda]


def random_array(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Standard-normal values, never all zeros, in the storage dtype (bfloat16 as ``uint16``)."""
    values = rng.standard_normal(shape, dtype=np.float32)
    if dtype == "bfloat16":
        return values.astype(ml_dtypes.bfloat16).view(np.uint16)
    return values.astype(dtype)


def poison(shape, dtype: str) -> np.ndarray:
    """An output buffer full of NaN, so that unwritten elements cannot pass a comparison."""
    if dtype == "bfloat16":
        return np.full(shape, 0x7FC0, np.uint16)
    return np.full(shape, np.nan, dtype)


def scatter_into_pages(rng, seqs_kv, block_size, num_blocks, dtype):
    """Write each sequence's [L, H, D] K/V into shuffled, non-monotonic blocks of fresh pages."""
    num_kv_heads, head_dim = seqs_kv[0][0].shape[1:]
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = random_array(rng, shape, dtype)  # garbage everywhere else, never zeros
    v_cache = random_array(rng, shape, dtype)
    free = list(rng.permutation(num_blocks))
    tables = []
    for k, v in seqs_kv:
        n = -(-len(k) // block_size)
        table = [int(free.pop()) for _ in range(n)]
        for pos in range(len(k)):
            k_cache[table[pos // block_size], :, pos % block_size] = k[pos]
            v_cache[table[pos // block_size], :, pos % block_size] = v[pos]
        tables.append(table)
    width = max(1, max(map(len, tables)))
    padded = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    return k_cache, v_cache, padded


def random_paged_batch(rng, lengths, num_kv_heads, head_dim, ratio, block_size, dtype):
    """Fresh K/V for ragged sequences, scattered into shuffled blocks, and a query per sequence.

    Returns ``(q, k_cache, v_cache, block_tables, context_lens, seqs)`` as NumPy arrays, ``seqs``
    being each sequence's contiguous ``(k, v)``, ``[L, num_kv_heads, head_dim]``.
    """
    seqs = [
        (random_array(rng, (n, num_kv_heads, head_dim), dtype),
         random_array(rng, (n, num_kv_heads, head_dim), dtype))
        for n in lengths
    ]  # fmt: skip
    num_blocks = sum(-(-n // block_size) for n in lengths) + 5
    k_cache, v_cache, tables = scatter_into_pages(rng, seqs, block_size, num_blocks, dtype)
    q = random_array(rng, (len(lengths), num_kv_heads * ratio, head_dim), dtype)
    return q, k_cache, v_cache, tables, np.array(lengths, dtype=np.int32), seqs


def cpu_toolchain_missing() -> str | None:
    """Why the CPU backend cannot build kernels here, or ``None`` when it can."""
    from cupaged.kernels.cpu import cuda_include_dir, toolchain

    try:
        toolchain.check_platform()
        toolchain.compiler()
        cuda_include_dir()
    except CupagedError as error:
        return str(error)
    return None


@contextlib.contextmanager
def scheduled(xp, order):
    """Run CPU-backend launches under ``order``; the GPU has its own."""
    if xp is np:
        from cupaged.kernels.cpu import schedule

        with schedule(order):
            yield
    else:
        yield


def kernel_error(kernel, *launch, **kwargs) -> str:
    """The message of the ``KernelError`` a CPU-backend launch raises, quickly (not a timeout)."""
    import pytest

    start = time.perf_counter()
    with pytest.raises(KernelError) as info:
        kernel(*launch, **kwargs)
    assert time.perf_counter() - start < 5.0  # detected, not timed out
    return str(info.value)


@contextlib.contextmanager
def recorded_cpu_launches():
    """Every CPU-backend launch made inside, as ``(kernel name, OS threads)``: the ``workers`` field
    of the request each one sends to the runtime."""
    import pytest

    from cupaged.kernels.cpu import module as cpu_module

    launches: list[tuple[str, int]] = []
    real_call = cpu_module.CpuKernel.__call__

    def recording_call(kernel, *args, **kwargs):
        launch = kernel._launch

        def spy(request, *rest):
            header = struct.unpack_from(cpu_module._HEADER, request)
            launches.append((kernel.name, header[8]))  # index, grid (3), block (3), schedule
            return launch(request, *rest)

        kernel._launch = spy
        try:
            return real_call(kernel, *args, **kwargs)
        finally:
            kernel._launch = launch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_module.CpuKernel, "__call__", recording_call)
        yield launches


@contextlib.contextmanager
def recorded_launches(xp):
    """:func:`recorded_cpu_launches` where the kernels run on the CPU backend (NumPy, and the
    strict CuPy stand-in, which launches them there); ``None`` on a real GPU, where nothing
    records them."""
    if xp is np or getattr(xp, "__name__", "") == "strict_cupy":
        with recorded_cpu_launches() as launches:
            yield launches
    else:
        yield None


def forget_cpu_builds() -> None:
    """Forget which library this process loaded for each CPU-backend module (the libraries stay
    loaded): the next :class:`~cupaged.kernels.cpu.CpuModule` looks in the build cache again, as a new
    process would."""
    from cupaged.kernels.cpu import module as cpu_module

    cpu_module._BUILDS.clear()


def forget_cuda_state() -> None:
    """Forget what cupaged keeps per CUDA device (kernels, the device's limits) and which CuPy
    it found, so that the next call looks again: the strict CuPy stand-in
    (``strict_cupy.installed``) goes in and out with this, so that neither its kernels and
    limits outlive it nor a real GPU's reach it."""
    from cupaged import backend as _backend
    from cupaged import dtypes
    from cupaged.attention import layer as _attention
    from cupaged.attention import ops
    from cupaged.kernels import loader as _kernels

    _backend.cupy_module.cache_clear()
    dtypes.native_bfloat16.cache_clear()  # keyed by the module, whose version may change
    _backend.cuda_available.cache_clear()
    _attention._cuda_target.cache_clear()
    _kernels._cuda_functions.clear()
    ops._write_plan.cache_clear()  # their plans hold kernels, keyed ("cuda", device id, ...)
    ops._copy_plan.cache_clear()
    ops._PLANS.clear()  # the one-shot decode's reused plans: kernels and device arrays
    ops._PREFILL_PLANS.clear()  # and the one-shot prefill's


@contextlib.contextmanager
def cpu_stride_threads(threads: int):
    """Run ``write_kv`` and ``copy_blocks`` on the CPU backend with ``threads`` threads per block
    inside (``launch_copies.CPU_STRIDE_THREADS``, one by default), their launch plans (kept per shape
    in ``cupaged.attention.ops``) made afresh on the way in and out."""
    import pytest

    from cupaged.attention import ops
    from cupaged.kernels import launch_copies

    def forget_plans():
        ops._write_plan.cache_clear()
        ops._copy_plan.cache_clear()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch_copies, "CPU_STRIDE_THREADS", threads)
        forget_plans()
        try:
            yield
        finally:
            forget_plans()  # the plans made with these thread counts must not outlive the block


# ------------------------------------------------------------------------------- internals


class Internals:
    """A test's view of the state behind the public API of the bookkeeping and of a decode plan.

    White-box tests (exact free stacks, a corrupted table that ``check_invariants`` must catch,
    fault injection, a race forced between two calls, the buffers a CUDA graph holds) read and
    change private state here, and only here: no test reaches into a private name itself, so
    that when the internals change this class (with :func:`inner_calls` and :func:`undo_calls`,
    the private calls fault injection patches by name) is the one place to follow them. Make one
    with :func:`internals`; prefer the public API (``block_table``, ``seq_len``,
    ``pool.refcounts``, ``pool.evictable_blocks()``, ``check_invariants``, ``plan.work()``)
    wherever it says enough.

    Attributes:
        manager: the :class:`~cupaged.BlockManager` (a :class:`~cupaged.PagedCache`'s own), or
            ``None`` for a bare pool or prefix cache.
        transaction: the manager's :class:`~cupaged.paging.transaction.Transaction`.
        pool: the :class:`~cupaged.BlockPool`.
        index: the :class:`~cupaged.PrefixCache` (a manager's, or the bare one given).
        table: the manager's :class:`~cupaged.paging.sequences.SequenceTable`.
        chains: the manager's :class:`~cupaged.paging.chains.Chains` (row -> prefix chain).
        swapper: a cache's :class:`~cupaged.cache.swap.Swapper` (``None`` for a manager).
        plan: the :class:`~cupaged.DecodePlan`, or ``None`` for the bookkeeping.
    """

    def __init__(self, owner) -> None:
        from cupaged import BlockManager, BlockPool, DecodePlan, PagedCache, PrefixCache

        self.manager = self.transaction = self.table = self.chains = self.swapper = None
        self.index = self.pool = self.plan = None
        if isinstance(owner, PagedCache):  # its manager's state, and its host copies
            self.swapper, owner = owner._swapper, owner._manager
        if isinstance(owner, BlockManager):
            self.manager = owner
            self.transaction, self.pool, self.index = owner._transaction, owner._pool, owner._index
            self.table, self.chains = owner._table, owner._chains
        elif isinstance(owner, BlockPool):
            self.pool = owner
        elif isinstance(owner, PrefixCache):
            self.index, self.pool = owner, owner.pool
        elif isinstance(owner, DecodePlan):
            self.plan = owner
        else:
            raise TypeError(
                f"expected a BlockManager, BlockPool, PrefixCache or DecodePlan, got {owner!r}"
            )

    # -- the manager's sequences

    def row(self, sid: int) -> int:
        """The table row of live sequence ``sid``."""
        return self.table.rows[sid]

    def chain(self, sid: int):
        """The prefix chain of live sequence ``sid``."""
        return self.chains[self.row(sid)]

    def host_copy(self, sid: int) -> tuple:
        """``(k, v)`` host arrays of swapped-out sequence ``sid``."""
        return self.swapper._host[sid]

    @property
    def unapplied(self) -> dict:
        """A cache's copy-on-write copies left to the caller: ``dst -> (src, sid, column)``."""
        return self.manager._copies._left

    def assert_no_call_inside(self) -> None:
        """No call is inside the manager: no undo left to run, no claim held."""
        transaction = self.transaction
        assert transaction.log == [], f"undo records left: {transaction.log}"
        assert transaction.owner is None, f"a claim left held by thread {transaction.owner}"
        assert transaction.depth == 0, "a call is still marked inside"

    @contextlib.contextmanager
    def before_claim(self, n: int, call):
        """Inside the block, run ``call()`` (another thread's call, run to its end) just before
        this thread's ``n``-th claim of the manager (1-based): the interleaving a race would give,
        forced. Yields the list of claims seen so far (``call``'s own claims come after the
        ``n``-th and run nothing)."""
        transaction, claims = self.transaction, []
        real = transaction._claim

        class Interleaved(dict):
            def setdefault(self, key, value):
                claims.append(True)
                if len(claims) == n:
                    transaction._claim = real  # call() claims for real
                    try:
                        call()
                    finally:
                        transaction._claim = self
                return real.setdefault(key, value)

            def get(self, key, default=None):
                return real.get(key, default)

            def pop(self, key, default=None):
                return real.pop(key, default)

        transaction._claim = Interleaved()
        try:
            yield claims
        finally:
            transaction._claim = real

    # -- the pool

    @property
    def free_stack(self) -> list[int]:
        """The pool's free stack, bottom first (the next block taken is the last)."""
        return self.pool._free[: self.pool.num_stacked].tolist()

    @property
    def free(self):
        """The pool's free-stack array, used below :attr:`top` (writable: to corrupt it)."""
        return self.pool._free

    @property
    def top(self) -> int:
        """Entries of :attr:`free` in use (settable: to corrupt the stack)."""
        return self.pool._top

    @top.setter
    def top(self, value: int) -> None:
        self.pool._top = value

    @property
    def refcount(self):
        """The pool's ``[num_blocks]`` int32 refcounts, writable (``pool.refcounts`` to read)."""
        return self.pool._refcount

    @property
    def lru(self):
        """The pool's :class:`~cupaged.paging.lru.EvictionQueue` (``lru.count``: evictable)."""
        return self.pool._lru

    @property
    def lru_room(self) -> int:
        """Entries the LRU queue can append before it compacts (drops its stale entries)."""
        lru = self.pool._lru
        return lru._queue.size - lru._tail

    @property
    def lru_stamps(self):
        """Each block's stamp in the LRU queue (``-1``: not evictable), writable."""
        return self.pool._lru._stamp

    @property
    def queue_stamps(self):
        """The stamp of each LRU queue entry, writable (an entry is live while it equals its
        block's stamp)."""
        return self.pool._lru._queue_stamp

    @property
    def block_of(self) -> dict:
        """The key map's ``key -> block`` dict, writable (``pool.keys.mapping`` to read)."""
        return self.pool.keys._block_of

    @property
    def content_of(self) -> list:
        """The content registered with each block, writable."""
        return self.pool.keys._content_of

    # -- a decode plan

    @property
    def plan_buffers(self) -> tuple:
        """A decode plan's own device arrays, ``(block_tables, context_lens, work)``: its int32
        copies of the tables and lengths and its ``[num_items, 4]`` work list, the buffers a
        captured CUDA graph reads (``update`` writes into them)."""
        plan = self.plan
        return plan._tables, plan._lens, plan._work

    @property
    def merge_counters(self):
        """A decode plan's ``[num_seqs, grid_x]`` int32 counters of the fused merge (zero
        between runs; ``None`` for a plan that never splits), on the host."""
        counters = self.plan._merge_counters
        return None if counters is None else to_numpy(counters)


def internals(owner) -> Internals:
    """The :class:`Internals` of a BlockManager or PagedCache, a BlockPool, a PrefixCache or a
    DecodePlan."""
    return Internals(owner)


def _named(owner, names: str) -> list[tuple[object, str]]:
    return [(owner, name) for name in names.split()]


def inner_calls() -> list[tuple[object, str]]:
    """The steps of the bookkeeping's public calls, as ``(owner, name)`` for fault injection:
    the pool, its key map and LRU queue, the sequence table, the prefix cache and chains, the
    planner, the lifecycle, the swapper, the copy and write kernels. Patch them before the
    cache is made (some are bound at construction)."""
    from cupaged.cache import paged_cache
    from cupaged.cache.swap import Swapper
    from cupaged.paging import chains, keys, lifecycle, lru, planner, pool, prefix, sequences
    from cupaged.paging.copies import DeferredCopies

    return [
        *_named(
            pool.BlockPool,
            "take release acquire_unchecked add_refs hold let_go allocate _park _evict",
        ),
        *_named(keys.KeyMap, "register_many drop"),
        *_named(lru.EvictionQueue, "push revive drop"),
        *_named(
            sequences.SequenceTable,
            "acquire clone free make_room grow mark_pending write_tails restart_tail detach "
            "attach _save",
        ),
        *_named(prefix.PrefixCache, "keys next_keys match_unchecked"),
        *_named(
            chains.Chains,
            "commit commit_and_take extend add_keys set drop save keys register_again",
        ),
        *_named(planner.Planner, "plan _plan _decode _copies"),
        *_named(lifecycle.Lifecycle, "admit _attach release fork"),
        *_named(Swapper, "save load drop"),
        *_named(paged_cache, "copy_blocks write_kv"),
        *_named(DeferredCopies, "leave take let_go forget"),
    ]


def undo_calls() -> list[tuple[object, str]]:
    """The undo records and the finishers a rollback runs, as ``(owner, name)`` (patched like
    :func:`inner_calls`)."""
    from cupaged.cache.swap import Swapper
    from cupaged.paging import chains, keys, lru, pool, prefix, sequences
    from cupaged.paging.copies import DeferredCopies

    return [
        *_named(
            pool.BlockPool, "_restore_refs _restore_held _restore_stack _restore_evicted _free_lost"
        ),
        *_named(keys.KeyMap, "_unregister restore"),
        *_named(lru.EvictionQueue, "_restore _restore_queue restore_dropped"),
        *_named(sequences.SequenceTable, "_restore _unacquire _ungrow _put touch_all"),
        *_named(prefix.PrefixCache, "restore_stats"),
        *_named(chains.Chains, "_restore_entries _restore_chains"),
        *_named(Swapper, "_forget"),
        *_named(DeferredCopies, "_restore"),
    ]


def aligned(shape, dtype, fill) -> np.ndarray:
    """An array filled with ``fill`` whose data starts on a 64-byte boundary (what the CPU
    backend's WMMA tiles, 32 bytes, and ldmatrix rows, 16, need of a kernel's global buffers)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = np.empty(count * dtype.itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start : start + count * dtype.itemsize].view(dtype).reshape(shape)
    out[...] = fill
    return out
