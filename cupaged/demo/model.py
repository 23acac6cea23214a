"""The demo's tiny decoder: a :class:`cupaged.models.Llama` with seeded random weights.

The same forward as the real model (:mod:`cupaged.models.llama`): token embedding,
``num_layers`` blocks of RMSNorm -> GQA attention with rotary positions -> RMSNorm -> SwiGLU, a
final RMSNorm and a head tied to the embedding. Only the weights differ: seeded random (or
loaded from a ``.npz``), and the shapes small; the point is the memory traffic, not the text.

The paths the engine runs, which must agree (all of them :class:`~cupaged.models.Llama`'s):

- ``prefill``: the uncached rest of admitted prompts (``cache.admit``); K/V written with
  ``write_kv`` to the admissions' slots, then the fused ``paged_prefill`` per layer;
- ``decode``: one token for each sequence of a ``SequenceBatch``; ``write_kv`` and the fused
  ``paged_attention`` per layer;
- ``forward``: a mixed step (prompt chunks and decode tokens together, ``--prefill-chunk``),
  ``write_kv`` and one ``paged_prefill`` over chunks and decode rows together, per layer;
- ``forward_full``: the whole sequence at once, no cache at all (the check).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from .. import to_numpy
from ..models import Llama, LlamaConfig


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the tiny model. ``head_dim`` must be one the attention kernel takes (64..256)."""

    vocab_size: int = 256
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    hidden_size: int = 512  # of the SwiGLU
    rope_theta: float = 10_000.0

    @property
    def model_dim(self) -> int:
        return self.num_q_heads * self.head_dim

    def llama(self) -> LlamaConfig:
        """The same shape as a :class:`~cupaged.models.LlamaConfig`."""
        return LlamaConfig(num_layers=self.num_layers, hidden=self.model_dim,
                           num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, ffn=self.hidden_size,
                           vocab_size=self.vocab_size, rms_eps=1e-6,
                           rope_base=self.rope_theta)  # fmt: skip


def random_weights(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights under the GGUF tensor names that :class:`Llama` reads
    (projections ``[out_features, in_features]``, scaled by ``1 / sqrt(in_features)``; norms 1)."""
    rng = np.random.default_rng(seed)
    c = config
    d, q_dim, kv_dim = c.model_dim, c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def dense(fan_out: int, fan_in: int) -> np.ndarray:
        return rng.standard_normal((fan_out, fan_in), dtype=np.float32) / np.float32(
            np.sqrt(fan_in)
        )

    ones = np.ones(d, np.float32)
    weights = {
        "token_embd.weight": rng.standard_normal((c.vocab_size, d), dtype=np.float32),
        "output_norm.weight": ones,
    }
    for i in range(c.num_layers):
        p = f"blk.{i}."
        weights |= {
            p + "attn_norm.weight": ones, p + "ffn_norm.weight": ones,
            p + "attn_q.weight": dense(q_dim, d), p + "attn_k.weight": dense(kv_dim, d),
            p + "attn_v.weight": dense(kv_dim, d), p + "attn_output.weight": dense(d, q_dim),
            p + "ffn_gate.weight": dense(c.hidden_size, d), p + "ffn_up.weight": dense(c.hidden_size, d),
            p + "ffn_down.weight": dense(d, c.hidden_size),
        }  # fmt: skip
    return weights


class TinyDecoder(Llama):
    """A :class:`~cupaged.models.Llama` of the demo's small shape with seeded random weights.

    Args:
        config: the model's shape.
        xp: ``numpy`` or ``cupy``.
        seed: seed of the random weights.
        dtype: the KV cache's dtype; Q/K/V are rounded to it.
        weights: the weights (GGUF names, float32) instead of seeded random ones.

    Attributes:
        shape: ``config`` (``self.config`` is the :class:`~cupaged.models.LlamaConfig`).
        weights: the float32 host weights, by GGUF name (the head is tied to the embedding).
    """

    def __init__(self, config: ModelConfig, xp: Any, seed: int = 0, dtype: str = "float32",
                 weights: dict[str, np.ndarray] | None = None) -> None:  # fmt: skip
        self.shape = config
        self.weights = dict(weights) if weights is not None else random_weights(config, seed)
        self.weights.pop("output.weight", None)
        tied = self.weights | {"output.weight": self.weights["token_embd.weight"]}
        super().__init__(config.llama(), tied, xp, dtype=dtype)

    def save(self, path: str | Path) -> None:
        """Write the weights and the config to a ``.npz`` file that :meth:`load` reads."""
        arrays = {name: to_numpy(w) for name, w in self.weights.items()}
        config = {
            f"config.{f.name}": np.asarray(getattr(self.shape, f.name)) for f in fields(ModelConfig)
        }
        np.savez(path, **arrays, **config)

    @classmethod
    def load(cls, path: str | Path, xp: Any, dtype: str = "float32") -> TinyDecoder:
        """Read a model written by :meth:`save` (the same architecture, any sizes)."""
        with np.load(path) as data:
            config = ModelConfig(
                **{f.name: data[f"config.{f.name}"].item() for f in fields(ModelConfig)}
            )
            expected = random_weights(config, seed=0)  # the names and shapes
            missing = sorted(set(expected) - set(data.files))
            if missing:
                raise ValueError(f"expected weights {missing} in {path}, got none")
            weights = {}
            for name, w in expected.items():
                if data[name].shape != w.shape:
                    raise ValueError(f"expected {name} of shape {w.shape}, got {data[name].shape}")
                weights[name] = data[name].astype(np.float32)
        return cls(config, xp, dtype=dtype, weights=weights)
