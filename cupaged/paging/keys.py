"""The prefix-key map of a block pool: which full block holds which content.

A registered block is findable under its key (the prefix cache's hash of the tokens up to and
including the block) and stores a *content* that every hit is verified against (a second hash:
a key collision never serves another prompt's K/V). One key maps to one block: the first block
registered under a key keeps it.

Every change records its undo first (saved values, restored as they were).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from operator import itemgetter
from types import MappingProxyType
from typing import Any

import numpy as np

from .._arrays.checks import require


class KeyMap:
    """Key -> block and block -> (key, content) for ``num_blocks`` blocks.

    Args:
        num_blocks: blocks in the pool.
        log: where undo goes: ``log.append((undo, *args))`` before each change.
    """

    def __init__(self, num_blocks: int, log: Any) -> None:
        self._key_of: list[Hashable | None] = [None] * num_blocks
        self._content_of: list[object] = [None] * num_blocks
        self._block_of: dict[Hashable, int] = {}
        self._view = MappingProxyType(self._block_of)
        self.registered = np.zeros(num_blocks, bool)  # (read it; the map keeps it)
        self._log = log

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def mapping(self) -> Mapping[Hashable, int]:
        """Key -> registered block, read-only and live."""
        return self._view

    def find(self, key: Hashable, content: object) -> int | None:
        """The block registered under ``key`` if it holds ``content`` (a hit), else ``None``."""
        block = self._block_of.get(key)
        return block if block is not None and self._content_of[block] == content else None

    def lookup(self, key: Hashable) -> tuple[int, object] | None:
        """The block registered under ``key`` and its content, or ``None``."""
        block = self._block_of.get(key)
        return None if block is None else (block, self._content_of[block])

    def key_of(self, block: int) -> Hashable | None:
        """The key ``block`` is registered under, or ``None``."""
        return self._key_of[block]

    def register_many(
        self,
        blocks: list[int],
        keys: Sequence[Hashable],
        contents: Sequence[object],
        refused: list[int] | None = None,
    ) -> None:
        """Register ``blocks[i]`` (in use, unchecked) under ``keys[i]``, holding ``contents[i]``;
        a key another block holds keeps that block (the first writer wins), and ``refused``
        collects each such ``i``."""
        block_of, key_of, content_of = self._block_of, self._key_of, self._content_of
        new: list[int] = []  # filled as blocks register: its undo is recorded first
        self._log.append((self._unregister, new))
        for i, (block, key) in enumerate(zip(blocks, keys, strict=True)):
            if key in block_of:
                if refused is not None:
                    refused.append(i)
                continue  # the first writer wins
            if key_of[block] is not None:
                require(False, f"block {block} is already registered")
            new.append(block)
            key_of[block] = key  # (first: the undo finds the key through it)
            content_of[block] = contents[i]
            block_of[key] = block
        if len(new) <= 8:  # a few (an admission's own blocks, a decode step's)
            registered = self.registered
            for block in new:
                registered[block] = True
        else:
            self.registered[new] = True

    def entries(self, blocks: list[int]) -> tuple[list[Hashable], list[object]]:
        """What :meth:`restore` needs to register ``blocks`` again after a :meth:`drop`: their
        keys and contents, in order."""
        if len(blocks) > 1:  # gathered at C speed
            pick = itemgetter(*blocks)
            return list(pick(self._key_of)), list(pick(self._content_of))
        return [self._key_of[b] for b in blocks], [self._content_of[b] for b in blocks]

    def drop(self, blocks: np.ndarray) -> None:
        """Unregister ``blocks`` (evicted; the caller records the undo with :meth:`entries`)."""
        self.registered[blocks] = False
        block_of, key_of, content_of = self._block_of, self._key_of, self._content_of
        for block in blocks.tolist():
            del block_of[key_of[block]]
            key_of[block] = content_of[block] = None

    def restore(self, blocks: np.ndarray, keys: list[Hashable], contents: list[object]) -> None:
        """Register ``blocks`` again under what :meth:`entries` gave (a rollback)."""
        for block, key, content in zip(blocks.tolist(), keys, contents, strict=True):
            self._block_of[key] = block
            self._key_of[block], self._content_of[block] = key, content
        self.registered[blocks] = True

    def check(self, states: list[str]) -> None:
        """Check the map against each block's state (``"free"``, ``"evictable"`` or ``"used"``);
        ``AssertionError`` names the first break."""
        for block, state in enumerate(states):
            key = self._key_of[block]
            require(
                bool(self.registered[block]) == (key is not None),
                f"block {block}'s registered flag disagrees with its key",
            )
            require(state != "free" or key is None, f"free block {block} is still registered")
            require(state != "evictable" or key is not None, f"evictable block {block} has no key")
        for key, block in self._block_of.items():
            require(
                self._key_of[block] == key,
                f"the prefix map sends {key!r} to block {block}, registered as "
                f"{self._key_of[block]!r}",
            )
        registered = sum(key is not None for key in self._key_of)
        require(
            registered == len(self._block_of),
            f"{registered} blocks are registered but the prefix map has {len(self._block_of)}",
        )

    def _unregister(self, blocks: list[int]) -> None:
        for block in blocks:
            key = self._key_of[block]
            if key is not None and self._block_of.get(key) == block:
                del self._block_of[key]
            self._key_of[block] = self._content_of[block] = None
        self.registered[blocks] = False
