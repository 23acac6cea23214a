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
        """Tensor ``name`` as float32, in NumPy order (``[out, in]`` for a projection)."""
        from gguf.quants import dequantize

        t = self._tensor(name)
        values = dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise CupagedError(
                f"expected tensor {name!r} in {self.path.name}, got none "
                f"({len(self._tensors)} tensors)"
            ) from None
