"""A Llama-family decoder in array ops (NumPy on the CPU, CuPy on the GPU) over the paged cache.

Per layer: RMSNorm, Q/K/V projections, rotary positions, GQA attention through cupaged
(``write_kv`` then ``paged_prefill`` for prompts and mixed steps, ``paged_attention`` for decode
steps), the output projection, RMSNorm, SwiGLU. The head is the output matrix, or the token
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
    PagedCache,
    SequenceBatch,
    StepPlan,
    from_float,
    paged_attention,
    paged_prefill,
    to_float,
    write_kv,
)
from .gguf import GGUFFile

# Layer i's attention: (i, q, k, v) -> [n, num_q_heads, head_dim], Q/K/V in the cache's dtype.
Attend = Callable[[int, Any, Any, Any], Any]


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

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> LlamaConfig:
        arch = gguf.require("general.architecture")
        if arch != "llama":
            raise CupagedError(f"expected a 'llama' architecture GGUF, got {arch!r}")
        hidden = int(gguf.require("llama.embedding_length"))
        num_q_heads = int(gguf.require("llama.attention.head_count"))
        num_kv_heads = int(gguf.metadata("llama.attention.head_count_kv", num_q_heads))
        head_dim = hidden // num_q_heads
        rope_dim = int(gguf.metadata("llama.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise CupagedError(
                f"expected rotary positions over the whole head ({head_dim}), got {rope_dim}"
            )
        vocab = gguf.metadata("llama.vocab_size")
        if vocab is None:
            vocab = len(gguf.require("tokenizer.ggml.tokens"))
        return cls(
            num_layers=int(gguf.require("llama.block_count")),
            hidden=hidden,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            ffn=int(gguf.require("llama.feed_forward_length")),
            vocab_size=int(vocab),
            rms_eps=float(gguf.metadata("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(gguf.metadata("llama.rope.freq_base", 10000.0)),
        )


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection ``[num_heads * d, in]``.

    Row ``2i + j`` of a GGUF head is row ``j * d/2 + i`` of the Hugging Face head.
    """
    rows, cols = w.shape
    d = rows // num_heads
    return w.reshape(num_heads, d // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def load_weights(gguf: GGUFFile, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Every weight of the model as float32 NumPy arrays, in GGUF row order (nothing permuted).

    Keys are the GGUF tensor names; ``output.weight`` is the token embedding when tied.
    """
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(config.num_layers):
        names += [f"blk.{i}.{part}.weight" for part in ("attn_norm", "attn_q", "attn_k", "attn_v",
                  "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]  # fmt: skip
    weights = {name: gguf.tensor(name) for name in names}
    tied = "output.weight" not in gguf.tensor_names
    weights["output.weight"] = (
        weights["token_embd.weight"] if tied else gguf.tensor("output.weight")
    )
    c = config
    expected = {
        "token_embd.weight": (c.vocab_size, c.hidden),
        "output.weight": (c.vocab_size, c.hidden),
        "blk.0.attn_q.weight": (c.num_q_heads * c.head_dim, c.hidden),
        "blk.0.attn_k.weight": (c.num_kv_heads * c.head_dim, c.hidden),
        "blk.0.ffn_down.weight": (c.hidden, c.ffn),
    }
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise CupagedError(f"expected {name} of shape {shape}, got {weights[name].shape}")
    return weights


class Llama:
    """The model on one device, reading and writing K/V through a :class:`~cupaged.PagedCache`.

    Args:
        config: the shapes.
        weights: :func:`load_weights`' float32 arrays (GGUF row order).
        xp: ``numpy`` or ``cupy``; where the weights and activations live.
        dtype: the cache's element type; Q/K/V are rounded to it, the rest runs in float32.

    Attributes:
        seconds: wall time spent so far in ``"attention"`` (``write_kv`` and the attention
            kernels) and in ``"other"`` (everything else), summed over calls. Meaningful on the
            CPU only: CuPy launches return before the GPU finishes.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], xp: Any,
                 dtype: str = "float32") -> None:  # fmt: skip
        c = config
        self.config, self.xp, self.dtype = c, xp, dtype
        self.device = "cpu" if xp is np else "cuda"
        self.seconds = {"attention": 0.0, "other": 0.0}

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
            self.layers.append({
                "attn_norm": put(w["attn_norm"]),
                "qkv": put(np.concatenate([wq, wk, w["attn_v"]]).T),  # [hidden, (Hq + 2 Hkv) D]
                "out": put(w["attn_output"].T),
                "ffn_norm": put(w["ffn_norm"]),
                "gate_up": put(np.concatenate([w["ffn_gate"], w["ffn_up"]]).T),  # [hidden, 2 F]
                "down": put(w["ffn_down"].T),
            })  # fmt: skip
        half = c.head_dim // 2
        self._inv_freq = xp.asarray(c.rope_base ** (-np.arange(half, dtype=np.float64) / half))

    def make_cache(self, num_blocks: int, block_size: int = 16) -> PagedCache:
        """A cache shaped for this model, on its device, prefix caching on."""
        c = self.config
        return PagedCache(num_blocks, block_size=block_size, num_layers=c.num_layers,
                          num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.dtype,
                          device=self.device, enable_prefix_caching=True)  # fmt: skip

    # ------------------------------------------------------------------------------ forward paths

    def prefill(self, cache: PagedCache, admissions: list[Admission],
                prompts: list[list[int]]) -> Any:  # fmt: skip
        """Compute the uncached rest of several admitted prompts in one batch.

        Returns ``[len(prompts), vocab]`` float32 logits after each prompt's last token. Commits
        the prompts' blocks to the prefix cache.
        """
        xp = self.xp
        starts = [a.num_cached_tokens for a in admissions]
        chunks = [p[s:] for p, s in zip(prompts, starts, strict=True)]
        counts = np.array([len(ch) for ch in chunks], np.int64)
        if (counts < 1).any():
            raise ValueError(f"expected at least one uncached token per prompt, got {counts}")
        sids = [a.sid for a in admissions]
        # Once per batch: positions, slots, tables and the packed query rows.
        positions = xp.asarray(
            np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        )
        slots = xp.concatenate([xp.asarray(a.slots) for a in admissions])
        tables, lens = cache.block_tables(sids)
        query_start_loc = xp.asarray(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
        tokens = xp.asarray(np.concatenate([np.asarray(ch, np.int64) for ch in chunks]))

        h = self._layers(
            tokens, positions, self._paged(cache, slots, tables, lens, query_start_loc)
        )
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
        # Once per step: slots (copy-on-write applied by the cache), tables, the longest context.
        slots = cache.step(batch, tokens=np.asarray(tokens)).slots
        tables, lens = cache.block_tables(batch)
        max_context = int(positions.max()) + 1

        def attend(i: int, q: Any) -> Any:
            return paged_attention(q, cache.k[i], cache.v[i], tables, lens,
                                   max_context_len=max_context)  # fmt: skip

        h = self._layers(xp.asarray(np.asarray(tokens, np.int64)), xp.asarray(positions),
                         self._writing(cache, slots, attend))  # fmt: skip
        return self._logits(h)

    def forward(self, cache: PagedCache, plan: StepPlan, tokens: Any, positions: Any,
                rows: Any) -> Any:  # fmt: skip
        """One mixed step: every sequence of a ``step(..., tables=True)`` plan computes its new
        tokens (a prompt chunk, or one decode token) in one pass over the layers.

        Per layer, one ``write_kv`` for every new token, then one ``paged_prefill`` over every
        row, chunks and decode rows together (the prefill page's decision: one launch for a
        mixed batch); a step of decode rows only takes ``paged_attention``, the decode kernel.
        (On the CPU backend, a step of 15 decode rows and one 16-token chunk at SmolLM2's heads
        and 60-token contexts took 7.4 ms a layer in one ``paged_prefill``, 9.8 + 6.3 ms split
        over the two kernels.)

        Args:
            plan: ``cache.step(sids, num_tokens, tokens, tables=True)``: slots, tables, lengths
                (the step's tokens included) and ``query_start_loc``.
            tokens: ``[sum(num_tokens)]`` int token ids, packed in the plan's order.
            positions: ``[sum(num_tokens)]`` int positions of those tokens in their sequences.
            rows: indices into the packed tokens whose logits are wanted (e.g. each sequence's
                last row).

        Returns:
            ``[len(rows), vocab]`` float32 logits.
        """
        xp = self.xp
        counts, starts = plan.num_tokens, plan.query_start_loc
        tables, lens = plan.block_tables, plan.context_lens
        if (counts == 1).all():
            attend = self._writing(cache, plan.slots, lambda i, q: paged_attention(
                q, cache.k[i], cache.v[i], tables, lens))  # fmt: skip
        else:
            attend = self._paged(cache, plan.slots, tables, lens, xp.asarray(starts))
        h = self._layers(xp.asarray(np.asarray(tokens, np.int64)),
                         xp.asarray(np.asarray(positions, np.int64)), attend)  # fmt: skip
        return self._logits(h[xp.asarray(np.asarray(rows, np.int64))])

    def forward_full(self, tokens: list[int]) -> Any:
        """``[vocab]`` float32 logits after the last of ``tokens``, computed from scratch
        without any cache: causal attention in array ops over the whole sequence (Q/K/V and the
        attention output rounded to the cache's dtype, as on the paged paths). The check of the
        paged paths."""
        xp, c = self.xp, self.config
        group = c.num_q_heads // c.num_kv_heads
        n = len(tokens)
        visible = xp.asarray(np.tril(np.ones((n, n), bool)))

        def attend(i: int, q: Any, k: Any, v: Any) -> Any:
            q, k, v = (to_float(x) for x in (q, k, v))
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
    def _writing(cache: PagedCache, slots: Any, attend: Callable[[int, Any], Any]) -> Attend:
        """Attention over the cache: the new K/V written to ``slots``, then ``attend(i, q)``."""

        def run(i: int, q: Any, k: Any, v: Any) -> Any:
            write_kv(cache.k[i], cache.v[i], k, v, slots)
            return attend(i, q)

        return run

    def _paged(self, cache: PagedCache, slots: Any, tables: Any, lens: Any,
               query_start_loc: Any) -> Attend:  # fmt: skip
        """``write_kv`` + ``paged_prefill`` (causal) per layer, over packed query rows."""

        def attend(i: int, q: Any) -> Any:
            return paged_prefill(q, cache.k[i], cache.v[i], tables, lens, query_start_loc)

        return self._writing(cache, slots, attend)

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
            k = self._rope(qkv[:, q_width : q_width + kv_width].reshape(n, c.num_kv_heads, -1),
                           cos, sin)  # fmt: skip
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
        return (self.xp.cos(angles).astype(np.float32)[:, None, :],
                self.xp.sin(angles).astype(np.float32)[:, None, :])  # fmt: skip

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
        """``x`` in the cache's dtype (bfloat16 as uint16 bit patterns), C-contiguous."""
        return self.xp.ascontiguousarray(from_float(x, self.dtype))

    def _logits(self, h: Any) -> Any:
        t0 = time.perf_counter()
        logits = self._rms_norm(h, self.final_norm) @ self.head.T
        self.seconds["other"] += time.perf_counter() - t0
        return logits
