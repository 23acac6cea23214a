"""The peers of cupaged's decode in the GPU benchmark (``scripts/gpu_bench.py``), each handed the
same K/V as cupaged's plan:

- PyTorch's ``scaled_dot_product_attention`` over a contiguous copy of the K/V
  (``[batch, num_kv_heads, context, head_dim]``, the groups through ``enable_gqa``): what a user
  who does not page runs (FlashAttention inside PyTorch on a GPU). On the CPU backend it runs
  PyTorch's CPU kernel on CPU tensors, so the smoke test takes this path too. SDPA has no fp8:
  over an fp8 cache its copy holds the same values in float16.
- FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on cupaged's cache itself: its ``"HND"``
  layout is cupaged's ``[num_blocks, num_kv_heads, block_size, head_dim]``; the block table goes
  in as CSR (``indptr``, ``indices``, last-page lengths); tensor cores for groups above 4, the
  rule vLLM's FlashInfer backend uses.
- vLLM's Triton ``unified_attention`` (the kernel of vLLM's Triton backend) on a strided view of
  the same cache: vLLM's order ``[num_blocks, block_size, num_kv_heads, head_dim]`` is cupaged's
  with two axes swapped, and the kernel takes every stride, so nothing is copied.

Every peer reads the cache at scale 1 (fp8 too, as cupaged's plan does without scales). A peer
that cannot run says why instead of a time: ``not installed`` (not importable), ``needs a CUDA
GPU`` (FlashInfer and vLLM have no CPU path), ``PyTorch has no CUDA``; a call that raises gives
its error in its row. Nothing here times anything: ``gpu_bench.py`` does, the same way for all.

    [num_blocks, num_kv_heads, block_size, head_dim]    cupaged, FlashInfer "HND"
    [num_blocks, block_size, num_kv_heads, head_dim]    vLLM: .permute(0, 2, 1, 3), a view
    [batch, num_kv_heads, context, head_dim]            SDPA: the blocks of each row gathered
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupaged.dtypes import is_fp8

# vLLM has moved the module between releases; the first that imports is used.
VLLM_MODULES = (
    "vllm.attention.ops.triton_unified_attention",
    "vllm.v1.attention.ops.triton_unified_attention",
)
FLASHINFER_WORKSPACE_BYTES = 128 << 20  # the size FlashInfer's own examples allocate
TORCH_NAMES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float8_e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "int32": "int32",
}
# Every carrier of an element type as a signed integer of its width: DLPack hands those over
# from NumPy and CuPy alike (NumPy's refuses ml_dtypes, CuPy 13 has no bfloat16).
RAW = {1: np.int8, 2: np.int16, 4: np.int32}


@dataclass(frozen=True)
class Problem:
    """One decode step in cupaged's arrays (NumPy on the CPU backend, CuPy on a GPU).

    Attributes:
        q: ``[batch, num_q_heads, head_dim]`` in ``q_dtype`` (bfloat16 as ``uint16`` bits).
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]`` in ``kv_dtype``'s storage
            (fp8: ``uint8`` on CuPy, ``ml_dtypes`` on NumPy).
        v_cache: same as ``k_cache``.
        tables: ``[batch, max_blocks]`` int32.
        lens: ``[batch]`` int32, every one at most ``context``.
        kv_dtype: the cache's element type name (``"float16"``, ``"bfloat16"``, ``"float8_e4m3"``).
        q_dtype: the query's (and output's) element type name.
        context: the longest length.
    """

    q: Any
    k_cache: Any
    v_cache: Any
    tables: Any
    lens: Any
    kv_dtype: str
    q_dtype: str
    context: int


@dataclass(frozen=True)
class Prepared:
    """A peer set up on one problem.

    Attributes:
        call: one decode step; returns its output, ``[batch, num_q_heads, head_dim]`` (or
            ``[batch, num_q_heads, 1, head_dim]``), a torch tensor.
        kv_dtype: the element type the peer reads K and V in (its bytes, for GB/s).
    """

    call: Callable[[], Any]
    kv_dtype: str


@dataclass(frozen=True)
class Peer:
    """One peer: its name, and either why it cannot run here or how to set it up."""

    name: str
    missing: str | None
    prepare: Callable[[Problem], Prepared] | None = None


def load_torch(device: str) -> tuple[Any, str | None]:
    """``(torch, None)``, or ``(None, why not)`` where PyTorch cannot run on ``device``."""
    try:
        import torch
    except ImportError:
        return None, "not installed"
    if device == "cuda" and not torch.cuda.is_available():
        return None, "PyTorch has no CUDA"
    return torch, None


def peers(device: str) -> list[Peer]:
    """The peers in table order: PyTorch SDPA, FlashInfer, vLLM Triton."""
    torch, why = load_torch(device)
    found = []
    sdpa = "PyTorch SDPA, contiguous copy"
    found.append(Peer(sdpa, why) if torch is None else Peer(sdpa, None, _sdpa(torch)))
    for name, module, prepare in (
        ("FlashInfer BatchDecodeWithPagedKVCacheWrapper", "flashinfer", _flashinfer),
        ("vLLM Triton unified_attention", "vllm", _vllm),
    ):
        if importlib.util.find_spec(module) is None:
            found.append(Peer(name, "not installed"))
        elif device != "cuda":
            found.append(Peer(name, "needs a CUDA GPU"))
        elif torch is None:
            found.append(Peer(name, f"needs PyTorch ({why})"))
        else:
            found.append(Peer(name, None, prepare(torch)))
    return found


def to_torch(torch: Any, x: Any, name: str) -> Any:
    """``x`` (a NumPy or CuPy array holding element type ``name``) as a torch tensor of that
    type on its device, sharing its memory."""
    raw = x.view(RAW[x.dtype.itemsize])
    tensor = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else torch.from_dlpack(raw)
    return tensor.view(getattr(torch, TORCH_NAMES[name]))


def to_float32(xp: Any, tensor: Any) -> Any:
    """A peer's output as a float32 array of ``xp`` (NumPy or CuPy)."""
    tensor = tensor.float().contiguous()
    return tensor.numpy() if xp is np else xp.from_dlpack(tensor)


def _tables(torch: Any, problem: Problem) -> tuple[Any, Any]:
    return to_torch(torch, problem.tables, "int32"), to_torch(torch, problem.lens, "int32")


def _sdpa(torch: Any) -> Callable[[Problem], Prepared]:
    def prepare(problem: Problem) -> Prepared:
        # SDPA has no fp8: an fp8 cache's values (exact in float16) go in as float16.
        dtype = "float16" if is_fp8(problem.kv_dtype) else problem.kv_dtype
        kind = getattr(torch, TORCH_NAMES[dtype])
        tables, _ = _tables(torch, problem)
        batch, max_blocks = tables.shape
        rows = tables.long()

        def contiguous(cache: Any) -> Any:
            # Gathered as raw integers (indexing takes every integer type, not every float).
            raw = to_torch(torch, cache, problem.kv_dtype)
            raw = raw.view(getattr(torch, f"int{8 * raw.element_size()}"))[rows]
            _, _, num_kv_heads, block_size, head_dim = raw.shape  # [batch, blocks, ...]
            raw = raw.view(getattr(torch, TORCH_NAMES[problem.kv_dtype])).to(kind)
            seq = raw.permute(0, 2, 1, 3, 4).reshape(
                batch, num_kv_heads, max_blocks * block_size, head_dim
            )
            return seq[:, :, : problem.context].contiguous()

        k, v = contiguous(problem.k_cache), contiguous(problem.v_cache)
        q = to_torch(torch, problem.q, problem.q_dtype).to(kind).unsqueeze(2)  # [B, Hq, 1, D]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return Prepared(lambda: sdpa(q, k, v, enable_gqa=True), dtype)

    return prepare


def _flashinfer(torch: Any) -> Callable[[Problem], Prepared]:
    def prepare(problem: Problem) -> Prepared:
        import flashinfer

        k = to_torch(torch, problem.k_cache, problem.kv_dtype)
        v = to_torch(torch, problem.v_cache, problem.kv_dtype)
        q = to_torch(torch, problem.q, problem.q_dtype)
        tables, lens = _tables(torch, problem)
        _, num_kv_heads, block_size, head_dim = k.shape
        num_q_heads = q.shape[1]
        pages = (lens + block_size - 1) // block_size  # each row's first `pages` entries
        used = torch.arange(tables.shape[1], device=k.device) < pages[:, None]
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=k.device)
        indptr[1:] = torch.cumsum(pages, 0)
        last = (lens - 1) % block_size + 1
        workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=k.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_tensor_cores=num_q_heads // num_kv_heads > 4
        )
        wrapper.plan(
            indptr,
            tables[used].contiguous(),
            last.to(torch.int32),
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
            q_data_type=q.dtype,
            kv_data_type=k.dtype,
        )
        out = torch.empty_like(q)
        scales = {"k_scale": 1.0, "v_scale": 1.0} if is_fp8(problem.kv_dtype) else {}
        return Prepared(lambda: wrapper.run(q, (k, v), out=out, **scales), problem.kv_dtype)

    return prepare


def _vllm(torch: Any) -> Callable[[Problem], Prepared]:
    def prepare(problem: Problem) -> Prepared:
        errors = []
        for module in VLLM_MODULES:
            try:
                attention = importlib.import_module(module).unified_attention
                break
            except (ImportError, AttributeError) as error:
                errors.append(f"{module}: {error}")
        else:
            raise ImportError("no unified_attention in vLLM: " + "; ".join(errors))
        # [num_blocks, block_size, num_kv_heads, head_dim]: a view, the same bytes.
        k = to_torch(torch, problem.k_cache, problem.kv_dtype).permute(0, 2, 1, 3)
        v = to_torch(torch, problem.v_cache, problem.kv_dtype).permute(0, 2, 1, 3)
        q = to_torch(torch, problem.q, problem.q_dtype)
        tables, lens = _tables(torch, problem)
        starts = torch.arange(len(lens) + 1, dtype=torch.int32, device=q.device)  # 1 query each
        one = torch.ones(1, dtype=torch.float32, device=q.device)  # the fp8 descales
        out = torch.empty_like(q)
        head_dim = q.shape[2]

        def call() -> Any:
            attention(
                q=q,
                k=k,
                v=v,
                out=out,
                cu_seqlens_q=starts,
                max_seqlen_q=1,
                seqused_k=lens,
                max_seqlen_k=problem.context,
                softmax_scale=head_dim**-0.5,
                causal=True,  # the one query is the last position: it sees every key
                window_size=(-1, -1),
                block_table=tables,
                softcap=0.0,
                q_descale=None,
                k_descale=one,
                v_descale=one,
            )
            return out

        return Prepared(call, problem.kv_dtype)

    return prepare
