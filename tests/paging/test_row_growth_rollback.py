"""Rollbacks that must restore the sequence table exactly.

Growing the rows puts the new free rows at the head of the free-row list; the undo records of
the verbs made before the growth in the same call must still find their place in that list. A
step's undo names its rows: a batch replaced later in the same block must not move them.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import internals

from cupaged import BlockManager


@pytest.mark.parametrize("last", ["add_sequence", "fork_many"])
def test_a_rolled_back_call_that_grew_the_rows_keeps_every_row(last):
    rng = np.random.default_rng()
    m = BlockManager(256, 4, device="cpu")
    table = internals(m).table
    parent = m.add_sequence()
    m.step(parent, int(rng.integers(1, 9)))
    while True:  # fill the table's rows but one (the table starts with some free)
        sid = m.add_sequence()
        if not table.free_rows:  # (the add that took the last row: give it back)
            m.free(sid)
            break
    rows_before = table.tables.shape[0]
    ids_before = sorted(m.sequence_ids)
    with pytest.raises(RuntimeError, match="undo"):
        with m.transaction():
            m.add_sequence()  # the last free row
            if last == "add_sequence":
                m.add_sequence()  # grows the rows
            else:
                m.fork_many(parent, int(rng.integers(2, 5)))  # grows the rows
            assert table.tables.shape[0] > rows_before, "expected the rows to grow"
            raise RuntimeError("undo the block")
    assert sorted(m.sequence_ids) == ids_before
    m.check_invariants()  # every row is free or in use, none twice
    rows = table.tables.shape[0]
    for _ in range(rows - len(ids_before)):  # every free row can be taken again
        m.add_sequence()
    assert table.tables.shape[0] == rows, "expected the rows freed by the rollback reused"
    m.check_invariants()


def test_an_interrupt_while_the_table_widens_keeps_a_spare_column():
    """``held_bound`` (what decode steps trust for the spare column) stays an upper bound when
    Ctrl-C lands while a step widens the table: a decode step never writes past a row."""
    from test_interrupts import interrupted_at

    rng = np.random.default_rng()
    m = BlockManager(400, 1, device="cpu")
    sids = [m.add_sequence() for _ in range(int(rng.integers(2, 5)))]
    batch = m.batch(sids)
    table = internals(m).table
    width = table.width
    with interrupted_at("make_room", "if held > self.held_bound:"):  # (reached by widening)
        for _ in range(2 * width):
            m.step(batch)
    tables = [m.block_table(sid) for sid in sids]
    for _ in range(2 * width):  # the decode path writes each new block into the spare column
        m.step(batch)
        m.check_invariants()
    after = [m.block_table(sid)[: len(before)] for sid, before in zip(sids, tables, strict=True)]
    assert after == tables, f"expected the blocks held before kept, got {after} for {tables}"


def test_a_rolled_back_step_of_a_batch_replaced_in_the_block_restores_its_rows():
    """A step's undo names the rows it grew: a ``replace`` later in the same block must not
    move them (the rollback would shrink the newcomer and leave the stepped row grown)."""
    rng = np.random.default_rng()
    m = BlockManager(64, 4, device="cpu")
    stepped = [m.add_sequence() for _ in range(3)]
    newcomer = m.add_sequence()
    m.step(newcomer, int(rng.integers(1, 9)))
    batch = m.batch(stepped)
    ids = [*stepped, newcomer]
    before = [(m.seq_len(s), m.block_table(s)) for s in ids]
    with pytest.raises(RuntimeError, match="undo"):
        with m.transaction():
            m.step(batch)
            batch.replace(int(rng.integers(0, 3)), newcomer)
            raise RuntimeError("undo the block")
    after = [(m.seq_len(s), m.block_table(s)) for s in ids]
    assert after == before, f"expected (length, blocks) {before} after the rollback, got {after}"
    m.check_invariants()
