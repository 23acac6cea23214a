"""KV blocks moved between PagedCaches in different processes (or machines) on NIXL.

Disaggregated serving: a prefill worker computes a prompt's K/V and a decode worker continues
it, so the blocks move from one cache to the other (vLLM's ``NixlConnector``). Here one
:class:`KVTransferAgent` per cache registers its K/V once; the receiver admits the request
(prefix caching: blocks it holds are not moved) and reserves the rest; by default it then READs
exactly those blocks of every layer from the sender, which keeps them until the receiver says
it has read them (pull, ``mode="read"``); or the sender writes them (push, ``mode="write"``).
The receiver commits them once complete (docs/transfer.md).

==============  ===========================================================================
``agent``       :class:`KVTransferAgent` and :class:`Incoming`: the protocol over NIXL
``reads``       the receiver's READ (pull), and the quarantine of one still in flight
``writes``      the sender's side: its blocks checked, the WRITE (push), the offer (pull)
``mailbox``     the agent's notifications, sorted by transfer, from the right peer only
``blocks``      where a cache's blocks are, runs of consecutive ids, NIXL descriptor rows
``wire``        metadata, request and notification bytes, checked; :class:`TransferError`
==============  ===========================================================================

NIXL is optional and imported only when an agent is made: ``.venv/bin/pip install --no-deps
nixl nixl-cu12`` (without ``--no-deps``, nixl-cu12 pulls a CUDA build of PyTorch).
"""

from __future__ import annotations

from .agent import Incoming, KVTransferAgent, nixl_available
from .wire import TransferError, TransferStats

__all__ = ["Incoming", "KVTransferAgent", "TransferError", "TransferStats", "nixl_available"]
