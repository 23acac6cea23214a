"""Reading a GGUF file: its metadata and its tensors, dequantized to float32.

Built on the ``gguf`` package (llama.cpp's own reader). Tensors come back in NumPy order: a
matrix that GGUF describes as ``[ne0, ne1]`` (``ne0`` the contiguous axis) is an array of shape
``(ne1, ne0)``, so a projection weight is ``[out_features, in_features]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CupagedError

# The storage types of float weights that ``gguf.quants.dequantize`` reads (the types llama.cpp's
# converters write for a Llama). Integer tensors (I8 ... I64), F64 and the IQ formats are refused.
FLOAT_TYPES = (
    *("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
)


class GGUFFile:
    """The metadata and tensors of one GGUF file (memory-mapped; nothing is read up front).

    Args:
        path: the ``.gguf`` file.

    Raises:
        CupagedError: the file is not a readable GGUF file.
    """

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as error:
            raise CupagedError(f"not a readable GGUF file: {self.path}: {error}") from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The storage type of a tensor: ``"Q4_1"``, ``"Q8_0"``, ``"F32"``, ..."""
        return self._tensor(name).tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape of a tensor in NumPy order, from the file's header (no data is read)."""
        return tuple(int(n) for n in reversed(self._tensor(name).shape.tolist()))

    def check_tensor(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse tensor ``name`` unless it is there, of ``shape`` (NumPy order) and stored as one
        of :data:`FLOAT_TYPES`; reads the header only.

        Raises:
            CupagedError: the tensor is missing, or its shape or storage type is another.
        """
        found = self.tensor_shape(name)
        if found != tuple(shape):
            raise CupagedError(
                f"expected tensor {name!r} of shape {tuple(shape)} in {self.path.name}, got {found}"
            )
        self._check_type(name)

    def metadata(self, key: str, default: Any = None) -> Any:
        """One metadata value (a number, a string, or a list of them); ``default`` when absent."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        """A metadata value that must be there.

        Raises:
            CupagedError: the key is missing.
        """
        value = self.metadata(key)
        if value is None:
            raise CupagedError(f"expected metadata {key!r} in {self.path.name}, got none")
        return value

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32, in NumPy order (``[out, in]`` for a projection).

        Raises:
            CupagedError: the tensor is missing or not stored as one of :data:`FLOAT_TYPES`.
        """
        from gguf.quants import dequantize

        t = self._tensor(name)
        self._check_type(name)
        values = dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(values.reshape(self.tensor_shape(name)), dtype=np.float32)

    def _check_type(self, name: str) -> None:
        kind = self.tensor_type(name)
        if kind not in FLOAT_TYPES:
            raise CupagedError(
                f"expected tensor {name!r} in {self.path.name} stored as one of {FLOAT_TYPES}, "
                f"got {kind}"
            )

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise CupagedError(
                f"expected tensor {name!r} in {self.path.name}, got none "
                f"({len(self._tensors)} tensors)"
            ) from None
