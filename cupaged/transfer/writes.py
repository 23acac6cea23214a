"""The sender's half of a transfer: which blocks of its sequence, the NIXL WRITE of them
(push), or their offer and hold while the receiver reads them (pull, :func:`offer`).

One request is one NIXL transfer: the blocks pair up with the receiver's in order, runs that are
consecutive on both sides merge (:func:`~cupaged.transfer.blocks.runs`), and each run is one
descriptor per layer per K/V. The sender polls the transfer to completion itself (no progress
thread); its notification to the receiver follows only a completed write. NIXL's UCX backend
reports a transfer done after flushing its connections (remote completion, not just the local
buffers free), so the notification never overtakes the bytes; the flush needs the receiver's
progress too, which is why a receiver polls while its sender sends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._util import cdiv
from ..dtypes import is_fp8
from .blocks import cache_scales, descriptor_rows, runs
from .mailbox import Mailbox, pause
from .wire import (
    CacheLayout,
    Request,
    TransferError,
    TransferStats,
    decode_request,
    ready_message,
    scales_mismatch,
)


def check_request(
    data: bytes, local: CacheLayout, peers: dict[str, CacheLayout], mail: Mailbox
) -> Request:
    """The request's bytes checked: ours, from a connected receiver (``peers``), for the agent
    of ``local``, not cancelled (``mail`` polled just before).

    Raises:
        TransferError: any of these not so.
    """
    peek = decode_request(data, local.block_size, 2**31 - 1)  # (its receiver: the pool to check)
    receiver = peers.get(peek.receiver)
    if receiver is None:
        raise TransferError(
            f"expected a request from a connected peer, got one from {peek.receiver!r}; "
            f"connected: {list(peers)}"
        )
    req = decode_request(data, local.block_size, receiver.num_blocks)
    if req.sender != local.name:
        raise TransferError(
            f"bad request: expected one for sender {local.name!r}, got one for {req.sender!r}"
        )
    if mail.cancelled(req.transfer_id):
        raise TransferError(
            f"transfer {req.transfer_id} was cancelled by its receiver {req.receiver!r}"
        )
    return req


def source_blocks(cache: Any, sid: int, req: Request) -> np.ndarray:
    """The sender's blocks for a request: logical blocks ``first_block ..`` of sequence ``sid``
    (``[n]`` int64), checked: the sequence holds the prompt, no block released by a window, and
    an fp8 cache's scales equal the receiver's.

    Raises:
        TransferError: a check failed. KeyError: an unknown ``sid``.
    """
    length = cache.seq_len(sid)  # (KeyError: unknown)
    if length < req.num_tokens:
        raise TransferError(
            f"expected sequence {sid} to hold the request's {req.num_tokens} tokens, got {length}"
        )
    table = np.asarray(
        cache.block_table(sid)[req.first_block : cdiv(req.num_tokens, cache.block_size)],
        np.int64,
    )
    if (table < 0).any():
        raise TransferError(
            f"expected sequence {sid} to hold every requested block, got some released by its "
            f"window"
        )
    if is_fp8(cache.spec.dtype):
        mismatch = scales_mismatch(*cache_scales(cache), req.k_scales, req.v_scales)
        if mismatch:
            raise TransferError(f"refused transfer {req.transfer_id}: {mismatch}")
    return table


def write_blocks(
    agent: Any,
    local: CacheLayout,
    remote: CacheLayout,
    req: Request,
    src: np.ndarray,
    timeout: float,
) -> TransferStats:
    """WRITE blocks ``src`` of this cache (``local``) into the request's blocks of ``remote``'s,
    every layer's K and V, one NIXL request of one descriptor per run per layer per K/V, and
    wait (polling, at most ``timeout`` seconds) until NIXL reports it complete.

    Raises:
        TransferError: NIXL refused or failed the transfer, or it timed out.
    """
    src_starts, dst_starts, lengths = runs(src, np.asarray(req.blocks, np.int64))
    local_rows = descriptor_rows(local, src_starts, lengths)
    remote_rows = descriptor_rows(remote, dst_starts, lengths)
    nbytes = int(local_rows[:, 1].sum())
    start = time.perf_counter()
    if len(local_rows):
        _post(agent, req, local_rows, remote_rows, local.memory, remote.memory, timeout)
    return TransferStats(
        len(src), req.first_block, nbytes, time.perf_counter() - start, len(local_rows)
    )


def _post(
    agent: Any,
    req: Request,
    local_rows: np.ndarray,
    remote_rows: np.ndarray,
    local_memory: str,
    remote_memory: str,
    timeout: float,
) -> None:
    handle = None
    try:
        local = agent.get_xfer_descs(local_rows, local_memory)
        remote = agent.get_xfer_descs(remote_rows, remote_memory)
        handle = agent.initialize_xfer("WRITE", local, remote, req.receiver)
        state = agent.transfer(handle)
        deadline = time.monotonic() + timeout
        while state == "PROC":
            if time.monotonic() >= deadline:
                raise TransferError(
                    f"transfer {req.transfer_id} to {req.receiver!r} timed out after {timeout:g} s "
                    f"writing {len(local_rows)} descriptor(s)"
                )
            time.sleep(0)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(
                f"transfer {req.transfer_id} to {req.receiver!r}: NIXL reported {state}"
            )
    except TransferError:
        raise
    except Exception as error:  # noqa: BLE001
        raise TransferError(
            f"transfer {req.transfer_id} to {req.receiver!r} failed in NIXL: {error}"
        ) from error
    finally:
        if handle is not None:
            try:
                agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001  (an active transfer NIXL cannot cancel)
                pass


def offer(
    mail: Mailbox, req: Request, src: np.ndarray, hold: float, stall: float, poll: Callable
) -> TransferStats:
    """Pull: offer blocks ``src`` to the receiver (a "ready" notification with their ids and
    ``hold``) and keep them until its "done", its cancel, or ``hold`` seconds (``poll()``
    progresses the agent meanwhile). The caller leaves the sequence untouched while this runs.

    Raises:
        TransferError: the receiver gave up, or did not read within ``hold``.
    """
    tid = req.transfer_id
    mail.open(tid, req.receiver)
    try:
        time.sleep(stall)  # (tests: a late sender, progressing nothing)
        start = time.perf_counter()  # (after the request came: after the receiver's expect())
        mail.notify(req.receiver, ready_message(req, src, hold), required=True)
        while True:
            poll()
            kind, rest = mail.take(tid) or ("", "")
            words = rest.split(" ")
            if kind == "done" and len(words) == 4 and words[0] == req.digest():
                break
            if kind or mail.cancelled(tid):
                raise TransferError(
                    f"transfer {tid}: the receiver {req.receiver!r} gave up on the offered "
                    f"blocks ({kind or 'cancel'} {rest[:60]}); they are the sender's again"
                )
            if time.perf_counter() >= start + hold:
                raise TransferError(
                    f"transfer {tid}: the receiver {req.receiver!r} did not read the offered "
                    f"blocks within the hold of {hold:g} s; they are the sender's again"
                )
            pause(start)
    finally:
        mail.close(tid)
    nbytes, descriptors = (int(w) if w.isdigit() else 0 for w in words[2:])
    return TransferStats(
        len(src), req.first_block, nbytes, time.perf_counter() - start, descriptors
    )
