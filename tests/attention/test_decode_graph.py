""":class:`cupaged.DecodeGraph`: a decode step (every layer's ``write_kv`` and ``DecodePlan.run``)
captured once and replayed after ``DecodePlan.update``.

On NumPy the graph replays eagerly; on the strict stand-in (``tests/strict_cupy.py``) the step is
captured as CUDA captures it (launches recorded, then replayed over the buffers' new contents) and
what a capture may not do raises; on a GPU it is a real CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, poison, random_array

import cupaged

LAYERS, HKV, GROUP, HEAD_DIM, BLOCK = 2, 2, 2, 64, 16
MAX_BLOCKS = 40  # 640 tokens per row: long enough for a step that splits
DTYPE = "float16"
# Each step's lengths: the first short (nothing splits when it is captured), later ones long, so
# that the replay merges pieces that the captured step had none of.
STEPS = ([1, 17, 5], [2, 300, 6], [3, 601, 16], [4, 602, 17])


class Step:
    """Static buffers of a batch, a plan over fixed tables and the step that reads them."""

    def __init__(self, xp, rng, cascade=False):
        self.xp, self.rng = xp, rng
        self.batch = len(STEPS[0])
        num_blocks = self.batch * MAX_BLOCKS + 3
        heads = HKV * GROUP
        shape = (LAYERS, num_blocks, HKV, BLOCK, HEAD_DIM)
        self.k_cache = xp.asarray(random_array(rng, shape, DTYPE))
        self.v_cache = xp.asarray(random_array(rng, shape, DTYPE))
        ids = rng.permutation(num_blocks)[: self.batch * MAX_BLOCKS].astype(np.int32)
        self.tables = ids.reshape(self.batch, MAX_BLOCKS)
        self.q = xp.zeros((LAYERS, self.batch, heads, HEAD_DIM), np.float16)
        self.k = xp.zeros((LAYERS, self.batch, HKV, HEAD_DIM), np.float16)
        self.v = xp.zeros_like(self.k)
        self.out = xp.zeros_like(self.q)
        self.slots = xp.zeros(self.batch, np.int32)
        self.fill(STEPS[0])
        # Checked: step 0 splits nothing.
        lens = xp.asarray(np.array(STEPS[0], np.int32))
        self.plan = cupaged.DecodePlan(
            xp.asarray(self.tables), lens, self.k_cache[0], heads, cascade=cascade
        )

    def fill(self, lens):
        """The step's new tokens and queries, in place; the slots of each row's last token."""
        xp, rng = self.xp, self.rng
        self.host = {name: random_array(rng, getattr(self, name).shape, DTYPE) for name in "qkv"}
        for name, values in self.host.items():
            getattr(self, name)[...] = xp.asarray(values)
        pos = np.array(lens) - 1
        rows = np.arange(self.batch)
        self.slots[...] = xp.asarray(self.tables[rows, pos // BLOCK] * BLOCK + pos % BLOCK)
        self.out[...] = xp.asarray(poison(self.out.shape, DTYPE))
        self.lens = np.array(lens, np.int32)

    def __call__(self):
        for i in range(LAYERS):
            cupaged.write_kv(
                self.k_cache[i], self.v_cache[i], self.k[i], self.v[i], self.slots, checked=False
            )
            self.plan.run(self.q[i], self.k_cache[i], self.v_cache[i], out=self.out[i])

    def check(self):
        """Each layer's output against the float64 oracle over the cache as written, and the
        new tokens' K/V in their slots."""
        k_cache, v_cache = (cupaged.to_numpy(c) for c in (self.k_cache, self.v_cache))
        out = cupaged.to_numpy(self.out)
        pos = self.lens - 1
        blocks = self.tables[np.arange(self.batch), pos // BLOCK]
        for i in range(LAYERS):
            np.testing.assert_array_equal(k_cache[i][blocks, :, pos % BLOCK], self.host["k"][i])
            np.testing.assert_array_equal(v_cache[i][blocks, :, pos % BLOCK], self.host["v"][i])
            expected = cupaged.reference_attention(
                self.host["q"][i], k_cache[i], v_cache[i], self.tables, self.lens,
                compute_dtype="float64",
            )  # fmt: skip
            assert_close(out[i], expected, DTYPE)


def device_of(xp) -> str:
    return "cpu" if xp is np else "cuda"


def test_replays_every_step_after_update(xp):
    rng = np.random.default_rng(11)
    step = Step(xp, rng)
    graph = cupaged.DecodeGraph(step, device_of(xp), plans=(step.plan,))  # runs step 0
    assert graph.captured == (xp is not np)
    step.check()
    for lens in STEPS[1:]:
        step.fill(lens)
        step.plan.update(xp.asarray(step.tables), xp.asarray(step.lens), checked=False)
        graph.replay()
        step.check()
    assert step.plan.work()[:, 0].tolist().count(1) > 1, "no step split: the merge went untested"


@pytest.mark.strict
def test_capture_refuses_an_allocation_and_a_host_read(xp):
    """Inside a capture: ``run`` without ``out=`` allocates, a checked ``write_kv`` computes and
    reads its verdict back, ``to_numpy`` reads the host: each is refused, and the next capture
    of a good step works."""
    if xp is np:
        pytest.skip("NumPy has no capture (the graph replays eagerly)")
    step = Step(xp, np.random.default_rng(12))

    def allocating():
        step.plan.run(step.q[0], step.k_cache[0], step.v_cache[0])

    def checking():  # its checks compute on the device and read the verdict back
        cupaged.write_kv(step.k_cache[0], step.v_cache[0], step.k[0], step.v[0], step.slots)

    def reading():
        step()
        cupaged.to_numpy(step.out)

    cases = ((allocating, "allocation"), (checking, "allocation|host read"), (reading, "host read"))
    for bad, what in cases:
        with pytest.raises(RuntimeError, match=what):
            cupaged.DecodeGraph(bad, "cuda")
    graph = cupaged.DecodeGraph(step, "cuda", plans=(step.plan,))  # a good one still captures
    assert graph.captured


def test_refuses_a_plan_with_a_cascade(xp):
    """Rows sharing their first blocks, planned with ``cascade=True`` (where it can plan one):
    the graph refuses the plan before it runs the step."""
    step = Step(xp, np.random.default_rng(13), cascade=True)
    step.tables[:, :2] = step.tables[0, :2]  # every row shares its first two blocks
    lens = np.full(step.batch, 40, np.int32)
    host = {"host_tables": (step.tables, lens)} if xp is not np else {}
    step.plan.update(xp.asarray(step.tables), xp.asarray(lens), checked=False, **host)
    if step.plan.cascade is None:
        pytest.skip("this device planned no cascade for the shared rows")
    calls = []
    with pytest.raises(ValueError, match="cascade=False"):
        cupaged.DecodeGraph(lambda: calls.append(1), device_of(xp), plans=(step.plan,))
    assert calls == []


def test_refuses_an_unknown_device():
    with pytest.raises(ValueError, match=r"expected device one of \('cpu', 'cuda'\), got 'gpu'"):
        cupaged.DecodeGraph(lambda: None, "gpu")
