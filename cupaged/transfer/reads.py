"""The receiver's half of a pull: the NIXL READ of the sender's offered blocks, and what is done
with blocks whose read did not end in time.

One request is one NIXL READ: the receiver's reserved blocks pair up with the sender's offered
ones in order, runs consecutive on both sides merge (:func:`~cupaged.transfer.blocks.runs`), and
each run is one descriptor per layer per K/V, as for a write. The receiver polls its own READ.

**When a READ can no longer land.** The only writer into the receiver's blocks is its own READ,
so the receiver frees them only once that READ has *ended*: NIXL reports it ``"DONE"`` (every
byte arrived) or ``"ERR"`` (its endpoint failed, and UCX completes every operation of a failed
endpoint with an error: nothing lands after). Releasing a handle still ``"PROC"`` is no such
proof: NIXL's UCX backend then calls ``ucp_request_cancel`` on the requests it still tracks,
which does not cancel RMA (only receives), and frees them; the gets it posted before the last
were freed at posting and run on untracked. So a READ still in flight at the receiver's deadline
is never released: its blocks go to :class:`Quarantine`, still owned by their sequence (out of
the free list, invisible to prefix matching), until a later poll sees the READ end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .blocks import descriptor_rows, runs
from .wire import CacheLayout

ENDED = ("DONE", "ERR")
QUARANTINED = (
    "its blocks are quarantined (owned, never visible, not free) until NIXL reports the READ "
    "ended: nothing can land in blocks another request holds"
)


@dataclass(slots=True)
class Read:
    """One posted READ: its NIXL handle, bytes and descriptors, and its state when last seen."""

    handle: Any
    nbytes: int
    descriptors: int
    state: str


def post_read(
    agent: Any,
    local: CacheLayout,
    remote: CacheLayout,
    dst: np.ndarray,
    src: np.ndarray,
    peer: str,
) -> Read:
    """READ the peer's blocks ``src`` (``[n]`` int64, its ids) into this cache's ``dst``, every
    layer's K and V, one NIXL request. A READ NIXL refused or failed at posting is returned
    ended (``"ERR"``, its handle released); nothing of it is in flight."""
    dst_starts, src_starts, lengths = runs(dst, src)
    local_rows = descriptor_rows(local, dst_starts, lengths)
    remote_rows = descriptor_rows(remote, src_starts, lengths)
    nbytes = int(local_rows[:, 1].sum())
    if len(local_rows) == 0:
        return Read(None, 0, 0, "DONE")
    handle = None
    try:
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local_rows, local.memory),
            agent.get_xfer_descs(remote_rows, remote.memory),
            peer,
        )
        state = agent.transfer(handle)
    except Exception:  # noqa: BLE001  (a peer gone: NIXL raises its bindings' own types)
        state = "ERR"
    read = Read(handle, nbytes, len(local_rows), state)
    if state == "ERR":
        release(agent, read)
    return read


def settle(agent: Any, read: Read, deadline: float) -> str:
    """Poll ``read`` until it ends or ``time.perf_counter()`` passes ``deadline``; its state."""
    while read.state == "PROC" and time.perf_counter() < deadline:
        time.sleep(0)
        read.state = check(agent, read)
    return read.state


def check(agent: Any, read: Read) -> str:
    """``read``'s state now (one NIXL progress); an exception from NIXL is a failed endpoint."""
    if read.state != "PROC":
        return read.state
    try:
        return agent.check_xfer_state(read.handle)
    except Exception:  # noqa: BLE001
        return "ERR"


def release(agent: Any, read: Read) -> None:
    """Release an ended READ's handle (never one in flight: see the module's docstring)."""
    assert read.state in ENDED, read.state
    if read.handle is not None:
        try:
            agent.release_xfer_handle(read.handle)
        except Exception:  # noqa: BLE001  (ended: nothing of it can land whatever NIXL says)
            pass
        read.handle = None


class Quarantine:
    """Sequences whose READ was still in flight when the receiver gave up: their blocks stay
    owned (out of the free list) until :meth:`release_ended` sees the READ end and frees them.

    Example (what ``KVTransferAgent`` does)::

        quarantine.add(sid, read)                  # wait() timed out, the read not ended
        freed = quarantine.release_ended(agent, cache)   # every poll: [sid] once it ended
    """

    def __init__(self) -> None:
        self._reads: dict[int, Read] = {}  # sequence id -> its READ, not ended when last seen

    def add(self, sid: int, read: Read) -> None:
        assert read.state == "PROC" and sid not in self._reads, (sid, read.state)
        self._reads[sid] = read

    @property
    def sids(self) -> list[int]:
        """The quarantined sequences (their blocks reserved, nothing of them visible)."""
        return list(self._reads)

    def release_ended(self, agent: Any, cache: Any) -> list[int]:
        """Free the sequences whose READ has ended (one NIXL check each); their ids."""
        freed = []
        for sid, read in list(self._reads.items()):
            read.state = check(agent, read)
            if read.state in ENDED:
                release(agent, read)
                del self._reads[sid]
                try:
                    cache.free(sid)
                except KeyError:  # the application freed it: nothing left to free
                    pass
                freed.append(sid)
        return freed
