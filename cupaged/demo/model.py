"""The demo's tiny decoder: a :class:`cupaged.models.Llama` with seeded random weights.

The same forward as the real model (:mod:`cupaged.models.llama`): token embedding,
``num_layers`` blocks of RMSNorm -> GQA attention with rotary positions -> RMSNorm -> SwiGLU, a
final RMSNorm and a head tied to the embedding. Only the weights differ: seeded random (or
loaded from a ``.npz``), and the shapes small; the point is the memory traffic, not the text.

The paths the engine runs, which must agree (all of them :class:`~cupaged.models.Llama`'s):

- ``prefill``: the uncached rest of admitted prompts (``cache.admit``); K/V written with
  ``write_kv`` to the admissions' slots, then one ``PrefillPlan`` of the step run by every layer;
- ``decode``: one token for each sequence of a ``SequenceBatch``; ``write_kv``, then one
  ``DecodePlan`` of the step run by every layer;
- ``forward``: a mixed step (prompt chunks and decode tokens together, ``--prefill-chunk``) of a
  ``step(..., tables=True)``, planned once the same way;
- ``forward_full``: the whole sequence at once, no cache at all (the check).
"""

from __future__ import annotations

import math
import zipfile
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, Any

import numpy as np

from .. import CupagedError, to_numpy
from ..models import Llama, LlamaConfig


class WeightsError(CupagedError, ValueError):
    """A weights file that :meth:`TinyDecoder.load` cannot use (the message says why)."""


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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if f.name == "rope_theta":
                if not (number and math.isfinite(value) and value > 0):
                    raise ValueError(f"expected {f.name} a finite number > 0, got {value!r}")
            elif not (number and isinstance(value, int) and value >= 1):
                raise ValueError(f"expected {f.name} an integer >= 1, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"expected num_q_heads a multiple of num_kv_heads={self.num_kv_heads}, got "
                f"{self.num_q_heads}"
            )
        if self.head_dim % 2:  # rotary positions turn pairs of elements
            raise ValueError(f"expected an even head_dim, got {self.head_dim}")

    @property
    def model_dim(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Elements of every weight together (the sum over :func:`weight_shapes`)."""
        d, kv = self.model_dim, self.num_kv_heads * self.head_dim
        per_layer = (
            2 * d + 2 * d * d + 2 * kv * d + 3 * self.hidden_size * d
        )  # norms, Q/O, K/V, FFN
        return self.vocab_size * d + d + self.num_layers * per_layer  # + embedding, final norm

    def llama(self) -> LlamaConfig:
        """The same shape as a :class:`~cupaged.models.LlamaConfig`."""
        return LlamaConfig(
            num_layers=self.num_layers,
            hidden=self.model_dim,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            ffn=self.hidden_size,
            vocab_size=self.vocab_size,
            rms_eps=1e-6,
            rope_base=self.rope_theta,
        )


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every weight, by the GGUF tensor name that :class:`Llama` reads
    (projections ``[out_features, in_features]``); nothing is allocated."""
    c = config
    d, kv_dim, ffn = c.model_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (c.vocab_size, d),
        "output_norm.weight": (d,),
    }
    for i in range(c.num_layers):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (d,),
            p + "ffn_norm.weight": (d,),
            p + "attn_q.weight": (d, d),  # the model dimension is num_q_heads * head_dim
            p + "attn_k.weight": (kv_dim, d),
            p + "attn_v.weight": (kv_dim, d),
            p + "attn_output.weight": (d, d),
            p + "ffn_gate.weight": (ffn, d),
            p + "ffn_up.weight": (ffn, d),
            p + "ffn_down.weight": (d, ffn),
        }
    return shapes


def random_weights(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights of :func:`weight_shapes`: the embedding standard normal,
    projections scaled by ``1 / sqrt(in_features)``, norms 1."""
    rng = np.random.default_rng(seed)
    ones = np.ones(config.model_dim, np.float32)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            weights[name] = ones
            continue
        w = rng.standard_normal(shape, dtype=np.float32)
        weights[name] = w if name == "token_embd.weight" else w / np.float32(np.sqrt(shape[1]))
    return weights


class TinyDecoder(Llama):
    """A :class:`~cupaged.models.Llama` of the demo's small shape with seeded random weights.

    Args:
        config: the model's shape.
        xp: ``numpy`` or ``cupy``.
        seed: seed of the random weights.
        dtype: the model's attention dtype; Q/K/V are rounded to it.
        kv_dtype: the KV cache's element type: ``dtype`` (``None``) or fp8.
        cascade: the decode plans' cascade (:class:`~cupaged.models.Llama`).
        weights: the weights (GGUF names, float32) instead of seeded random ones.

    Attributes:
        shape: ``config`` (``self.config`` is the :class:`~cupaged.models.LlamaConfig`).
        weights: the float32 host weights, by GGUF name (the head is tied to the embedding).
    """

    def __init__(
        self,
        config: ModelConfig,
        xp: Any,
        seed: int = 0,
        dtype: str = "float32",
        weights: dict[str, np.ndarray] | None = None,
        kv_dtype: str | None = None,
        cascade: bool | None = None,
    ) -> None:
        self.shape = config
        self.weights = dict(weights) if weights is not None else random_weights(config, seed)
        self.weights.pop("output.weight", None)
        tied = self.weights | {"output.weight": self.weights["token_embd.weight"]}
        super().__init__(config.llama(), tied, xp, dtype=dtype, kv_dtype=kv_dtype, cascade=cascade)

    def save(self, path: str | Path) -> None:
        """Write the weights and the config to a ``.npz`` file that :meth:`load` reads."""
        arrays = {name: to_numpy(w) for name, w in self.weights.items()}
        config = {
            f"config.{f.name}": np.asarray(getattr(self.shape, f.name)) for f in fields(ModelConfig)
        }
        np.savez(path, **arrays, **config)

    @classmethod
    def load(
        cls,
        path: str | Path,
        xp: Any,
        dtype: str = "float32",
        kv_dtype: str | None = None,
        cascade: bool | None = None,
    ) -> TinyDecoder:
        """Read a model written by :meth:`save` (the same architecture, any sizes).

        Every size is checked before anything is allocated: the config's values must be
        positive integers, and the weights they declare must be in the file, uncompressed (as
        :meth:`save` writes them), at those shapes. So loading asks for about the file's size in
        memory (twice it for float16 weights), never more.

        Raises:
            WeightsError: the file cannot be read (missing, a folder, not a zip, truncated), or
                it is not one that :meth:`save` writes (a config value that is not a positive
                integer, a weight missing, of another shape or compressed, more weights declared
                than the file holds).
        """
        path = Path(path)
        try:
            if path.exists() and not path.is_file():  # a FIFO would block the open
                raise ValueError("expected a regular file, got a folder or a device")
            with zipfile.ZipFile(path) as archive:
                npz = _Npz(archive, path.stat().st_size)
                config = npz.config()
                shapes = weight_shapes(config)
                missing = sorted(set(shapes) - set(npz.members))
                if missing:
                    raise ValueError(f"expected weights {missing} in the file, got none")
                weights = {name: npz.array(name, shape) for name, shape in shapes.items()}
        except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as error:
            raise WeightsError(f"weights {path}: {error}") from None
        return cls(config, xp, dtype=dtype, weights=weights, kv_dtype=kv_dtype, cascade=cascade)


class _Npz:
    """The arrays of an ``.npz`` file of ``size`` bytes, each header checked before its data is
    read.

    Raises:
        ValueError: from every method, what is wrong with the file.
    """

    def __init__(self, archive: zipfile.ZipFile, size: int) -> None:
        self.archive, self.size = archive, size
        self.members = {
            info.filename.removesuffix(".npy"): info
            for info in archive.infolist()
            if info.filename.endswith(".npy")
        }

    def config(self) -> ModelConfig:
        """The :class:`ModelConfig` saved with the weights, refused if the file cannot hold the
        weights it declares."""
        values = {}
        for f in fields(ModelConfig):
            name = f"config.{f.name}"
            if name not in self.members:
                raise ValueError(f"expected {name} in the file, got none")
            values[f.name] = self.array(name, (), kinds="iuf").item()
        config = ModelConfig(**values)
        if 2 * config.num_parameters > self.size:  # float16, the narrowest element it takes
            raise ValueError(
                f"expected the {config.num_parameters:,} weights that its config declares in the "
                f"file, got a file of {self.size:,} bytes"
            )
        return config

    def array(self, name: str, shape: tuple[int, ...], kinds: str = "f") -> np.ndarray:
        """Member ``name``, checked to be of ``shape`` and a dtype of ``kinds``, stored
        uncompressed within the file, before it is read; float32 when ``kinds`` is ``"f"``."""
        info = self.members[name]
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"expected {name} uncompressed (as save writes it), got it compressed")
        if info.header_offset + info.file_size > self.size:
            raise ValueError(f"expected {name} within the file, got a truncated file")
        with self.archive.open(info) as f:
            got, dtype, header = _npy_header(f)
            if got != shape:
                raise ValueError(f"expected {name} of shape {shape}, got {got}")
            if dtype.kind not in kinds:
                raise ValueError(f"expected {name} a number, got an array of dtype {dtype}")
            if header + math.prod(shape) * dtype.itemsize != info.file_size:
                raise ValueError(f"expected {name} of {shape} {dtype}, got another size")
            data = np.frombuffer(f.read(), dtype).reshape(shape)
        return data.astype(np.float32) if kinds == "f" else data


def _npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], np.dtype, int]:
    """``(shape, dtype, header bytes)`` of the ``.npy`` stream ``f``, leaving ``f`` at the data.

    Raises:
        ValueError: not an ``.npy`` header of version 1 or 2, or a Fortran-ordered array.
    """
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f"expected an .npy header of version 1.0 or 2.0, got {version}")
    if fortran:
        raise ValueError("expected C-ordered arrays, got a Fortran-ordered one")
    return tuple(shape), dtype, f.tell()
