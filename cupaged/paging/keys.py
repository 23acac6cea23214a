"""The prefix-key map of a block pool: which full block holds which content.

A registered block is findable under its key (the prefix cache's hash of the tokens up to and
including the block) and stores a *content* that every hit is verified against (a second hash:
a key collision never serves another prompt's K/V). One key maps to one block: the first block
registered under a key keeps it.

A block registered with a *link*, its parent's content followed by its own token bytes (what the
prefix cache hashed into its content), is also found by that link: :meth:`KeyMap.follow` walks a
prompt's blocks from its root by lookups alone, each hit's content giving the next link::

    link_j = content of block j-1 (the root for j = 0) + tokens of block j
    block_j = the block registered with link_j; content of block_j = BLAKE2b(link_j)

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
        self._link_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[Hashable, int] = {}
        self._block_of_link: dict[bytes, int] = {}  # only registered blocks, as _block_of
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

    def follow(
        self, root: bytes, data: bytes, width: int, limit: int
    ) -> tuple[list[int], list[Hashable], list[object], list[bytes]]:
        """The registered blocks that hold ``data``'s blocks (``width`` bytes each, at most
        ``limit``) after the prefix whose content is ``root``, up to the first that none holds:
        a prompt's cached blocks, by one lookup each (the links are compared whole: exact).

        Returns:
            ``(blocks, keys, contents, links)`` of the blocks found, in order.
        """
        get, content_of = self._block_of_link.get, self._content_of
        blocks: list[int] = []
        parent, start = root, 0
        for end in range(width, (limit + 1) * width, width):
            block = get(parent + data[start:end])
            if block is None:
                break
            blocks.append(block)
            parent, start = content_of[block], end
        key_of, link_of = self._key_of, self._link_of
        if len(blocks) > 1:  # gathered at C speed
            pick = itemgetter(*blocks)
            return blocks, list(pick(key_of)), list(pick(content_of)), list(pick(link_of))
        if blocks:
            (block,) = blocks
            return blocks, [key_of[block]], [content_of[block]], [link_of[block]]
        return blocks, [], [], []

    def register_many(
        self,
        blocks: list[int],
        keys: Sequence[Hashable],
        contents: Sequence[object],
        refused: list[int] | None = None,
        links: Sequence[bytes] | None = None,
    ) -> None:
        """Register ``blocks[i]`` (in use, unchecked) under ``keys[i]``, holding ``contents[i]``
        (and found by ``links[i]`` too, when given); a key another block holds keeps that block
        (the first writer wins), and ``refused`` collects each such ``i``."""
        block_of, key_of, content_of = self._block_of, self._key_of, self._content_of
        link_of, block_of_link = self._link_of, self._block_of_link
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
            if links is not None:
                link_of[block] = link = links[i]
                block_of_link[link] = block
        if len(new) <= 8:  # a few (an admission's own blocks, a decode step's)
            registered = self.registered
            for block in new:
                registered[block] = True
        else:
            self.registered[new] = True

    def entries(self, blocks: list[int]) -> tuple[list[Hashable], tuple[list[object], list[Any]]]:
        """What :meth:`restore` needs to register ``blocks`` again after a :meth:`drop`: their
        keys, and their contents and links, in order."""
        if len(blocks) > 1:  # gathered at C speed
            pick = itemgetter(*blocks)
            return list(pick(self._key_of)), (pick(self._content_of), pick(self._link_of))
        return [self._key_of[b] for b in blocks], (
            [self._content_of[b] for b in blocks],
            [self._link_of[b] for b in blocks],
        )

    def drop(self, blocks: np.ndarray) -> None:
        """Unregister ``blocks`` (evicted; the caller records the undo with :meth:`entries`)."""
        self.registered[blocks] = False
        block_of, key_of, content_of = self._block_of, self._key_of, self._content_of
        block_of_link, link_of = self._block_of_link, self._link_of
        for block in blocks.tolist():
            del block_of[key_of[block]]
            key_of[block] = content_of[block] = None
            link = link_of[block]
            if link is not None:
                del block_of_link[link]
                link_of[block] = None

    def restore(
        self,
        blocks: np.ndarray,
        keys: list[Hashable],
        entries: tuple[Sequence[object], Sequence[Any]],
    ) -> None:
        """Register ``blocks`` again under what :meth:`entries` gave (a rollback)."""
        contents, links = entries
        for block, key, content, link in zip(blocks.tolist(), keys, contents, links, strict=True):
            self._block_of[key] = block
            self._key_of[block], self._content_of[block] = key, content
            if link is not None:
                self._link_of[block] = link
                self._block_of_link[link] = block
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
        for link, block in self._block_of_link.items():
            require(
                self._key_of[block] is not None and self._link_of[block] == link,
                f"the link map sends a link to block {block}, which is not registered with it",
            )
        linked = sum(link is not None for link in self._link_of)
        require(
            linked == len(self._block_of_link),
            f"{linked} blocks have a link but the link map has {len(self._block_of_link)}",
        )

    def _unregister(self, blocks: list[int]) -> None:
        for block in blocks:
            key, link = self._key_of[block], self._link_of[block]
            if key is not None and self._block_of.get(key) == block:
                del self._block_of[key]
            if link is not None and self._block_of_link.get(link) == block:
                del self._block_of_link[link]
            self._key_of[block] = self._content_of[block] = self._link_of[block] = None
        self.registered[blocks] = False
