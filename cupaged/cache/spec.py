"""Memory arithmetic of a KV cache, to size ``num_blocks`` before creating one.

Every token stores one key and one value vector per layer and KV head::

    bytes_per_token = 2 (K and V) * num_layers * num_kv_heads * head_dim * itemsize

A 32-layer GQA model with 8 KV heads, head_dim 128, in float16 needs 131,072 bytes per token, so a
contiguous reservation of 4,096 tokens costs 512 MiB per sequence whatever its real length. Paged,
a sequence of ``n`` tokens holds ``ceil(n / block_size)`` blocks: at most ``block_size - 1`` slots
are wasted.

Under a sliding window (``PagedCache(..., window_left=W)``, docs/variants.md) a sequence keeps only
the blocks its next queries can see. After a one-token (decode) step to ``n`` tokens, the query at
``n - 1`` sees positions ``n - 1 - W .. n - 1``, and every block before the one holding
``n - 1 - W`` has been released::

    held = (n - 1) // block_size - max(0, n - 1 - W) // block_size + 1     (n >= 1)
         <= min(ceil(n / block_size), ceil((W + 1) / block_size) + 1)

    block_size 4, W = 5, n = 11: the last query (position 10) sees positions 5 .. 10
    block  0: [0 1 2 3]   1: [4 5 6 7]   2: [8 9 10 .]
              released       held           held          -> 2 blocks
    n = 9 sees 3 .. 8: blocks 0, 1, 2 -> 3 = ceil((5 + 1) / 4) + 1, the most at any length
"""

from __future__ import annotations

from dataclasses import dataclass

from .._arrays.checks import as_int
from .._util import cdiv
from ..dtypes import dtype_name, itemsize
from ..variants import check_window_left


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Shape and element type of a paged KV cache, with its memory arithmetic.

    Example:
        >>> spec = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
        >>> spec.bytes_per_token, spec.contiguous_bytes(4096) // 2**20
        (131072, 512)
        >>> spec.blocks_for(4096), spec.blocks_for(200)
        (256, 13)
        >>> spec.blocks_for(32768, window_left=4095), spec.max_blocks_in_window(4095)
        (256, 257)
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_size: int = 16

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = as_int(getattr(self, field), field)
            if value < 1:
                raise ValueError(f"expected {field} >= 1, got {value}")
            object.__setattr__(self, field, value)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def itemsize(self) -> int:
        """Bytes per element (2 for float16 and bfloat16, 4 for float32, 1 for fp8)."""
        return itemsize(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V that one token occupies, over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (``block_size`` tokens) over all layers, K and V."""
        return self.bytes_per_token * self.block_size

    def blocks_for(self, num_tokens: int, window_left: int = -1) -> int:
        """Blocks a sequence of ``num_tokens`` tokens occupies: ``ceil(num_tokens / block_size)``.

        With ``window_left=W >= 0`` (a sliding-window cache): the blocks it still holds after a
        one-token step to ``num_tokens`` tokens, those of positions ``num_tokens - 1 - W ..
        num_tokens - 1`` (the module docstring has the picture). A step of many tokens from
        ``n0`` keeps positions from ``n0 - W`` on, so more until the next decode step.
        """
        num_tokens = _non_negative(num_tokens, "num_tokens")
        window = check_window_left(window_left)
        if window < 0 or num_tokens == 0:
            return cdiv(num_tokens, self.block_size)
        last = num_tokens - 1
        return last // self.block_size - max(0, last - window) // self.block_size + 1

    def max_blocks_in_window(self, window_left: int) -> int:
        """The most blocks a sequence of a sliding-window cache holds after a one-token step,
        whatever its length: ``ceil((window_left + 1) / block_size) + 1``, the bound a scheduler
        reserves per sequence (an upper bound of :meth:`blocks_for` at every length)."""
        window = check_window_left(window_left)
        if window < 0:
            raise ValueError(f"expected window_left >= 0 (a window), got {window}")
        return cdiv(window + 1, self.block_size) + 1

    def paged_bytes(self, num_tokens: int, window_left: int = -1) -> int:
        """Bytes a sequence of ``num_tokens`` tokens holds in a paged cache (whole blocks); with
        ``window_left``, in a sliding-window cache after a one-token step (:meth:`blocks_for`)."""
        return self.blocks_for(num_tokens, window_left) * self.bytes_per_block

    def contiguous_bytes(self, max_len: int) -> int:
        """Bytes a contiguous max-length reservation of ``max_len`` tokens needs per sequence."""
        return _non_negative(max_len, "max_len") * self.bytes_per_token

    def paged_waste(self, num_tokens: int) -> float:
        """Fraction of a paged sequence's bytes that holds no token (the last block's free slots)."""
        held = self.paged_bytes(num_tokens)
        return 0.0 if held == 0 else 1.0 - num_tokens * self.bytes_per_token / held

    def num_blocks_for_memory(self, nbytes: int) -> int:
        """How many whole blocks fit in ``nbytes`` bytes of device memory."""
        return _non_negative(nbytes, "nbytes") // self.bytes_per_block


def _non_negative(value: int, what: str) -> int:
    value = as_int(value, what)
    if value < 0:
        raise ValueError(f"expected {what} >= 0, got {value}")
    return value
