"""The per-layer K/V scales of an fp8 cache (docs/fp8.md), owned by :class:`~cupaged.PagedCache`.

An fp8 cache stores ``fp8(x / scale)`` and is read as ``fp8 * scale``. Each layer has a scale for
K and one for V, per KV head: two float32 ``[num_layers, num_kv_heads]`` arrays on the cache's
device (a number or a ``[num_layers]`` array is spread over the heads). Row ``layer`` is what
``write_kv`` and the plans' ``run`` take as ``k_scale`` / ``v_scale``: a device array the kernel
reads, so a step never waits on it.

``"auto"`` calibrates: a layer's scales stay pending until the first write into that layer,
which fixes them from the K/V it writes, per KV head, before they are quantized::

    scale[layer, head] = amax(|x[:, head, :]|) / fp8_max      (1.0 where amax is 0 or not finite)

so that the largest value of that first write maps to the format's largest (448 for e4m3).
Later tokens larger than that saturate: the scales are fixed once set, as the bytes already
written are read with them. A pending layer's scales are a placeholder (1.0) that calibration
overwrites in place, so they are never handed out for a write: :meth:`KVScales.options` with
``write=True`` refuses a pending layer (calibrate first: :meth:`KVScales.calibrate`, which
``PagedCache.append`` and ``PagedCache.calibrate_kv_scales`` call), lest bytes quantized with
1.0 be read with the scales calibrated later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..attention.scales import scale_value
from ..backend import array_module
from ..dtypes import Q_DTYPE_NAMES, array_dtype_name, fp8_max, is_fp8, to_float
from ..errors import CupagedError

AUTO = "auto"


class KVScales:
    """The K and V scales of every layer of one cache.

    Args:
        xp: the cache's array module (NumPy or CuPy).
        elem: the cache's element type (canonical name).
        num_layers, num_kv_heads: the cache's shape.

    Attributes:
        k, v: float32 ``[num_layers, num_kv_heads]`` on the cache's device; ``None`` for a
            cache that is not fp8.

    Example:
        >>> import numpy as np
        >>> scales = KVScales(np, "float8_e4m3", num_layers=2, num_kv_heads=1)
        >>> scales.set(2.0, np.array([1.0, 0.5], np.float32))
        >>> scales.k.tolist(), scales.v.tolist()
        ([[2.0], [2.0]], [[1.0], [0.5]])
        >>> scales.set(AUTO, AUTO)
        >>> k, v = np.full((3, 1, 64), -896.0, np.float32), np.full((3, 1, 64), 112.0, np.float32)
        >>> scales.calibrate(0, k, v)                 # amax / 448, per KV head
        >>> float(scales.k[0, 0]), float(scales.v[0, 0]), scales.pending(0), scales.pending(1)
        (2.0, 0.25, False, True)
    """

    def __init__(self, xp: Any, elem: str, num_layers: int, num_kv_heads: int) -> None:
        self.xp, self.elem = xp, elem
        self.shape = (num_layers, num_kv_heads)
        self.k = self.v = None
        self._pending = np.zeros((2, num_layers), bool)  # [K or V, layer]: calibrated at a write
        if is_fp8(elem):
            self.k = xp.ones(self.shape, np.float32)
            self.v = xp.ones(self.shape, np.float32)

    @property
    def fp8(self) -> bool:
        """Whether the cache is fp8 (only then are there scales)."""
        return self.k is not None

    def pending(self, layer: int) -> bool:
        """Whether K or V of ``layer`` awaits its calibrating first write.

        Raises:
            ValueError, TypeError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        return bool(self._pending[:, self._checked_layer(layer)].any())

    def layer(self, layer: int) -> tuple[Any, Any]:
        """``(k_scale, v_scale)`` of ``layer``: ``[num_kv_heads]`` float32 device arrays (views,
        which a pending layer's calibration fills in), or ``(None, None)`` for a cache that is
        not fp8 (what the kernels' calls take then).

        Raises:
            ValueError, TypeError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        layer = self._checked_layer(layer)
        if self.k is None:
            return None, None
        return self.k[layer], self.v[layer]

    def options(self, layer: int, write: bool = False) -> dict[str, Any]:
        """The keywords of ``layer``'s scales: ``{}`` for a cache that is not fp8, else
        ``k_scale`` and ``v_scale`` (a plan's ``run``), and with ``write`` also ``kv_dtype``
        (``write_kv``, whose ``uint8`` cache on a GPU cannot say which fp8 it holds).

        Raises:
            CupagedError: ``write`` for a layer whose ``"auto"`` scales are still pending: K/V
                written with the placeholder would be read with the scales calibrated later.
                :meth:`calibrate` (``PagedCache.calibrate_kv_scales``) with the K/V to be
                written fixes them first.
            ValueError, TypeError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        layer = self._checked_layer(layer)
        if self.k is None:
            return {}
        if write and self._pending[:, layer].any():
            raise CupagedError(
                f'expected layer {layer}\'s "auto" scales calibrated before a write, got them '
                f"pending (K/V written now would be quantized with a placeholder 1.0 and read "
                f"with the scales calibrated later): call cache.calibrate_kv_scales({layer}, k, "
                f"v) with the K/V about to be written first, as cache.append does"
            )
        options = {"k_scale": self.k[layer], "v_scale": self.v[layer]}
        if write:
            options["kv_dtype"] = self.elem
        return options

    def set(self, k_scales: Any, v_scales: Any, record: Callable[..., None] | None = None) -> None:
        """Replace every layer's scales (the cache checks first that no K/V is held).

        Args:
            k_scales, v_scales: each ``None`` (1.0), a positive finite number, ``"auto"``, or a
                ``[num_layers]`` or ``[num_layers, num_kv_heads]`` array (NumPy or the cache's
                device) of positive finite values; copied.

        Raises:
            ValueError: scales for a cache that is not fp8 (they would do nothing), a value that
                is not positive and finite, an array of another shape. TypeError: neither a
                number, ``"auto"`` nor an array. Nothing changes then.

        ``record``: the undo recorder of the call this runs in (the cache's transaction), if any.
        """
        if self.k is None:
            if k_scales is None and v_scales is None:
                return
            raise ValueError(
                f"expected no k_scales / v_scales for a {self.elem} cache (scales apply to fp8 "
                f"caches only), got k_scales={_shown(k_scales)}, v_scales={_shown(v_scales)}"
            )
        k, k_auto = self._checked(k_scales, "k_scales")
        v, v_auto = self._checked(v_scales, "v_scales")
        if record is not None:
            record(self._restore_all, self.k, self.v, self._pending.copy())
        self.k, self.v = k, v
        self._pending[0], self._pending[1] = k_auto, v_auto

    def calibrate(
        self, layer: int, k: Any, v: Any, record: Callable[..., None] | None = None
    ) -> None:
        """Fix the pending scales of ``layer`` from the K/V about to be written there.

        Args:
            layer: the layer, in ``[0, num_layers)``.
            k, v: ``[n_tokens, num_kv_heads, head_dim]`` float32, float16 or bfloat16 arrays on
                the cache's device (a bfloat16 one as ``uint16`` bits); ``n_tokens == 0``
                leaves the scales pending.
            record: the undo recorder of the call this runs in (the cache's transaction), if any.

        Raises:
            ValueError, TypeError: ``layer`` out of range; for a pending layer, what
                :meth:`check` refuses. Nothing changes then.
        """
        if not self.pending(layer):  # (the K/V are not read then: PagedCache.append checked them)
            return
        self.check(layer, k, v)
        if int(k.shape[0]) == 0:
            return
        if record is not None:
            record(self._restore, layer, self.k[layer].copy(), self.v[layer].copy(),
                   self._pending[:, layer].copy())  # fmt: skip
        for which, (x, scales) in enumerate(((k, self.k), (v, self.v))):
            if self._pending[which, layer]:
                scales[layer] = self._from_amax(x)
                self._pending[which, layer] = False

    def check(self, layer: int, k: Any, v: Any) -> None:
        """Check the arguments of :meth:`calibrate` (the K/V about to be written to ``layer``).

        Raises:
            ValueError: ``layer`` out of ``[0, num_layers)`` (negative ones too: no counting
                from the end), K or V not ``[n_tokens, num_kv_heads, head_dim]`` with the
                cache's ``num_kv_heads``.
            TypeError: ``layer`` not an int; K or V not an array of the cache's array module,
                or of another dtype than float32, float16 or bfloat16.
        """
        self._checked_layer(layer)
        heads = self.shape[1]
        for name, x in (("k", k), ("v", v)):
            try:
                module = array_module(x)
            except TypeError:  # not an array
                module = None
            if module is not self.xp:
                raise TypeError(
                    f"expected {name} a {self.xp.__name__} array (the cache's device), got "
                    f"{type(x).__module__}.{type(x).__name__}"
                )
            shape = tuple(x.shape)
            if len(shape) != 3 or shape[1] != heads:
                raise ValueError(
                    f"expected {name} of shape (n_tokens, num_kv_heads={heads}, head_dim), got "
                    f"{shape}"
                )
            try:
                elem = array_dtype_name(x)
            except TypeError:  # none of the element types
                elem = None
            if elem not in Q_DTYPE_NAMES:
                raise TypeError(
                    f"expected {name} of dtype float32, float16 or bfloat16 (what write_kv "
                    f"quantizes), got {x.dtype}"
                )

    def check_invariants(self) -> None:
        """Every scale positive and finite, float32 of the cache's shape (one read back)."""
        if self.k is None:
            return
        for name, scales in (("k", self.k), ("v", self.v)):
            if scales.shape != self.shape or scales.dtype != np.float32:
                raise AssertionError(f"{name} scales of shape {self.shape} float32 expected")
            if not bool(self.xp.all(self.xp.isfinite(scales) & (scales > 0))):
                raise AssertionError(f"{name} scales positive and finite expected")

    # ----------------------------------------------------------------------------- internals

    def _checked_layer(self, layer: Any) -> int:
        """``layer`` as an index of the scales' rows, refused unless in ``[0, num_layers)``:
        a negative one would silently be a layer counted from the end."""
        if type(layer) is not int:
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
                raise TypeError(f"expected layer an int, got {type(layer).__name__}")
            layer = int(layer)
        if not 0 <= layer < self.shape[0]:
            raise ValueError(f"expected layer in [0, num_layers={self.shape[0]}), got {layer}")
        return layer

    def _restore_all(self, k: Any, v: Any, pending: np.ndarray) -> None:
        self.k, self.v = k, v
        self._pending[...] = pending

    def _restore(self, layer: int, k_row: Any, v_row: Any, pending: np.ndarray) -> None:
        self.k[layer], self.v[layer] = k_row, v_row
        self._pending[:, layer] = pending

    def _from_amax(self, x: Any) -> Any:
        """``amax / fp8_max`` per KV head of ``[n, heads, head_dim]`` ``x``, on its device; 1.0
        for a head whose amax is zero or not finite."""
        xp = self.xp
        amax = xp.max(xp.abs(to_float(x)), axis=(0, 2))
        scale = (amax / np.float32(fp8_max(self.elem))).astype(np.float32)
        return xp.where(xp.isfinite(scale) & (scale > 0), scale, np.float32(1.0))

    def _checked(self, scales: Any, what: str) -> tuple[Any, bool]:
        """``(the [num_layers, num_kv_heads] float32 device array, whether it is "auto")``."""
        xp = self.xp
        if scales is None or (isinstance(scales, str) and scales == AUTO):
            return xp.ones(self.shape, np.float32), scales is not None
        if isinstance(scales, str):
            raise TypeError(f"expected {what} a number, an array or {AUTO!r}, got {scales!r}")
        if not hasattr(scales, "shape") or isinstance(scales, np.generic):
            value = scale_value(scales, what)  # a number: checked on the host
            return xp.full(self.shape, value, np.float32), False
        host = np.asarray(scales if isinstance(scales, np.ndarray) else _to_host(scales))
        if host.dtype.kind not in "fiu" or host.dtype == np.bool_:
            raise TypeError(f"expected {what} of a float dtype, got {host.dtype}")
        if host.shape not in ((self.shape[0],), self.shape):
            raise ValueError(
                f"expected {what} of shape (num_layers={self.shape[0]},) or (num_layers, "
                f"num_kv_heads)={self.shape}, got {host.shape}"
            )
        values = host.astype(np.float32)
        if not (np.isfinite(values).all() and (values > 0).all()):
            raise ValueError(
                f"expected {what} positive and finite (in float32), got "
                f"{host.reshape(-1)[~(np.isfinite(values) & (values > 0)).reshape(-1)][:3]}"
            )
        spread = np.broadcast_to(values.reshape(self.shape[0], -1), self.shape)
        return xp.asarray(np.ascontiguousarray(spread)), False


def _to_host(x: Any) -> np.ndarray:
    """A device array's values on the host (a CuPy array's ``get``)."""
    get = getattr(x, "get", None)
    if get is None:
        raise TypeError(f"expected a NumPy or CuPy array of scales, got {type(x).__name__}")
    return get()


def _shown(x: Any) -> str:
    if x is None or isinstance(x, (int, float, str)):
        return repr(x)
    return f"{type(x).__module__}.{type(x).__name__}"
