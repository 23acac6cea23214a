"""A tiny decoder-only transformer in array ops (NumPy or CuPy) that keeps its K/V in a PagedCache.

Llama-shaped: token embedding, ``num_layers`` blocks of RMSNorm -> GQA attention with rotary
positions -> RMSNorm -> SiLU MLP, a final RMSNorm and a head tied to the embedding. Weights are
seeded random (or loaded from a ``.npz``); the point is the memory traffic, not the text.

Three ways to run it, which must agree:

- :meth:`TinyDecoder.prefill`: the uncached rest of an admitted prompt (``cache.admit``); K/V
  written with ``write_kv`` to the admission's slots, then the fused ``paged_prefill`` (causal,
  over the sequence's cached prefix and the chunk) per layer;
- :meth:`TinyDecoder.decode`: one token for each sequence of a batch (a ``SequenceBatch``);
  ``cache.step`` and ``block_tables`` once per step, ``write_kv`` and the fused
  ``paged_attention`` per layer;
- :meth:`TinyDecoder.forward_full`: the whole sequence at once, no cache at all (the check).

Activations are float32. Q, K and V are rounded to the cache's dtype on every path (the cache
stores K/V in it and the kernel takes Q in it), so the three paths differ only by summation order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from .. import (
    Admission,
    PagedCache,
    SequenceBatch,
    from_float,
    paged_attention,
    paged_prefill,
    to_float,
    to_numpy,
    write_kv,
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the tiny model. ``head_dim`` must be one the attention kernel takes (64..256)."""

    vocab_size: int = 256
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    hidden_size: int = 512
    rope_theta: float = 10_000.0

    @property
    def model_dim(self) -> int:
        return self.num_q_heads * self.head_dim


class TinyDecoder:
    """The model: weights on one device, and the three forward paths.

    Args:
        config: the model's shape.
        xp: ``numpy`` or ``cupy``.
        seed: seed of the random weights.
        dtype: the KV cache's dtype; Q/K/V are rounded to it.
    """

    def __init__(self, config: ModelConfig, xp: Any, seed: int = 0, dtype: str = "float32") -> None:
        self.config, self.xp, self.dtype = config, xp, dtype
        rng = np.random.default_rng(seed)
        c = config
        d, q_dim, kv_dim = c.model_dim, c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def dense(fan_in: int, fan_out: int) -> np.ndarray:
            return rng.standard_normal((fan_in, fan_out), dtype=np.float32) / np.float32(
                np.sqrt(fan_in)
            )

        weights = {"embed": rng.standard_normal((c.vocab_size, d), dtype=np.float32)}
        for i in range(c.num_layers):
            weights |= {
                f"l{i}.wq": dense(d, q_dim), f"l{i}.wk": dense(d, kv_dim),
                f"l{i}.wv": dense(d, kv_dim), f"l{i}.wo": dense(q_dim, d),
                f"l{i}.w1": dense(d, c.hidden_size), f"l{i}.w2": dense(c.hidden_size, d),
            }  # fmt: skip
        self.weights = {name: xp.asarray(w) for name, w in weights.items()}
        half = c.head_dim // 2
        self._inv_freq = xp.asarray(c.rope_theta ** (-np.arange(half, dtype=np.float64) / half))

    # ------------------------------------------------------------------------------ weights

    def save(self, path: str | Path) -> None:
        """Write the weights and the config to a ``.npz`` file that :meth:`load` reads."""
        arrays = {name: to_numpy(w) for name, w in self.weights.items()}
        config = {
            f"config.{f.name}": np.asarray(getattr(self.config, f.name))
            for f in fields(ModelConfig)
        }
        np.savez(path, **arrays, **config)

    @classmethod
    def load(cls, path: str | Path, xp: Any, dtype: str = "float32") -> TinyDecoder:
        """Read a model written by :meth:`save` (the same architecture, any sizes)."""
        with np.load(path) as data:
            config = ModelConfig(
                **{f.name: data[f"config.{f.name}"].item() for f in fields(ModelConfig)}
            )
            model = cls(config, xp, dtype=dtype)
            missing = set(model.weights) - set(data.files)
            if missing:
                raise ValueError(f"expected weights {sorted(missing)} in {path}, got none")
            for name, w in model.weights.items():
                if data[name].shape != w.shape:
                    raise ValueError(f"expected {name} of shape {w.shape}, got {data[name].shape}")
                model.weights[name] = xp.asarray(data[name].astype(np.float32))
        return model

    def make_cache(
        self, num_blocks: int, block_size: int, device: str, prefix_caching: bool
    ) -> PagedCache:
        """A cache shaped for this model."""
        c = self.config
        return PagedCache(num_blocks, block_size=block_size, num_layers=c.num_layers,
                          num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.dtype,
                          device=device, enable_prefix_caching=prefix_caching)  # fmt: skip

    # ------------------------------------------------------------------------------ forward paths

    def prefill(self, cache: PagedCache, admission: Admission, prompt: list[int]) -> Any:
        """Compute the uncached rest of an admitted prompt; returns the logits after its last token.

        ``cache.admit(prompt)`` attached the cached prefix and reserved slots for the rest: its
        positions continue from ``admission.num_cached_tokens``.
        """
        xp, c = self.xp, self.config
        sid, start, slots = admission.sid, admission.num_cached_tokens, admission.slots
        tokens = prompt[start:]
        n = len(tokens)
        positions = xp.arange(start, start + n)
        # Once per prompt: the table and length (the chunk included: its slots are reserved),
        # and the chunk's rows, 0 .. n of the packed queries.
        tables, lens = cache.block_tables([sid])
        query_start_loc = xp.asarray(np.array([0, n], np.int32))
        h = self.weights["embed"][xp.asarray(tokens)]
        for i in range(c.num_layers):
            q, k, v = self._qkv(i, h, positions)
            write_kv(cache.k[i], cache.v[i], self._store(k), self._store(v), slots)
            out = paged_prefill(self._store(q), cache.k[i], cache.v[i], tables, lens,
                                query_start_loc)  # fmt: skip
            h = h + to_float(out).reshape(n, -1) @ self.weights[f"l{i}.wo"]
            h = h + self._mlp(i, h)
        cache.commit(sid)  # the prompt's K/V are written: its full blocks may serve others now
        return self._logits(h[-1:])[0]

    def decode(self, cache: PagedCache, batch: SequenceBatch, tokens: list[int]) -> Any:
        """One decode step: append ``tokens[b]`` to sequence ``b`` of ``batch``; returns
        ``[batch, vocab]`` logits.

        Raises:
            OutOfBlocksError: the step does not fit; nothing was reserved (preempt and retry).
        """
        xp, c = self.xp, self.config
        positions = [cache.seq_len(sid) for sid in batch.sids.tolist()]
        # Once per step: the slots (and copy-on-write copies, applied by the cache), the block
        # tables, the longest context. tokens= keys the blocks that fill (prefix caching).
        slots = cache.step(batch, tokens=np.asarray(tokens)).slots
        tables, lens = cache.block_tables(batch)
        max_context = max(positions) + 1
        h = self.weights["embed"][xp.asarray(tokens)]
        pos = xp.asarray(positions)
        for i in range(c.num_layers):
            q, k, v = self._qkv(i, h, pos)
            write_kv(cache.k[i], cache.v[i], self._store(k), self._store(v), slots)
            out = paged_attention(self._store(q), cache.k[i], cache.v[i], tables, lens,
                                  max_context_len=max_context)  # fmt: skip
            h = h + to_float(out).reshape(len(batch), -1) @ self.weights[f"l{i}.wo"]
            h = h + self._mlp(i, h)
        return self._logits(h)

    def forward_full(self, tokens: list[int]) -> Any:
        """Logits after the last of ``tokens``, computed from scratch without any cache."""
        xp, c = self.xp, self.config
        h = self.weights["embed"][xp.asarray(tokens)]
        positions = xp.arange(len(tokens))
        for i in range(c.num_layers):
            q, k, v = self._qkv(i, h, positions)
            keys = to_float(self._store(k)).transpose(1, 0, 2)  # [L, Hkv, D] -> [Hkv, L, D]
            values = to_float(self._store(v)).transpose(1, 0, 2)
            h = (
                h
                + self._attend_causal(q, keys.transpose(1, 0, 2), values.transpose(1, 0, 2), 0)
                @ self.weights[f"l{i}.wo"]
            )
            h = h + self._mlp(i, h)
        return self._logits(h[-1:])[0]

    # ------------------------------------------------------------------------------ pieces

    def _qkv(self, i: int, h: Any, positions: Any) -> tuple[Any, Any, Any]:
        c, w = self.config, self.weights
        x = _rms_norm(h)
        q = (x @ w[f"l{i}.wq"]).reshape(len(h), c.num_q_heads, c.head_dim)
        k = (x @ w[f"l{i}.wk"]).reshape(len(h), c.num_kv_heads, c.head_dim)
        v = (x @ w[f"l{i}.wv"]).reshape(len(h), c.num_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _rope(self, x: Any, positions: Any) -> Any:
        """Rotary positions, rotating the two halves of each head (GPT-NeoX layout)."""
        angles = positions.astype(np.float64)[:, None] * self._inv_freq[None, :]
        cos = self.xp.cos(angles).astype(np.float32)[:, None, :]
        sin = self.xp.sin(angles).astype(np.float32)[:, None, :]
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return self.xp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def _store(self, x: Any) -> Any:
        """``x`` in the cache's dtype (bfloat16 as uint16 bit patterns), C-contiguous."""
        return self.xp.ascontiguousarray(from_float(x, self.dtype))

    def _attend_causal(self, q: Any, keys: Any, values: Any, start: int) -> Any:
        """Causal GQA attention of queries at positions start.. over keys 0..; ``[n, Hq*D]``."""
        xp, c = self.xp, self.config
        n, length = len(q), len(keys)
        group = c.num_q_heads // c.num_kv_heads
        q = to_float(self._store(q))
        k = xp.repeat(keys, group, axis=1)  # [L, Hq, D]
        v = xp.repeat(values, group, axis=1)
        scores = xp.einsum("nhd,lhd->hnl", q, k) * np.float32(c.head_dim**-0.5)
        visible = xp.arange(length)[None, :] <= (start + xp.arange(n))[:, None]
        scores = xp.where(visible[None], scores, -xp.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = xp.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        return xp.einsum("hnl,lhd->nhd", weights, v).reshape(n, -1)

    def _mlp(self, i: int, h: Any) -> Any:
        x = _rms_norm(h) @ self.weights[f"l{i}.w1"]
        return (x / (1 + self.xp.exp(-x))) @ self.weights[f"l{i}.w2"]

    def _logits(self, h: Any) -> Any:
        return _rms_norm(h) @ self.weights["embed"].T


def _rms_norm(x: Any) -> Any:
    return x / (((x * x).mean(axis=-1, keepdims=True) + 1e-6) ** 0.5)
