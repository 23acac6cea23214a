"""A Llama-family decoder in array ops (NumPy on the CPU, CuPy on the GPU) over the paged cache.

Per layer: RMSNorm, Q/K/V projections, rotary positions, GQA attention through cupaged
(``write_kv``, then the ``run`` of the step's plan: a :class:`~cupaged.PrefillPlan` for prompts
and mixed steps, a :class:`~cupaged.DecodePlan` for decode steps), the output projection,
RMSNorm, SwiGLU. A step plans its attention once (the checks, the lengths, the launch and the
kernels) and every layer runs that plan; the tables and slots are the cache's own, so the plans
and the writes take them unchecked. The head is the output matrix, or the token
embedding when the GGUF ties them. Every shape comes from the GGUF's metadata.
:meth:`Llama.forward_full` runs the same layers without any cache (attention in array ops over
the whole sequence), as the check of the paged paths.

Rotary layout: llama.cpp's converter permutes the rows of each head of ``attn_q``/``attn_k`` so that
its kernel rotates adjacent pairs ``(x[2i], x[2i+1])`` by angle ``pos * base**(-2i/d)``. This
module undoes the permutation when it loads the weights::

    GGUF rows of one head   0   1   2   3  ...  d-2  d-1      (pairs (2i, 2i+1) rotate together)
    Hugging Face row        0  d/2  1  d/2+1 ... d/2-1 d-1     (pairs (i, i+d/2) rotate together)

and rotates halves, which reads contiguous slices. Attention scores are unchanged: Q and K rows
are permuted alike. (The tests check it against a forward that rotates adjacent pairs of the
GGUF rows as they are.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import (
    Admission,
    CupagedError,
    DecodePlan,
    PagedCache,
    PrefillPlan,
    SequenceBatch,
    StepPlan,
    from_float,
    to_float,
    write_kv,
)
from ..dtypes import dtype_name, is_fp8
from .gguf import GGUFFile
from .graphs import GraphedAttention

# Layer i's attention: (i, q, k, v) -> [n, num_q_heads, head_dim], Q/K/V in the cache's dtype.
Attend = Callable[[int, Any, Any, Any], Any]
# A step's attention, planned once: run(q, k_cache, v_cache) is a layer's.
Plan = DecodePlan | PrefillPlan


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The shapes and constants of a Llama-family model, read from GGUF metadata."""

    num_layers: int
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int
    rms_eps: float
    rope_base: float

    def __post_init__(self) -> None:
        """Refuse sizes that are not positive integers, constants that are not positive finite
        numbers, and query heads that do not group evenly over the KV heads.

        Raises:
            ValueError: the first bad value, named.
        """
        heads = ("num_q_heads", "num_kv_heads", "head_dim")
        for name in ("num_layers", "hidden", *heads, "ffn", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"expected {name} an integer >= 1, got {value!r}")
        for name in ("rms_eps", "rope_base"):
            value = getattr(self, name)
            number = isinstance(value, int | float | np.number) and not isinstance(value, bool)
            if not (number and np.isfinite(value) and value > 0):
                raise ValueError(f"expected {name} a finite number > 0, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"expected num_q_heads a multiple of num_kv_heads={self.num_kv_heads}, got "
                f"{self.num_q_heads}"
            )
        if self.head_dim % 2:  # rotary positions turn pairs of elements
            raise ValueError(f"expected an even head_dim, got {self.head_dim}")

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> LlamaConfig:
        """The config that a GGUF file's metadata declares, every size checked.

        Raises:
            CupagedError: not a Llama GGUF, a value missing or of the wrong kind (a size that is
                not a positive integer, a constant that is not a positive finite number), or sizes
                that do not fit together (a hidden size that the head count does not divide, ...).
        """
        arch = gguf.require("general.architecture")
        if arch != "llama":
            raise CupagedError(f"expected a 'llama' architecture GGUF, got {arch!r}")

        def size(key: str, default: int | None = None) -> int:
            value = gguf.require(key) if default is None else gguf.metadata(key, default)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise CupagedError(
                    f"expected {key} a positive integer in {gguf.path.name}, got {value!r}"
                )
            return int(value)

        def number(key: str, default: float) -> float:
            value = gguf.metadata(key, default)
            ok = isinstance(value, int | float | np.number) and not isinstance(value, bool)
            if not (ok and np.isfinite(value) and value > 0):
                raise CupagedError(
                    f"expected {key} a finite number > 0 in {gguf.path.name}, got {value!r}"
                )
            return float(value)

        hidden = size("llama.embedding_length")
        num_q_heads = size("llama.attention.head_count")
        num_kv_heads = size("llama.attention.head_count_kv", num_q_heads)
        if hidden % num_q_heads:
            raise CupagedError(
                f"expected llama.embedding_length a multiple of llama.attention.head_count="
                f"{num_q_heads} in {gguf.path.name}, got {hidden}"
            )
        head_dim = hidden // num_q_heads
        rope_dim = size("llama.rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise CupagedError(
                f"expected rotary positions over the whole head ({head_dim}), got {rope_dim}"
            )
        if gguf.metadata("llama.vocab_size") is not None:
            vocab = size("llama.vocab_size")
        else:
            vocab = len(gguf.require("tokenizer.ggml.tokens"))
        try:
            return cls(
                num_layers=size("llama.block_count"),
                hidden=hidden,
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                ffn=size("llama.feed_forward_length"),
                vocab_size=vocab,
                rms_eps=number("llama.attention.layer_norm_rms_epsilon", 1e-5),
                rope_base=number("llama.rope.freq_base", 10000.0),
            )
        except ValueError as error:
            raise CupagedError(f"{gguf.path.name}: {error}") from None


def check_kv_dtype(dtype: str, kv_dtype: str | None) -> str:
    """The cache's element type of a model of ``dtype``: ``dtype`` itself (``kv_dtype`` None or
    equal) or an fp8 format (the plans then take ``dtype`` queries over it).

    Raises:
        ValueError: another 16/32-bit type (a plan's queries are of its cache's type, or fp8's).
    """
    if kv_dtype is None or kv_dtype == dtype:
        return dtype
    if not is_fp8(dtype_name(kv_dtype)):
        raise ValueError(
            f"expected kv_dtype {dtype!r} (the model's dtype) or an fp8 format, got {kv_dtype!r}"
        )
    return dtype_name(kv_dtype)


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection ``[num_heads * d, in]``.

    Row ``2i + j`` of a GGUF head is row ``j * d/2 + i`` of the Hugging Face head.
    """
    rows, cols = w.shape
    d = rows // num_heads
    return w.reshape(num_heads, d // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape (NumPy order, ``[out, in]`` for a projection) of every weight of a model of
    ``config``, by GGUF tensor name; ``output.weight`` is there even when a GGUF ties it to the
    token embedding."""
    c = config
    q_rows, kv_rows = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "token_embd.weight": (c.vocab_size, c.hidden),
        "output_norm.weight": (c.hidden,),
        "output.weight": (c.vocab_size, c.hidden),
    }
    layer = {
        "attn_norm": (c.hidden,),
        "attn_q": (q_rows, c.hidden),
        "attn_k": (kv_rows, c.hidden),
        "attn_v": (kv_rows, c.hidden),
        "attn_output": (c.hidden, q_rows),
        "ffn_norm": (c.hidden,),
        "ffn_gate": (c.ffn, c.hidden),
        "ffn_up": (c.ffn, c.hidden),
        "ffn_down": (c.hidden, c.ffn),
    }
    for i in range(c.num_layers):
        shapes |= {f"blk.{i}.{part}.weight": shape for part, shape in layer.items()}
    return shapes


def load_weights(gguf: GGUFFile, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Every weight of the model as float32 NumPy arrays, in GGUF row order (nothing permuted).

    Keys are the GGUF tensor names; ``output.weight`` is the token embedding when tied. Every
    tensor's header is checked before any data is read: a file whose last layer is wrong is
    refused as soon as one whose first layer is.

    Raises:
        CupagedError: a tensor missing, of a shape other than :func:`weight_shapes`', or not
            stored as float weights (:data:`~cupaged.models.gguf.FLOAT_TYPES`); or a tensor
            that a Llama of ``config`` does not use (a layer past ``num_layers``, a bias).
    """
    shapes = weight_shapes(config)
    if "output.weight" not in gguf.tensor_names:  # the head tied to the token embedding
        del shapes["output.weight"]
    for name, shape in shapes.items():
        gguf.check_tensor(name, shape)
    unused = [name for name in gguf.tensor_names if name not in shapes]
    if unused:
        raise CupagedError(
            f"expected only the tensors of a {config.num_layers}-layer Llama in "
            f"{gguf.path.name}, got {len(unused)} more: {', '.join(unused[:4])}"
            + (", ..." if len(unused) > 4 else "")
        )
    weights = {name: gguf.tensor(name) for name in shapes}
    weights.setdefault("output.weight", weights["token_embd.weight"])
    return weights


@dataclass(slots=True)
class CascadeReads:
    """K/V bytes of the decode steps that a cascade planned (docs/cascade.md), over every layer:
    what they read, and what their plain plans would have read. Counted from each plan's own
    arithmetic (no read-back)."""

    steps: int = 0
    bytes_read: int = 0
    bytes_plain: int = 0

    @property
    def bytes_not_read(self) -> int:
        return self.bytes_plain - self.bytes_read

    def add(self, plan: Any, num_layers: int) -> None:
        """Count a step's decode plan, run over ``num_layers`` layers (one without a cascade
        counts nothing)."""
        work = plan.cascade
        if work is not None:
            self.steps += 1
            self.bytes_read += work.bytes_read * num_layers
            self.bytes_plain += work.bytes_plain * num_layers


class Llama:
    """The model on one device, reading and writing K/V through a :class:`~cupaged.PagedCache`.

    Args:
        config: the shapes.
        weights: :func:`load_weights`' float32 arrays (GGUF row order).
        xp: ``numpy`` or ``cupy``; where the weights and activations live.
        dtype: the model's attention dtype: Q/K/V and the attention output are rounded to it,
            the rest runs in float32; the cache's element type too unless ``kv_dtype`` is given.
        kv_dtype: the cache's element type: ``dtype`` (``None``) or an fp8 format
            (``"float8_e4m3"``, ``"float8_e5m2"``), which ``write_kv`` quantizes K/V into with the
            cache's per-layer scales (docs/fp8.md).
        batch_invariant: plan every step's attention with ``batch_invariant=True``, and a step
            of decode rows only as a mixed one is (a :class:`~cupaged.PrefillPlan` in
            :meth:`forward`), so that a sequence's attention is bitwise the same whatever the
            step holds beside it (docs/batch-invariance.md). Only the attention: the matmuls
            are NumPy's or CuPy's, whose results may depend on the batch's rows.
        cascade: the decode plans' ``cascade`` (:class:`~cupaged.DecodePlan`,
            docs/cascade.md): rows that share leading blocks (a request's samples, prompts that
            hit the prefix cache) read them once. ``None``: when it saves enough bytes.

    Raises:
        ValueError: a weight missing or of a shape other than :func:`weight_shapes`' (checked
            before anything is copied to the device).

    Attributes:
        cascade_reads: the K/V bytes that the steps planned with a cascade read, and what
            their plain plans would have read (:class:`CascadeReads`), over every layer.
        seconds: wall time spent so far in ``"attention"`` (``write_kv`` and the attention
            kernels) and in ``"other"`` (everything else), summed over calls. Meaningful on the
            CPU only: CuPy launches return before the GPU finishes.
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, np.ndarray],
        xp: Any,
        dtype: str = "float32",
        kv_dtype: str | None = None,
        batch_invariant: bool = False,
        cascade: bool | None = None,
    ) -> None:
        c = config
        for name, shape in weight_shapes(c).items():
            found = np.shape(weights[name]) if name in weights else "none"
            if found != shape:
                raise ValueError(f"expected weight {name!r} of shape {shape}, got {found}")
        self.config, self.xp, self.dtype = c, xp, dtype
        self.kv_dtype = check_kv_dtype(dtype, kv_dtype)
        self.batch_invariant = bool(batch_invariant)
        self.cascade = cascade
        self.cascade_reads = CascadeReads()
        self.device = "cpu" if xp is np else "cuda"
        self.seconds = {"attention": 0.0, "other": 0.0}
        self.graphs: GraphedAttention | None = None  # use_cuda_graphs()

        def put(a: np.ndarray) -> Any:
            return xp.asarray(np.ascontiguousarray(a, dtype=np.float32))

        self.embed = put(weights["token_embd.weight"])
        self.head = (
            self.embed
            if weights["output.weight"] is weights["token_embd.weight"]
            else put(weights["output.weight"])
        )
        self.final_norm = put(weights["output_norm.weight"])
        self.layers = []
        for i in range(c.num_layers):
            w = {k.split(".")[2]: v for k, v in weights.items() if k.startswith(f"blk.{i}.")}
            wq = unpermute_rope_rows(w["attn_q"], c.num_q_heads)
            wk = unpermute_rope_rows(w["attn_k"], c.num_kv_heads)
            layer = {
                "attn_norm": put(w["attn_norm"]),
                "qkv": put(np.concatenate([wq, wk, w["attn_v"]]).T),  # [hidden, (Hq + 2 Hkv) D]
                "out": put(w["attn_output"].T),
                "ffn_norm": put(w["ffn_norm"]),
                "gate_up": put(np.concatenate([w["ffn_gate"], w["ffn_up"]]).T),  # [hidden, 2 F]
                "down": put(w["ffn_down"].T),
            }
            self.layers.append(layer)
        half = c.head_dim // 2
        self._inv_freq = xp.asarray(c.rope_base ** (-np.arange(half, dtype=np.float64) / half))

    def make_cache(
        self, num_blocks: int, block_size: int = 16, kv_scales: float | str | None = None
    ) -> PagedCache:
        """A cache shaped for this model, on its device, of :attr:`kv_dtype`, prefix caching on.

        Args:
            kv_scales: an fp8 cache's K and V scales: ``None`` (1.0), a positive number, or
                ``"auto"`` (each layer's first write fixes them per KV head:
                :mod:`cupaged.cache.scales`).
        """
        c = self.config
        fp8 = is_fp8(self.kv_dtype)
        return PagedCache(
            num_blocks,
            block_size=block_size,
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
            enable_prefix_caching=True,
            k_scales=kv_scales if fp8 else None,
            v_scales=kv_scales if fp8 else None,
        )

    # ------------------------------------------------------------------------------ forward paths

    def prefill(
        self, cache: PagedCache, admissions: list[Admission], prompts: list[list[int]]
    ) -> Any:
        """Compute the uncached rest of several admitted prompts in one batch.

        Returns ``[len(prompts), vocab]`` float32 logits after each prompt's last token. Commits
        the prompts' blocks to the prefix cache. ``admissions`` are ``cache.admit``'s: their
        slots are written unchecked (the cache planned them).
        """
        xp = self.xp
        starts = [a.num_cached_tokens for a in admissions]
        chunks = [p[s:] for p, s in zip(prompts, starts, strict=True)]
        counts = np.array([len(ch) for ch in chunks], np.int64)
        if (counts < 1).any():
            raise ValueError(f"expected at least one uncached token per prompt, got {counts}")
        sids = [a.sid for a in admissions]
        # Once per batch: positions, slots, the packed query rows and the attention plan (over
        # the cache's own tables and host lengths: nothing read back).
        positions = xp.asarray(
            np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        )
        slots = xp.concatenate([xp.asarray(a.slots) for a in admissions])
        tokens = xp.asarray(np.concatenate([np.asarray(ch, np.int64) for ch in chunks]))
        plan = cache.prefill_plan(
            sids, self.config.num_q_heads, num_tokens=counts, **self._plan_options(cache)
        )

        h = self._layers(tokens, positions, self._writing(cache, slots, plan))
        cache.commit(sids)  # the K/V are written: the prompts' full blocks may serve others now
        last = xp.asarray(np.cumsum(counts) - 1)
        return self._logits(h[last])

    def decode(self, cache: PagedCache, batch: SequenceBatch, tokens: list[int]) -> Any:
        """One decode step: append ``tokens[b]`` to sequence ``b`` of ``batch``; returns
        ``[batch, vocab]`` float32 logits.

        Raises:
            OutOfBlocksError: the step does not fit; nothing was reserved (preempt and retry).
        """
        xp = self.xp
        positions = np.array([cache.seq_len(sid) for sid in batch.sids.tolist()], np.int64)
        # Once per step: slots (copy-on-write applied by the cache), then the attention plan over
        # the batch's tables (the cache's own: unchecked, planned on the device).
        slots = cache.step(batch, tokens=np.asarray(tokens)).slots
        attend = self._decode_attention(cache, batch, slots)
        tokens = xp.asarray(np.asarray(tokens, np.int64))
        h = self._layers(tokens, xp.asarray(positions), attend)
        return self._logits(h)

    def use_cuda_graphs(self, enabled: bool = True) -> None:
        """Replay each decode step's attention as CUDA graphs (docs/cuda-graphs.md): every
        layer's ``write_kv`` and ``DecodePlan.run`` captured once per batch size on static
        buffers and replayed after ``DecodePlan.update`` (:mod:`cupaged.models.graphs`). Its
        decode plans never cascade (:attr:`cascade` is not used). ``False``: plans per step.

        Raises:
            ValueError: on the CPU backend (nothing to capture), for a batch-invariant model
                (its decode steps run prefill plans) or over an fp8 cache (its scales are
                calibrated on the host at the first write).
        """
        if not enabled:
            self.graphs = None
            return
        if self.device != "cuda":
            why = "runs on the CPU backend, which cannot capture CUDA graphs; use a GPU"
        elif self.batch_invariant:
            why = "is batch-invariant (its decode steps run prefill plans)"
        elif is_fp8(self.kv_dtype):
            why = f"has a {self.kv_dtype} cache (its scales are calibrated on the host)"
        else:
            self.graphs = GraphedAttention(self.config.num_layers, self.config.num_q_heads)
            return
        raise ValueError(f"expected a model on a GPU for CUDA graphs, got a model that {why}")

    def _decode_attention(self, cache: PagedCache, sids: Any, slots: Any) -> Attend:
        """A decode step's attention: the replayed graphs of :meth:`use_cuda_graphs`, or the
        step's plan (the cache's, over its own tables: unchecked) run after ``write_kv``."""
        if self.graphs is not None:
            return self.graphs.step(cache, sids, slots)
        plan = cache.decode_plan(sids, self.config.num_q_heads, **self._decode_options(cache))
        self.cascade_reads.add(plan, self.config.num_layers)
        return self._writing(cache, slots, plan)

    def forward(
        self, cache: PagedCache, plan: StepPlan, tokens: Any, positions: Any, rows: Any
    ) -> Any:
        """One mixed step: every sequence of a ``step(..., tables=True)`` plan computes its new
        tokens (a prompt chunk, or one decode token) in one pass over the layers.

        Planned once for the step: a :class:`~cupaged.PrefillPlan` over every row, chunks and
        decode rows together (the prefill page's decision: one launch for a mixed batch), or a
        :class:`~cupaged.DecodePlan` (the decode kernel) for a step of decode rows only (but
        for a :attr:`batch_invariant` model). Per layer, one ``write_kv`` for every new token,
        then the plan's ``run``.

        Args:
            plan: ``cache.step(sids, num_tokens, tokens, tables=True)``: slots, tables, lengths
                (the step's tokens included) and ``query_start_loc``, all this cache's own, so
                written and attended unchecked.
            tokens: ``[sum(num_tokens)]`` int token ids, packed in the plan's order.
            positions: ``[sum(num_tokens)]`` int positions of those tokens in their sequences.
            rows: indices into the packed tokens whose logits are wanted (e.g. each sequence's
                last row).

        Returns:
            ``[len(rows), vocab]`` float32 logits.
        """
        xp = self.xp
        # Over the step's own tables (the cache refuses another cache's plan).
        options = self._plan_options(cache)
        # Batch-invariant: every row through one kernel, whatever else the step holds.
        if (plan.num_tokens == 1).all() and not self.batch_invariant:
            attend = self._decode_attention(cache, plan, plan.slots)
        else:
            attention = cache.prefill_plan(plan, self.config.num_q_heads, **options)
            attend = self._writing(cache, plan.slots, attention)
        tokens = xp.asarray(np.asarray(tokens, np.int64))
        positions = xp.asarray(np.asarray(positions, np.int64))
        h = self._layers(tokens, positions, attend)
        return self._logits(h[xp.asarray(np.asarray(rows, np.int64))])

    def forward_full(self, tokens: list[int], cache: PagedCache | None = None) -> Any:
        """``[vocab]`` float32 logits after the last of ``tokens``, computed from scratch
        without any cache: causal attention in array ops over the whole sequence (Q/K/V and the
        attention output rounded to the model's dtype, as on the paged paths). The check of the
        paged paths.

        Args:
            cache: for an fp8 :attr:`kv_dtype`, the cache whose scales the paged paths used: K/V
                are rounded through the fp8 format with them, as ``write_kv`` stores them (and
                read as ``fp8 * scale``). Not read otherwise, nor written.
        """
        xp, c = self.xp, self.config
        group = c.num_q_heads // c.num_kv_heads
        n = len(tokens)
        visible = xp.asarray(np.tril(np.ones((n, n), bool)))

        def attend(i: int, q: Any, k: Any, v: Any) -> Any:
            q, k, v = (to_float(x) for x in (q, k, v))
            if is_fp8(self.kv_dtype):
                k, v = self._through_fp8(i, k, v, cache)
            k, v = xp.repeat(k, group, axis=1), xp.repeat(v, group, axis=1)  # [n, Hq, D]
            scores = xp.einsum("qhd,khd->hqk", q, k) * np.float32(c.head_dim**-0.5)
            scores = xp.where(visible[None], scores, -xp.inf)
            weights = xp.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            # The kernels return Q's dtype: round alike, so that only summation orders differ.
            return self._store(xp.einsum("hqk,khd->qhd", weights, v))

        h = self._layers(xp.asarray(np.asarray(tokens, np.int64)), xp.arange(n), attend)
        return self._logits(h[-1:])[0]

    # ------------------------------------------------------------------------------ pieces

    @staticmethod
    def _writing(cache: PagedCache, slots: Any, plan: Plan) -> Attend:
        """Attention over the cache: the new K/V written to ``slots`` (the cache's own plan of
        the step: unchecked), then the step's attention ``plan`` run on layer ``i``. An fp8
        cache's ``"auto"`` scales of a layer are fixed by its first write, before it."""

        def run(i: int, q: Any, k: Any, v: Any) -> Any:
            cache.calibrate_kv_scales(i, k, v)
            scales = cache.scale_options(i, write=True)
            write_kv(cache.k[i], cache.v[i], k, v, slots, checked=False, **scales)
            return plan.run(q, cache.k[i], cache.v[i], **cache.scale_options(i))

        return run

    def _plan_options(self, cache: PagedCache) -> dict[str, Any]:
        """The plans' options: :attr:`batch_invariant`, and over an fp8 cache ``q_dtype``, the
        model's dtype."""
        options: dict[str, Any] = {"batch_invariant": self.batch_invariant}
        if is_fp8(cache.spec.dtype):
            options["q_dtype"] = self.dtype
        return options

    def _decode_options(self, cache: PagedCache) -> dict[str, Any]:
        """The decode plans' options: :meth:`_plan_options` and :attr:`cascade`."""
        return {**self._plan_options(cache), "cascade": self.cascade}

    def _through_fp8(self, layer: int, k: Any, v: Any, cache: PagedCache | None) -> tuple:
        """float32 K/V of ``layer`` as an fp8 cache holds and reads them: ``fp8(x / scale) *
        scale`` with the cache's scales per KV head (``[n, heads, head_dim]`` arrays)."""
        if cache is None:
            raise ValueError(f"expected the cache whose scales a {self.kv_dtype} model read")
        out = []
        for x, scale in zip((k, v), cache.kv_scales(layer), strict=True):
            scale = scale.astype(np.float32)[None, :, None]
            out.append(to_float(from_float(x / scale, self.kv_dtype)) * scale)
        return out[0], out[1]

    def _layers(self, tokens: Any, positions: Any, attend: Attend) -> Any:
        """The decoder layers over ``tokens`` at ``positions``; ``attend(i, q, k, v)`` is layer
        ``i``'s attention (Q/K/V in the cache's dtype; ``[n, heads, head_dim]``)."""
        c, xp = self.config, self.xp
        n = len(tokens)
        q_width, kv_width = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cos, sin = self._rotary(positions)
        h = self.embed[tokens]
        clock = time.perf_counter
        for i, layer in enumerate(self.layers):
            t0 = clock()
            qkv = self._rms_norm(h, layer["attn_norm"]) @ layer["qkv"]
            q = self._rope(qkv[:, :q_width].reshape(n, c.num_q_heads, c.head_dim), cos, sin)
            k = self._rope(
                qkv[:, q_width : q_width + kv_width].reshape(n, c.num_kv_heads, -1), cos, sin
            )
            v = qkv[:, q_width + kv_width :].reshape(n, c.num_kv_heads, c.head_dim)
            t1 = clock()
            out = to_float(attend(i, self._store(q), self._store(k), self._store(v)))
            out = out.reshape(n, q_width)
            t2 = clock()
            h = h + out @ layer["out"]
            gate_up = self._rms_norm(h, layer["ffn_norm"]) @ layer["gate_up"]
            gate, up = gate_up[:, : c.ffn], gate_up[:, c.ffn :]
            h = h + (gate / (1 + xp.exp(-gate)) * up) @ layer["down"]
            t3 = clock()
            self.seconds["attention"] += t2 - t1
            self.seconds["other"] += (t1 - t0) + (t3 - t2)
        return h

    def _rotary(self, positions: Any) -> tuple[Any, Any]:
        angles = positions.astype(np.float64)[:, None] * self._inv_freq[None, :]
        return (
            self.xp.cos(angles).astype(np.float32)[:, None, :],
            self.xp.sin(angles).astype(np.float32)[:, None, :],
        )

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        """Rotate halves ``(x[i], x[i + d/2])`` (the rows were un-permuted at load)."""
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return self.xp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def _rms_norm(self, x: Any, weight: Any) -> Any:
        scale = 1 / self.xp.sqrt(
            (x * x).mean(axis=-1, keepdims=True) + np.float32(self.config.rms_eps)
        )
        return (x * scale) * weight

    def _store(self, x: Any) -> Any:
        """``x`` in the cache's element type (bfloat16 as uint16 bits, which every bfloat16 cache
        takes), C-contiguous."""
        return self.xp.ascontiguousarray(from_float(x, self.dtype))

    def _logits(self, h: Any) -> Any:
        t0 = time.perf_counter()
        logits = self._rms_norm(h, self.final_norm) @ self.head.T
        self.seconds["other"] += time.perf_counter() - t0
        return logits
