"""What two transfer agents tell each other: the cache's layout, the request, the notifications.

Three kinds of bytes cross between processes; the application carries the first two (a file, a
socket, its RPC), NIXL the third:

- **metadata** (:func:`encode_metadata`): a JSON header describing the cache (:class:`CacheLayout`:
  layout, dtype, geometry, base addresses, fp8 scales), then the NIXL agent's own metadata;
- **request** (:func:`encode_request`): what the receiver reserved, and whether it reads the
  sender's blocks (``mode="read"``, pull) or the sender writes them (``"write"``, push);
- **notification** (:func:`ready_message`, :func:`done_message`, :func:`fail_message`,
  :func:`cancel_message`): a short line naming the transfer, sent through NIXL: pull, the
  sender's offer of its block ids ("ready") and the receiver's "done" once its read completed;
  push, the sender's "done" once its writes completed.

Everything read from a peer is checked here before it is used; a bad field raises
:class:`TransferError` naming what was expected and what arrived. Nothing here needs NIXL.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._util import cdiv
from ..errors import CupagedError

METADATA_MAGIC = b"cupaged-kv-metadata/1\n"
REQUEST_MAGIC = b"cupaged-kv-request/1\n"
NOTIF_PREFIX = b"cupaged-kv/1 "
LAYOUT = "[num_layers, num_blocks, num_kv_heads, block_size, head_dim]"  # HND, layers outermost
_MAX_HEADER = 1 << 20  # a metadata header of more than this is not one of ours
MODES = ("read", "write")  # pull: the receiver READs the sender's blocks; push: the sender WRITEs


class TransferError(CupagedError):
    """A KV transfer that could not start or did not complete; the message is one line that says
    what failed and what was done about it (the reserved blocks freed, nothing moved)."""


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer moved.

    Attributes:
        blocks_moved: blocks written into the receiving cache (each holds every layer's K and V).
        blocks_cached: prompt blocks the receiver held already (prefix caching): not moved.
        bytes_moved: K and V bytes of every layer of the moved blocks.
        seconds: wall time of the transfer (the sender: post to completion; the receiver:
            :meth:`~cupaged.transfer.KVTransferAgent.expect` to commit).
        descriptors: NIXL descriptors of the transfer: one per run of consecutive block ids (on
            both sides) per layer per K/V.
    """

    blocks_moved: int
    blocks_cached: int
    bytes_moved: int
    seconds: float
    descriptors: int

    @property
    def gbps(self) -> float:
        """Decimal GB/s: ``bytes_moved`` (K and V payload only, no descriptors or notifications)
        over ``seconds``."""
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What a peer must know of a cache to write into it, and to agree that the bytes mean the same.

    Block ``b`` of layer ``l`` of K starts at ``k_addr + (l * num_blocks + b) * block_bytes``
    (``LAYOUT``: layers outermost, then blocks), and a run of ``r`` consecutive blocks is one
    contiguous range of ``r * block_bytes`` bytes; the same for V.
    """

    name: str
    layout: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    num_blocks: int
    block_bytes: int
    memory: str  # "DRAM" or "VRAM"
    device_id: int
    k_addr: int
    v_addr: int
    k_scales: list[list[float]] | None  # fp8: [num_layers][num_kv_heads]; None: not fp8
    v_scales: list[list[float]] | None

    def mismatch(self, other: CacheLayout) -> str | None:
        """The first field in which ``other``'s cache cannot exchange blocks with this one, as
        "expected X, got Y" (``None`` when they can). The pool sizes, addresses and memory kinds
        may differ; the bytes of a block must mean the same on both sides."""
        for field in ("layout", "dtype", "block_size", "num_kv_heads", "head_dim", "num_layers"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return (
                    f"expected {field} {mine!r} (this cache), got {theirs!r} (peer {other.name!r})"
                )
        if self.k_scales is None or other.k_scales is None:  # not fp8, or "auto" still pending:
            return None  # compared again by the sender, once both are fixed
        return scales_mismatch(self.k_scales, self.v_scales, other.k_scales, other.v_scales)


def scales_mismatch(k_mine: Any, v_mine: Any, k_theirs: Any, v_theirs: Any) -> str | None:
    """Why fp8 scales (nested lists, or ``None`` for pending / not fp8) cannot be shared: the K/V
    bytes moved were quantized with the sender's scales and will be read with the receiver's,
    so the two must be equal (``None``: they can)."""
    if (k_mine, v_mine) == (k_theirs, v_theirs):
        return None
    if k_mine is None or k_theirs is None:
        side = "this cache's" if k_mine is None else "the peer's"
        return f'expected fixed fp8 scales on both caches, got {side} "auto" scales still pending'
    return (
        f"expected the peer's fp8 scales equal to this cache's (k {k_mine}, v {v_mine}), got "
        f"k {k_theirs}, v {v_theirs}: set the same scales on both caches (set_kv_scales)"
    )


# ---------------------------------------------------------------------------------- metadata


def encode_metadata(layout: CacheLayout, agent_metadata: bytes) -> bytes:
    header = json.dumps(asdict(layout), separators=(",", ":")).encode()
    return METADATA_MAGIC + struct.pack("<I", len(header)) + header + agent_metadata


def decode_metadata(data: Any) -> tuple[CacheLayout, bytes]:
    """``(layout, NIXL agent metadata)`` from a peer's :func:`encode_metadata` bytes.

    Raises:
        TransferError: not such bytes, or a field of the wrong type or out of range.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TransferError(f"bad peer metadata: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    start = len(METADATA_MAGIC) + 4
    if not data.startswith(METADATA_MAGIC) or len(data) < start:
        raise TransferError(
            f"bad peer metadata: expected bytes starting {METADATA_MAGIC!r} (KVTransferAgent."
            f"metadata()), got {data[:24]!r}... ({len(data)} bytes)"
        )
    (size,) = struct.unpack("<I", data[len(METADATA_MAGIC) : start])
    if size > _MAX_HEADER or start + size > len(data):
        raise TransferError(
            f"bad peer metadata: expected a header of at most {len(data) - start} bytes, got a "
            f"length of {size}"
        )
    fields = _json(data[start : start + size], "peer metadata")
    layout = _layout(fields)
    nixl_metadata = data[start + size :]
    if not nixl_metadata:
        raise TransferError("bad peer metadata: expected the NIXL agent's metadata, got none")
    return layout, nixl_metadata


def _layout(fields: dict[str, Any]) -> CacheLayout:
    ints = ("num_layers", "num_kv_heads", "block_size", "head_dim", "num_blocks", "block_bytes")
    spec = {
        "name": str,
        "layout": str,
        "dtype": str,
        "memory": str,
        **dict.fromkeys(ints, int),
        "device_id": int,
        "k_addr": int,
        "v_addr": int,
    }
    values: dict[str, Any] = {}
    for key, kind in spec.items():
        value = fields.get(key)
        if type(value) is not kind or (kind is int and value < (1 if key in ints else 0)):
            raise TransferError(
                f"bad peer metadata: expected {key} a {'positive ' if key in ints else ''}"
                f"{kind.__name__}, got {value!r}"
            )
        values[key] = value
    if values["memory"] not in ("DRAM", "VRAM"):
        raise TransferError(
            f"bad peer metadata: expected memory DRAM or VRAM, got {values['memory']!r}"
        )
    shape = (values["num_layers"], values["num_kv_heads"])
    for key in ("k_scales", "v_scales"):
        values[key] = _scales(fields.get(key), shape, key)
    return CacheLayout(**values)


def _scales(value: Any, shape: tuple[int, int], what: str) -> list[list[float]] | None:
    if value is None:
        return None
    try:
        array = np.asarray(value, np.float64)
    except (TypeError, ValueError):
        array = None
    if array is None or array.shape != shape or not np.isfinite(array).all() or (array <= 0).any():
        raise TransferError(
            f"bad peer metadata: expected {what} [num_layers, num_kv_heads] = {list(shape)} "
            f"positive finite numbers or null, got {str(value)[:80]}"
        )
    return array.tolist()


# ---------------------------------------------------------------------------------- request


@dataclass(frozen=True, slots=True)
class Request:
    """What the receiver reserved: fill ``blocks`` (its ids, in order) with logical blocks
    ``first_block ..`` of the sender's sequence, which covers ``num_tokens`` prompt tokens::

        receiver's sequence   [cached][cached][ moved ][ moved ][moved, partly filled]
        logical block            0       1        2        3        4
                                                  ^ first_block = 2, blocks = 3 ids

    Attributes:
        transfer_id: names this transfer in the notifications.
        receiver: the receiving agent's name (the sender must be connected to it).
        sender: the agent that must fill the blocks.
        first_block: prompt blocks the receiver held already (prefix caching).
        num_tokens: the prompt's length.
        blocks: the receiver's block ids to fill, ``cdiv(num_tokens, block_size) - first_block``.
        k_scales, v_scales: the receiver's fp8 scales (``None``: not fp8).
        mode: ``"read"``: the sender offers its blocks and the receiver reads them (pull);
            ``"write"``: the sender writes them into ``blocks`` (push).
    """

    transfer_id: str
    receiver: str
    sender: str
    first_block: int
    num_tokens: int
    blocks: list[int]
    k_scales: list[list[float]] | None = None
    v_scales: list[list[float]] | None = None
    mode: str = "read"

    def digest(self) -> str:
        """A short hash of what is to be moved where, and how: the notifications carry it, so
        neither side acts on a notification of another request under the same id."""
        text = f"{self.transfer_id}:{self.mode}:{self.first_block}:{self.num_tokens}:{self.blocks}"
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def encode_request(request: Request) -> bytes:
    return REQUEST_MAGIC + json.dumps(asdict(request), separators=(",", ":")).encode()


def decode_request(data: Any, block_size: int, num_blocks: int) -> Request:
    """A :class:`Request` from :func:`encode_request` bytes, checked against the receiving cache
    (``block_size``, ``num_blocks``, from its metadata).

    Raises:
        TransferError: not such bytes, or fields that do not describe a valid request.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TransferError(f"bad request: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(REQUEST_MAGIC):
        raise TransferError(
            f"bad request: expected bytes starting {REQUEST_MAGIC!r} (Incoming.request), got "
            f"{data[:24]!r}... ({len(data)} bytes)"
        )
    fields = _json(data[len(REQUEST_MAGIC) :], "request")
    for key in ("transfer_id", "receiver", "sender"):
        if type(fields.get(key)) is not str or not fields[key]:
            raise TransferError(
                f"bad request: expected {key} a non-empty str, got {fields.get(key)!r}"
            )
    if fields.get("mode") not in MODES:
        raise TransferError(
            f"bad request: expected mode one of {MODES}, got {fields.get('mode')!r}"
        )
    first, n = fields.get("first_block"), fields.get("num_tokens")
    if type(first) is not int or type(n) is not int or first < 0 or n < 1:
        raise TransferError(
            f"bad request: expected first_block >= 0 and num_tokens >= 1 (ints), got {first!r} "
            f"and {n!r}"
        )
    blocks = fields.get("blocks")
    needed = cdiv(n, block_size) - first
    if (
        not isinstance(blocks, list)
        or len(blocks) != needed
        or not all(type(b) is int and 0 <= b < num_blocks for b in blocks)
        or len(set(blocks)) != len(blocks)
    ):
        raise TransferError(
            f"bad request: expected {needed} distinct block ids in 0 .. {num_blocks - 1} "
            f"({n} tokens from block {first}), got {str(blocks)[:80]}"
        )
    return Request(
        fields["transfer_id"],
        fields["receiver"],
        fields["sender"],
        first,
        n,
        blocks,
        fields.get("k_scales"),
        fields.get("v_scales"),
        fields["mode"],
    )


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        fields = json.loads(data)
    except (UnicodeDecodeError, ValueError) as error:
        raise TransferError(f"bad {what}: expected JSON, got {data[:24]!r}... ({error})") from None
    if not isinstance(fields, dict):
        raise TransferError(f"bad {what}: expected a JSON object, got {type(fields).__name__}")
    return fields


# ---------------------------------------------------------------------------------- notifications


def done_message(
    transfer_id: str, digest: str, blocks: int, nbytes: int, descriptors: int
) -> bytes:
    """Push: the sender's writes are complete. Pull: the receiver's read is, the sender may let
    its blocks go. ``digest`` is the request's :meth:`Request.digest`."""
    text = f"done {transfer_id} {digest} {blocks} {nbytes} {descriptors}"
    return NOTIF_PREFIX + text.encode()


def ready_message(request: Request, blocks: np.ndarray, hold: float) -> bytes:
    """Pull: the sender offers ``blocks`` (its ids of the request's logical blocks, in order) and
    keeps them unchanged for ``hold`` seconds from now, or until the receiver's "done"."""
    text = f"ready {request.transfer_id} {request.digest()} {int(hold * 1000)} {encode_ids(blocks)}"
    return NOTIF_PREFIX + text.encode()


def parse_ready(rest: str, digest: str, count: int, num_blocks: int) -> tuple[np.ndarray, float]:
    """``(the sender's block ids [count] int64, its hold in seconds)`` from the rest of a "ready"
    line, checked: the request's digest, ``count`` distinct ids in ``0 .. num_blocks - 1`` (the
    sender's pool).

    Raises:
        TransferError: anything else.
    """
    words = rest.split(" ")
    ids = None
    if len(words) == 3 and words[0] == digest and words[1].isdigit():
        ids = decode_ids(words[2], count)
    if (
        ids is None
        or ids.size != count
        or (ids.size and (ids.min() < 0 or ids.max() >= num_blocks))
        or np.unique(ids).size != ids.size
    ):
        raise TransferError(
            f"bad offer: expected digest {digest} and {count} distinct block ids in 0 .. "
            f"{num_blocks - 1}, got {rest[:80]!r}"
        )
    return ids, int(words[1]) / 1000


def encode_ids(ids: np.ndarray) -> str:
    """Block ids as runs: ``[4, 5, 6, 9]`` -> ``"4-6,9"`` (a fresh pool's ids are one run)."""
    ids = np.asarray(ids, np.int64)
    if ids.size == 0:
        return "-"
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    return ",".join(f"{r[0]}-{r[-1]}" if r.size > 1 else f"{r[0]}" for r in np.split(ids, breaks))


def decode_ids(text: str, limit: int) -> np.ndarray | None:
    """The ids of :func:`encode_ids`'s text; ``None`` for text that is not such, or of more
    than ``limit`` ids (a peer's text never makes a large array)."""
    if text == "-":
        return np.zeros(0, np.int64)
    parts, total = [], 0
    for run in text.split(","):
        first, _, last = run.partition("-")
        if not first.isdigit() or not (last.isdigit() or last == ""):
            return None
        lo, hi = int(first), int(last or first)
        total += hi - lo + 1
        if hi < lo or total > limit:
            return None
        parts.append(np.arange(lo, hi + 1, dtype=np.int64))
    return np.concatenate(parts)


def fail_message(transfer_id: str, reason: str) -> bytes:
    return NOTIF_PREFIX + f"fail {transfer_id} {' '.join(reason.split())[:400]}".encode()


def cancel_message(transfer_id: str) -> bytes:
    return NOTIF_PREFIX + f"cancel {transfer_id}".encode()


def parse_message(message: bytes) -> tuple[str, str, str] | None:
    """``(kind, transfer_id, rest of the line)`` of one of our notifications; ``None`` for
    anything else (another library's notification on the same agent is not ours to read)."""
    if not isinstance(message, bytes) or not message.startswith(NOTIF_PREFIX):
        return None
    words = message[len(NOTIF_PREFIX) :].decode(errors="replace").split(" ", 2)
    if len(words) < 2 or words[0] not in ("ready", "done", "fail", "cancel"):
        return None
    return words[0], words[1], words[2] if len(words) > 2 else ""
