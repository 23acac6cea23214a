"""An agent's NIXL notifications: ours sorted by transfer, from the right peer only.

A transfer is *open* from the moment one side expects notifications for it (the receiver's
``expect``, the sender's offer in pull mode) until it is over; a notification is kept only for
an open transfer and only from the peer it was opened with, so a stray or forged line from
another agent changes nothing. Cancels are remembered for any transfer (a sender may see the
cancel before the request: it then refuses it).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from .wire import TransferError, parse_message

POLL_S = 2e-4  # between polls: a waiting side leaves the core to others
SPIN_S = 2e-3  # except this long after it started waiting: an answer due soon comes sooner
FLUSH_S = 0.25  # progress after a refusal's or a cancel's notification, so that it leaves


def pause(since: float) -> None:
    """Between two polls of a wait that began at ``since`` (``time.perf_counter()``): yield the
    core at once for ``SPIN_S``, then sleep ``POLL_S`` (a sleep takes longer than asked: each
    one a notification waits for adds to a transfer's round trip)."""
    time.sleep(0 if time.perf_counter() - since < SPIN_S else POLL_S)


class Mailbox:
    """The notifications of one NIXL agent (``agent``: a ``nixl_agent``)."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._open: dict[str, str] = {}  # transfer id -> the peer its notifications come from
        self._inbox: dict[str, tuple[str, str]] = {}  # transfer id -> (kind, rest of the line)
        self._cancelled: deque[str] = deque(maxlen=4096)  # transfers the receivers gave up

    def open(self, transfer_id: str, peer: str) -> None:
        self._open[transfer_id] = peer

    def close(self, transfer_id: str) -> None:
        self._open.pop(transfer_id, None)
        self._inbox.pop(transfer_id, None)

    def take(self, transfer_id: str) -> tuple[str, str] | None:
        """The open transfer's notification ``(kind, rest)``, if one came; else ``None``."""
        return self._inbox.pop(transfer_id, None)

    def cancelled(self, transfer_id: str) -> bool:
        return transfer_id in self._cancelled

    def poll(self) -> None:
        """Take NIXL's new notifications: ours for an open transfer from its peer into the
        inbox, cancels into the cancelled list; anything else is not ours."""
        for sender, messages in self._agent.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            for message in messages:
                parsed = parse_message(message)
                if parsed is None:
                    continue
                kind, tid, rest = parsed
                if kind == "cancel":
                    self._cancelled.append(tid)
                elif self._open.get(tid) == sender:
                    self._inbox[tid] = (kind, rest)

    def notify(self, peer: str, message: bytes, required: bool = False) -> None:
        """Send ``message`` to ``peer``; a failure raises only if ``required``."""
        try:
            self._agent.send_notif(peer, message)
        except Exception as error:  # noqa: BLE001
            if required:
                raise TransferError(f"{peer!r} could not be notified: {error}") from error

    def flush(self, seconds: float = FLUSH_S) -> None:
        """Progress NIXL for ``seconds``: a notification to a peer that no transfer went to yet
        waits for the connection's wire-up, which needs this side's progress too; without the
        progress thread, an agent that goes idle after notifying would hold it back until its
        next call (NIXL reports no completion of a notification to wait for)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.poll()
            time.sleep(POLL_S)
