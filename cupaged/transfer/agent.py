"""KVTransferAgent: a PagedCache's blocks moved to or from another process's cache over NIXL.

The protocol (docs/transfer.md), for one request moved from a prefill process P to a decode
process D, each with a cache and an agent::

    D: incoming = agent.expect(prompt, peer="P")   admit: cached prefix attached, the rest reserved
       ... ship incoming.request to P ...          (the reserved blocks are not in the prefix cache)
    P: agent.send(sid, request)                    WRITE exactly those blocks, every layer, then
                                                   notify D ("done", naming the transfer)
    D: agent.wait(incoming)                        on "done": commit (now prefix-matchable);
                                                   timeout / "fail": free the reservation

The receiver reserves, the sender writes, and a block becomes visible to prefix matching only
when the receiver commits it after the sender's completion notification: a half-written block is
never served. Metadata (:meth:`KVTransferAgent.metadata`) and requests are bytes the application
carries; NIXL carries the K/V and the notifications.

The NIXL agent runs without its progress thread (it would spin a core): the side that waits
polls, the sender while its writes complete, the receiver in :meth:`KVTransferAgent.wait`. A
receiver must be waiting (or polling) while its sender sends, or the sender may time out.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import is_fp8
from .blocks import cache_layout, cache_scales
from .wire import (
    CacheLayout,
    Request,
    TransferError,
    TransferStats,
    cancel_message,
    decode_metadata,
    decode_request,
    done_message,
    encode_metadata,
    encode_request,
    fail_message,
    parse_message,
)
from .writes import source_blocks, write_blocks

INSTALL = ".venv/bin/pip install --no-deps nixl nixl-cu12"  # (nixl-cu12's torch requirement: no)
_RECEIVER_POLL_S = 2e-4  # between notification polls: a waiting receiver leaves the core to others
_FLUSH_S = 0.25  # progress after a refusal's or a cancel's notification, so that it leaves


def nixl_available() -> bool:
    """True when ``import nixl._api`` works (the transfer layer's one optional dependency)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


def _nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as error:
        raise ImportError(
            f"cupaged.transfer needs NIXL: {INSTALL} (without its dependencies: nixl-cu12 "
            f"requires torch, a CUDA build of several GB; the host-memory path needs only NumPy) "
            f"({error})"
        ) from error
    return _api


@dataclass(slots=True)
class Incoming:
    """A request admitted by :meth:`KVTransferAgent.expect`, its blocks reserved, awaiting K/V.

    Attributes:
        sid: the receiving cache's new sequence (``seq_len`` = the prompt's length); do not step
            it before :meth:`KVTransferAgent.wait` returns (a step commits its blocks).
        request: the bytes the sender's :meth:`KVTransferAgent.send` takes.
        blocks_to_move: blocks the sender writes (every layer's K and V of each).
        blocks_cached: leading prompt blocks this cache held already (prefix caching): not moved.
        transfer_id: names the transfer in the notifications.
        peer: the sending agent's name.
        digest: what the sender's "done" notification must carry (a hash of the transfer id and
            the block ids): a notification for other blocks commits nothing.
        started: ``time.perf_counter()`` at :meth:`KVTransferAgent.expect`.
    """

    sid: int
    request: bytes
    blocks_to_move: int
    blocks_cached: int
    transfer_id: str
    peer: str
    digest: str = ""
    started: float = field(default_factory=time.perf_counter)


class KVTransferAgent:
    """A NIXL agent over one :class:`~cupaged.PagedCache`: sends its sequences' blocks, receives
    requests' blocks into it.

    ``cache.k`` and ``cache.v`` are registered once each (host memory, ``"DRAM"``, on the CPU
    backend; ``"VRAM"`` on a GPU). fp8 scales are per-layer constants of a cache, not per block:
    they are not moved but compared (at :meth:`connect` when both are fixed, and again at
    :meth:`send`), and a transfer between caches of different scales is refused.

    Args:
        cache: the :class:`~cupaged.PagedCache` (with ``enable_prefix_caching=True`` a receiver
            moves only the blocks it does not hold; without, every block of the prompt).
        name: this agent's name, unique among the agents that connect to it.
        backend: the NIXL backend (``"UCX"``).

    Example (two processes; ``ship`` is the application's channel)::

        decode = KVTransferAgent(cache, "decode-0")
        prefill_name = decode.connect(prefill_metadata)     # the peer's metadata(), shipped
        incoming = decode.expect(prompt_ids, peer=prefill_name)
        ship(incoming.request)                  # prefill side: agent.send(sid, request)
        stats = decode.wait(incoming, timeout=10.0)  # committed: incoming.sid holds the prompt
    """

    def __init__(self, cache: Any, name: str = "cupaged", *, backend: str = "UCX") -> None:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"expected a non-empty agent name without spaces, got {name!r}")
        api = _nixl()
        self.cache, self.name = cache, name
        self._layout = cache_layout(cache, name)  # (checks K and V are one array each)
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[backend])
        try:
            self._agent = api.nixl_agent(name, config)
            if backend not in self._agent.backends:
                raise TransferError(
                    f"expected NIXL backend {backend!r}, got only {list(self._agent.backends)}"
                )
            rows = [
                (self._layout.k_addr, int(cache.k.nbytes), self._layout.device_id, ""),
                (self._layout.v_addr, int(cache.v.nbytes), self._layout.device_id, ""),
            ]
            self._registered = self._agent.register_memory(rows, self._layout.memory)
        except TransferError:
            raise
        except Exception as error:  # noqa: BLE001  (NIXL raises its bindings' own types)
            raise TransferError(f"NIXL agent {name!r} could not start: {error}") from error
        self._peers: dict[str, CacheLayout] = {}
        self._waiting: dict[str, Incoming] = {}  # transfer id -> reserved, not yet committed
        self._inbox: dict[str, tuple[str, str, str]] = {}  # transfer id -> (peer, kind, rest)
        self._cancelled: deque[str] = deque(maxlen=4096)  # transfers the receivers gave up
        self._closed = False

    # ----------------------------------------------------------------------------- peers

    def metadata(self) -> bytes:
        """This agent's NIXL metadata and its cache's layout, as bytes for the application to
        ship to its peers (:meth:`connect`)."""
        self._check_open()
        self._layout = cache_layout(self.cache, self.name)  # (scales fixed since, if fp8)
        return encode_metadata(self._layout, self._agent.get_agent_metadata())

    def connect(self, peer_metadata: bytes) -> str:
        """Add a peer from its :meth:`metadata` bytes and return its name.

        Raises:
            TransferError: bad metadata, or a cache whose blocks differ from this one's (layout,
                dtype, block size, heads, head_dim, layers, fp8 scales): refused before anything
                moves, nothing changed.
        """
        self._check_open()
        layout, nixl_metadata = decode_metadata(peer_metadata)
        if layout.name == self.name:
            raise TransferError(
                f"expected a peer of another name than this agent's, got {self.name!r}"
            )
        mismatch = cache_layout(self.cache, self.name).mismatch(layout)
        if mismatch:
            raise TransferError(f"refused peer {layout.name!r}: {mismatch}")
        if layout.name in self._peers:  # a restarted peer: its new metadata replaces the old
            self.disconnect(layout.name)
        try:
            name = self._agent.add_remote_agent(nixl_metadata)
        except Exception as error:  # noqa: BLE001
            raise TransferError(f"bad peer metadata: NIXL refused it ({error})") from error
        if isinstance(name, bytes):
            name = name.decode()
        if name != layout.name:
            self._agent.remove_remote_agent(name)
            raise TransferError(
                f"bad peer metadata: expected the NIXL agent {layout.name!r} that its header "
                f"names, got {name!r}"
            )
        self._peers[name] = layout
        return name

    def disconnect(self, peer: str) -> None:
        """Remove a peer (its transfers to this agent still waiting time out)."""
        if self._peers.pop(peer, None) is not None:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:  # noqa: BLE001  (a peer gone already is disconnected)
                pass

    @property
    def peers(self) -> list[str]:
        """Names of the connected peers."""
        return list(self._peers)

    # ----------------------------------------------------------------------------- receiving

    def expect(self, prompt_ids: Sequence[int], *, peer: str) -> Incoming:
        """Admit a request whose K/V ``peer`` holds: attach the prompt's cached prefix, reserve
        the rest, and return what to ship to the sender (``incoming.request``).

        The reserved blocks are this cache's until :meth:`wait` commits them or frees them
        (:meth:`cancel`); they are not in the prefix cache meanwhile.

        Raises:
            TransferError: ``peer`` not connected; an fp8 cache whose ``"auto"`` scales are
                still pending (the moved bytes would be read with scales fixed later).
            OutOfBlocksError: too few free blocks (nothing changes).
            ValueError: an empty prompt.
        """
        self._check_open()
        layout = self._peer(peer)
        if len(prompt_ids) == 0:
            raise ValueError("expected a prompt of at least one token, got none")
        k_scales, v_scales = cache_scales(self.cache)
        if is_fp8(layout.dtype) and k_scales is None:
            raise TransferError(
                'expected fixed fp8 scales on the receiving cache, got "auto" scales still '
                "pending: the moved K/V would be read with scales calibrated later"
            )
        cache = self.cache
        admission = cache.admit(prompt_ids)
        first = admission.num_cached_tokens // cache.block_size
        blocks = cache.block_table(admission.sid)[first:]
        transfer_id = f"{self.name}.{secrets.token_hex(8)}"
        request = Request(
            transfer_id, self.name, peer, first, len(prompt_ids), blocks, k_scales, v_scales
        )
        incoming = Incoming(
            admission.sid,
            encode_request(request),
            len(blocks),
            first,
            transfer_id,
            peer,
            request.digest(),
        )
        self._waiting[transfer_id] = incoming
        return incoming

    def wait(self, incoming: Incoming, timeout: float = 10.0) -> TransferStats:
        """Poll until the sender's notification for ``incoming`` arrives (at most ``timeout``
        seconds), then commit its blocks: ``incoming.sid`` holds the prompt's K/V, and its full
        blocks serve later requests as a prefix.

        Raises:
            TransferError: a timeout (the sender gone, or never sent), or the sender's refusal:
                the reservation is freed first (``cache.check_invariants()`` holds; nothing of it
                is visible), and the message says so in one line.
            ValueError: ``incoming`` not waiting at this agent (committed or cancelled already).
        """
        self._check_open()
        tid = incoming.transfer_id
        if self._waiting.get(tid) is not incoming:
            raise ValueError(
                f"expected a transfer waiting at agent {self.name!r}, got {tid!r} (done or "
                f"cancelled)"
            )
        deadline = time.monotonic() + timeout
        while True:
            self._poll()
            if tid in self._inbox:
                break
            if time.monotonic() >= deadline:
                freed = self._drop(incoming)
                raise TransferError(
                    f"transfer {tid} from {incoming.peer!r} timed out after {timeout:g} s with no "
                    f"completion notification (sender gone?): {freed}"
                )
            time.sleep(_RECEIVER_POLL_S)
        _, kind, rest = self._inbox.pop(tid)
        words = rest.split(" ")
        if kind != "done" or len(words) != 4 or words[0] != incoming.digest:
            freed = self._drop(incoming)
            why = (
                f"the sender failed: {rest}"
                if kind == "fail"
                else f"a bad notification {rest[:60]!r}"
            )
            raise TransferError(f"transfer {tid} from {incoming.peer!r}: {why}; {freed}")
        self.cache.commit(incoming.sid)  # written: now its full blocks may serve others
        del self._waiting[tid]
        block_bytes = self._layout.block_bytes * 2 * self._layout.num_layers
        return TransferStats(
            blocks_moved=incoming.blocks_to_move,
            blocks_cached=incoming.blocks_cached,
            bytes_moved=incoming.blocks_to_move * block_bytes,
            seconds=time.perf_counter() - incoming.started,
            descriptors=int(words[3]) if words[3].isdigit() else 0,
        )

    def cancel(self, incoming: Incoming) -> None:
        """Give ``incoming`` up: free its reservation and tell the sender (best effort). A
        sender already writing may still write into the freed blocks: cancel only a transfer
        whose sender is gone or has not started (``wait``'s timeout is the bound on it)."""
        if self._waiting.get(incoming.transfer_id) is incoming:
            self._drop(incoming)

    # ----------------------------------------------------------------------------- sending

    def send(
        self, sid: int, request: bytes, *, timeout: float = 10.0, notify: bool = True
    ) -> TransferStats:
        """Write the requested blocks of sequence ``sid`` into the receiver's cache, every layer,
        one descriptor per run of consecutive ids per layer per K/V; wait for the writes to
        complete (at most ``timeout`` seconds), then notify the receiver.

        Args:
            sid: a sequence of this cache holding at least the request's prompt tokens.
            request: an :class:`Incoming`'s ``request`` bytes, from a connected peer.
            timeout: seconds the writes may take.
            notify: ``False`` writes the blocks and sends no notification: the receiver times
                out and frees them, as when a sender dies between its writes and its
                notification (for tests).

        Raises:
            TransferError: bad request bytes, a request for another agent or from a peer not
                connected, a sequence too short, different fp8 scales, a cancelled transfer,
                or a failed or timed-out write. Before anything moves where it can; the
                receiver is told (a "fail" notification) whenever it can be.
        """
        self._check_open()
        req = self._request(request)
        try:
            src = source_blocks(self.cache, sid, req)
            stats = write_blocks(
                self._agent, self._layout, self._peers[req.receiver], req, src, timeout
            )
        except Exception as error:  # (KeyError for an unknown sid too): the receiver stops waiting
            self._notify(
                req.receiver, fail_message(req.transfer_id, f"{type(error).__name__}: {error}")
            )
            self._flush()
            raise
        if notify:
            self._notify(
                req.receiver,
                done_message(req, stats.blocks_moved, stats.bytes_moved, stats.descriptors),
                required=True,
            )
        return stats

    # ----------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Free every reservation still waiting, remove the peers, deregister the cache."""
        if self._closed:
            return
        for incoming in list(self._waiting.values()):
            self._drop(incoming)
        for peer in list(self._peers):
            self.disconnect(peer)
        try:
            self._agent.deregister_memory(self._registered)
        finally:
            self._closed = True
            self._agent = None

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"expected an open agent, got {self.name!r} closed")

    def _peer(self, peer: str) -> CacheLayout:
        layout = self._peers.get(peer)
        if layout is None:
            raise TransferError(
                f"expected a connected peer (connect() its metadata first), got {peer!r}; "
                f"connected: {self.peers}"
            )
        return layout

    def _request(self, data: bytes) -> Request:
        """The request's bytes checked: ours, from a connected receiver, for this agent, alive."""
        peek = decode_request(data, self._layout.block_size, 2**31 - 1)  # (its receiver, first)
        receiver = self._peer(peek.receiver)
        req = decode_request(data, self._layout.block_size, receiver.num_blocks)
        if req.sender != self.name:
            raise TransferError(
                f"bad request: expected one for sender {self.name!r}, got one for {req.sender!r}"
            )
        self._poll()  # (a cancel already here refuses the transfer)
        if req.transfer_id in self._cancelled:
            raise TransferError(
                f"transfer {req.transfer_id} was cancelled by its receiver {req.receiver!r}"
            )
        return req

    def _notify(self, peer: str, message: bytes, required: bool = False) -> None:
        try:
            self._agent.send_notif(peer, message)
        except Exception as error:  # noqa: BLE001
            if required:
                raise TransferError(
                    f"the blocks are written but {peer!r} could not be notified: {error}"
                ) from error

    def _flush(self) -> None:
        """Progress NIXL for ``_FLUSH_S``: a notification to a peer that no transfer went to yet
        waits for the connection's wire-up, which needs this side's progress too; without the
        progress thread, an agent that goes idle after notifying would hold it back until its
        next call (NIXL reports no completion of a notification to wait for)."""
        end = time.monotonic() + _FLUSH_S
        while time.monotonic() < end:
            self._poll()
            time.sleep(_RECEIVER_POLL_S)

    def _poll(self) -> None:
        """Take NIXL's new notifications: ours for a waiting transfer into the inbox (from its
        own peer only), cancels into the cancelled list; anything else is not ours."""
        for sender, messages in self._agent.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            for message in messages:
                parsed = parse_message(message)
                if parsed is None:
                    continue
                kind, tid, rest = parsed
                if kind == "cancel":
                    self._cancelled.append(tid)
                elif tid in self._waiting and self._waiting[tid].peer == sender:
                    self._inbox[tid] = (sender, kind, rest)

    def _drop(self, incoming: Incoming) -> str:
        """Free a reservation (and tell its sender, best effort); what was done, as words."""
        del self._waiting[incoming.transfer_id]
        self._inbox.pop(incoming.transfer_id, None)
        try:
            self.cache.free(incoming.sid)
        except KeyError:  # the application freed it already: nothing left to free
            pass
        if incoming.peer in self._peers:  # (a sender that has not started yet refuses it)
            self._notify(incoming.peer, cancel_message(incoming.transfer_id))
            self._flush()
        return (
            f"freed the {incoming.blocks_to_move} block(s) reserved for sequence {incoming.sid} "
            f"(nothing of it was committed or is visible)"
        )
