"""KVTransferAgent: a PagedCache's blocks moved to or from another process's cache over NIXL.

The protocol (docs/transfer.md), for one request moved from a prefill process P to a decode
process D, each with a cache and an agent. Pull (``mode="read"``, the default)::

    D: incoming = agent.expect(prompt, peer="P")   admit: cached prefix attached, the rest reserved
       ... ship incoming.request to P ...          (the reserved blocks are not in the prefix cache)
    P: agent.send(sid, request)                    offer its block ids ("ready", with its hold),
                                                   then keep them unchanged until D's "done"
    D: agent.wait(incoming)                        READ exactly those blocks, every layer; once
                                                   the read ended: commit, notify P "done"

Push (``mode="write"``): P WRITEs into D's reserved blocks and notifies "done"; D commits.

The receiver reserves, and a block becomes visible to prefix matching only when the receiver
commits it after the bytes are complete: a half-moved block is never served. In pull mode the
only writer into a cache is that cache's own agent, which frees a reservation only once its READ
can no longer land (:mod:`~cupaged.transfer.reads`); in push mode a sender that did not see the
receiver's cancel can write into blocks freed meanwhile (docs/transfer.md, "Which mode").
Metadata (:meth:`KVTransferAgent.metadata`) and requests are bytes the application carries;
NIXL carries the K/V and the notifications.

The NIXL agent runs without its progress thread (it would spin a core): each side polls while
it waits, the sender in :meth:`KVTransferAgent.send`, the receiver in
:meth:`KVTransferAgent.wait`; both must be in them at the same time.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtypes import is_fp8
from .blocks import cache_layout, cache_scales, register
from .mailbox import FLUSH_S, POLL_S, Mailbox, pause
from .reads import ENDED, QUARANTINED, Quarantine, post_read, release, settle
from .wire import (
    MODES,
    CacheLayout,
    Request,
    TransferError,
    TransferStats,
    cancel_message,
    decode_metadata,
    done_message,
    encode_metadata,
    encode_request,
    fail_message,
    parse_ready,
)
from .writes import check_request, offer, source_blocks, write_blocks

INSTALL = ".venv/bin/pip install --no-deps nixl nixl-cu12"  # (nixl-cu12's torch requirement: no)
_DONE_POLLS = 8  # progress rounds after a pull's "done", on a connection its READ wired up
# The receiver commits a pull only if its READ ended this long before the sender's hold did
# (by its own clock, from expect()): the two clocks' rates may differ a little.
_HOLD_MARGIN_S = 0.05


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
        digest: what the sender's notifications must carry (a hash of the transfer id, the mode
            and the block ids): a notification for other blocks commits nothing.
        mode: ``"read"`` (pull: this side reads) or ``"write"`` (push: the sender writes).
        started: ``time.perf_counter()`` at :meth:`KVTransferAgent.expect`.
    """

    sid: int
    request: bytes
    blocks_to_move: int
    blocks_cached: int
    transfer_id: str
    peer: str
    digest: str = ""
    mode: str = "read"
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
            self._registered = register(self._agent, cache, self._layout)
        except TransferError:
            raise
        except Exception as error:  # noqa: BLE001  (NIXL raises its bindings' own types)
            raise TransferError(f"NIXL agent {name!r} could not start: {error}") from error
        self._peers: dict[str, CacheLayout] = {}
        self._waiting: dict[str, Incoming] = {}  # transfer id -> reserved, not yet committed
        self._mail = Mailbox(self._agent)
        self._quarantine = Quarantine()  # reservations whose READ had not ended at the deadline
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

    def expect(self, prompt_ids: Sequence[int], *, peer: str, mode: str = "read") -> Incoming:
        """Admit a request whose K/V ``peer`` holds: attach the prompt's cached prefix, reserve
        the rest, and return what to ship to the sender (``incoming.request``).

        The reserved blocks are this cache's until :meth:`wait` commits them or frees them
        (:meth:`cancel`); they are not in the prefix cache meanwhile.

        Args:
            prompt_ids: the prompt's tokens.
            peer: the sending agent's name (:meth:`connect`'s answer).
            mode: ``"read"``: this agent reads the sender's blocks (pull: nothing writes into
                this cache but its own agent); ``"write"``: the sender writes them (push; a
                sender that misses this side's cancel can write into freed blocks).

        Raises:
            TransferError: ``peer`` not connected; an fp8 cache whose ``"auto"`` scales are
                still pending (the moved bytes would be read with scales fixed later).
            OutOfBlocksError: too few free blocks (nothing changes).
            ValueError: an empty prompt, or a mode not in ``("read", "write")``.
        """
        self._check_open()
        layout = self._peer(peer)
        if len(prompt_ids) == 0:
            raise ValueError("expected a prompt of at least one token, got none")
        if mode not in MODES:
            raise ValueError(f"expected mode one of {MODES}, got {mode!r}")
        k_scales, v_scales = cache_scales(self.cache)
        if is_fp8(layout.dtype) and k_scales is None:
            raise TransferError(
                'expected fixed fp8 scales on the receiving cache, got "auto" scales still '
                "pending: the moved K/V would be read with scales calibrated later"
            )
        self._poll()  # (quarantined blocks whose READ ended are free again)
        cache = self.cache
        admission = cache.admit(prompt_ids)
        first = admission.num_cached_tokens // cache.block_size
        blocks = cache.block_table(admission.sid)[first:]
        transfer_id = f"{self.name}.{secrets.token_hex(8)}"
        request = Request(
            transfer_id, self.name, peer, first, len(prompt_ids), blocks, k_scales, v_scales, mode
        )
        incoming = Incoming(
            admission.sid,
            encode_request(request),
            len(blocks),
            first,
            transfer_id,
            peer,
            request.digest(),
            mode,
        )
        self._waiting[transfer_id] = incoming
        self._mail.open(transfer_id, peer)
        return incoming

    def wait(self, incoming: Incoming, timeout: float = 10.0) -> TransferStats:
        """Poll until the blocks of ``incoming`` are complete (at most ``timeout`` seconds), then
        commit them: ``incoming.sid`` holds the prompt's K/V, and its full blocks serve later
        requests as a prefix. Pull: on the sender's offer, READ its blocks and poll the READ to
        its end (within ``timeout`` and the sender's hold), then notify the sender "done".
        Push: commit on the sender's "done".

        Raises:
            TransferError: a timeout (the sender gone, or never sent), the sender's refusal, a
                failed READ: the reservation is freed first (``cache.check_invariants()``
                holds; nothing of it is visible), or, for a READ still in flight, kept out of
                the free list (:attr:`quarantined`) until it ends; the message says which.
                After it, ``incoming.sid`` is not the application's: never free it.
            ValueError: ``incoming`` not waiting at this agent (committed or cancelled already).
        """
        self._check_open()
        tid = incoming.transfer_id
        if self._waiting.get(tid) is not incoming:
            raise ValueError(
                f"expected a transfer waiting at agent {self.name!r}, got {tid!r} (done or "
                f"cancelled)"
            )
        start = time.perf_counter()
        deadline = start + timeout
        while (message := self._mail.take(tid)) is None:
            self._poll()
            if time.perf_counter() >= deadline:
                what = "offer" if incoming.mode == "read" else "completion notification"
                raise self._give_up(
                    incoming, f"timed out after {timeout:g} s with no {what} (sender gone?)"
                )
            pause(start)
        kind, rest = message
        if kind == "fail":
            raise self._give_up(incoming, f"the sender failed: {rest}")
        if incoming.mode == "read" and kind == "ready":
            return self._read(incoming, rest, deadline)
        words = rest.split(" ")
        if incoming.mode == "read" or kind != "done" or len(words) != 4:
            raise self._give_up(incoming, f"a bad notification {kind} {rest[:60]!r}")
        if words[0] != incoming.digest:
            raise self._give_up(incoming, f"a notification for other blocks {rest[:60]!r}")
        self.cache.commit(incoming.sid)  # written: now its full blocks may serve others
        del self._waiting[tid]
        self._mail.close(tid)
        descriptors = int(words[3]) if words[3].isdigit() else 0
        return _received(incoming, self._layout, descriptors)

    def cancel(self, incoming: Incoming) -> None:
        """Give ``incoming`` up: free its reservation and tell the sender (best effort). Pull:
        safe whenever it is called (this side's READ runs only inside :meth:`wait`). Push: a
        sender already writing may still write into the freed blocks: cancel only a transfer
        whose sender is gone or has not started (``wait``'s timeout is the bound on it)."""
        if self._waiting.get(incoming.transfer_id) is incoming:
            self._drop(incoming)

    @property
    def quarantined(self) -> list[int]:
        """Sequences whose READ had not ended when :meth:`wait` gave up: reserved, invisible,
        until a later poll (any call of this agent, :meth:`progress`) sees it end."""
        return self._quarantine.sids

    def progress(self) -> None:
        """Progress NIXL once: take notifications, free quarantined blocks whose READ ended (an
        idle receiver calls it now and then)."""
        self._check_open()
        self._poll()

    # ----------------------------------------------------------------------------- sending

    def send(
        self,
        sid: int,
        request: bytes,
        *,
        timeout: float = 10.0,
        notify: bool = True,
        stall: float = 0.0,
    ) -> TransferStats:
        """Move the requested blocks of sequence ``sid`` to the receiver, as its request asks.
        Pull (``mode="read"``): offer them and keep them unchanged until the receiver has read
        them, gives up, or ``timeout`` (the hold) passes (:func:`~.writes.offer`; any hold is
        safe: the receiver never commits a read that ended after it). Push: WRITE them, every
        layer, one descriptor per run per layer per K/V, wait (``timeout``), notify "done".

        Args:
            sid: a sequence of this cache holding at least the request's prompt tokens.
            request: an :class:`Incoming`'s ``request`` bytes, from a connected peer.
            timeout: seconds the hold (pull) or the writes (push) may take.
            notify: push, for tests: ``False`` sends no "done" (a sender dead after writing).
            stall: for tests: seconds asleep, progressing nothing, once the request is checked:
                before writing (push) or offering (pull): a late sender.

        Raises:
            TransferError: bad request bytes or one not for this agent, a sequence too short,
                other fp8 scales, a cancelled transfer, a failed or timed-out write, a receiver
                that gave up or never read; the receiver is told ("fail") whenever it can be.
        """
        self._check_open()
        self._poll()  # (a cancel already here refuses the transfer)
        req = check_request(request, self._layout, self._peers, self._mail)
        try:
            src = source_blocks(self.cache, sid, req)
            if req.mode == "read":
                return offer(self._mail, req, src, timeout, stall, self._poll)
            time.sleep(stall)
            stats = write_blocks(
                self._agent, self._layout, self._peers[req.receiver], req, src, timeout
            )
        except Exception as error:  # (KeyError for an unknown sid too): the receiver stops waiting
            self._mail.notify(
                req.receiver, fail_message(req.transfer_id, f"{type(error).__name__}: {error}")
            )
            self._mail.flush()
            raise
        if notify:
            numbers = (stats.blocks_moved, stats.bytes_moved, stats.descriptors)
            message = done_message(req.transfer_id, req.digest(), *numbers)
            self._mail.notify(req.receiver, message, required=True)
        return stats

    # ----------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Free every reservation still waiting, remove the peers, deregister the cache. A
        quarantined READ gets ``FLUSH_S`` more to end; a sequence whose READ still has not
        stays owned in the cache (listed in :attr:`quarantined`): its blocks are never reused."""
        if self._closed:
            return
        for incoming in list(self._waiting.values()):
            self._drop(incoming)
        end = time.perf_counter() + FLUSH_S
        while self._quarantine.sids and time.perf_counter() < end:
            self._poll()
            time.sleep(POLL_S)
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

    def _poll(self) -> None:
        """Free the quarantined sequences whose READ has ended; take new notifications."""
        if self._quarantine.sids:
            self._quarantine.release_ended(self._agent, self.cache)
        self._mail.poll()

    def _read(self, incoming: Incoming, offer: str, deadline: float) -> TransferStats:
        """Pull: READ the offered blocks into the reservation, commit once the READ ended in
        time, tell the sender "done". Its READ ended or quarantined before any raise."""
        tid, layout = incoming.transfer_id, self._peers.get(incoming.peer)
        if layout is None:
            raise self._give_up(incoming, "the sender was disconnected: nothing read")
        try:
            src, hold = parse_ready(
                offer, incoming.digest, incoming.blocks_to_move, layout.num_blocks
            )
        except TransferError as error:
            raise self._give_up(incoming, str(error)) from None
        # The sender offered after expect() made the request, and keeps its blocks for `hold`
        # from then: by this clock at least until started + hold. A READ that ended before that
        # read stable bytes; one that ends later is never committed.
        commit_by = min(deadline, incoming.started + hold - _HOLD_MARGIN_S)
        late = "the sender's hold" if commit_by < deadline else "the deadline"
        if time.perf_counter() >= commit_by:
            raise self._give_up(incoming, f"the offer came after {late}: nothing read")
        dst = np.asarray(self.cache.block_table(incoming.sid)[incoming.blocks_cached :], np.int64)
        read = post_read(self._agent, self._layout, layout, dst, src, incoming.peer)
        state = settle(self._agent, read, commit_by)
        if state not in ENDED:  # in flight: it may still land, so its blocks stay reserved
            raise self._give_up(incoming, f"the READ of its blocks had not ended by {late}", read)
        release(self._agent, read)
        if state != "DONE":
            raise self._give_up(incoming, f"the READ of its blocks ended in {state}")
        if time.perf_counter() > commit_by:  # (seen DONE after it: the bytes may be stale)
            raise self._give_up(incoming, f"the READ of its blocks ended after {late}")
        self.cache.commit(incoming.sid)  # read: now its full blocks may serve others
        del self._waiting[tid]
        self._mail.close(tid)
        numbers = (incoming.blocks_to_move, read.nbytes, read.descriptors)
        self._mail.notify(incoming.peer, done_message(tid, incoming.digest, *numbers))
        for _ in range(_DONE_POLLS):  # (so that it leaves while this side goes idle)
            self._mail.poll()
        return _received(incoming, self._layout, read.descriptors)

    def _give_up(self, incoming: Incoming, why: str, read: Any = None) -> TransferError:
        """Free (or, with a READ still in flight, quarantine) ``incoming``'s reservation, tell
        its sender, and return the error to raise."""
        if read is None:
            done = self._drop(incoming)
        else:
            self._quarantine.add(incoming.sid, read)
            done = self._drop(incoming, free=False)
        return TransferError(
            f"transfer {incoming.transfer_id} from {incoming.peer!r}: {why}; {done}"
        )

    def _drop(self, incoming: Incoming, free: bool = True) -> str:
        """Free a reservation (unless quarantined: ``free=False``), tell its sender (best
        effort); what was done, as words."""
        del self._waiting[incoming.transfer_id]
        self._mail.close(incoming.transfer_id)
        if free:
            try:
                self.cache.free(incoming.sid)
            except KeyError:  # the application freed it already: nothing left to free
                pass
        if incoming.peer in self._peers:  # (a sender that has not started yet refuses it)
            self._mail.notify(incoming.peer, cancel_message(incoming.transfer_id))
            self._mail.flush()
        if not free:
            return f"{QUARANTINED} (sequence {incoming.sid}, {incoming.blocks_to_move} block(s))"
        return (
            f"freed the {incoming.blocks_to_move} block(s) reserved for sequence {incoming.sid} "
            f"(nothing of it was committed or is visible)"
        )


def _received(incoming: Incoming, layout: CacheLayout, descriptors: int) -> TransferStats:
    """The receiver's stats of a committed transfer (seconds: ``expect()`` to commit)."""
    return TransferStats(
        blocks_moved=incoming.blocks_to_move,
        blocks_cached=incoming.blocks_cached,
        bytes_moved=incoming.blocks_to_move * layout.block_bytes * 2 * layout.num_layers,
        seconds=time.perf_counter() - incoming.started,
        descriptors=descriptors,
    )
