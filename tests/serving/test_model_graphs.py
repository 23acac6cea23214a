"""The model's decode attention as CUDA graphs (``Llama.use_cuda_graphs``, docs/cuda-graphs.md).

On the strict CuPy stand-in (CUDA's paths, stream capture modelled) and on a GPU, a model with
graphs decodes step after step, with a batch whose size changes (a second set of graphs) and a
context that outgrows its table's width (new buffers), through ``decode`` and ``forward``: its
logits match the float64 forward of ``test_model_plans`` through the tolerance table. On the CPU
backend the option is refused with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_model_plans import CONFIG, assert_logits_close, random_weights

from cupaged import to_numpy
from cupaged.models import Llama


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return random_weights(seed=5)


def test_graphs_decode_as_plans_do(xp, weights):
    if xp is np:
        pytest.skip("the CPU backend refuses CUDA graphs (test_cpu_backend_refuses_graphs)")
    model = Llama(CONFIG, weights, xp, dtype="float32")
    model.use_cuda_graphs()
    cache = model.make_cache(num_blocks=64, block_size=4)
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (9, 3, 14)]
    admissions = [cache.admit(prompt) for prompt in prompts]
    logits = to_numpy(model.prefill(cache, admissions, prompts))
    seqs = [list(p) for p in prompts]
    for seq, row in zip(seqs, logits, strict=True):
        seq.append(int(np.argmax(row)))
    sids = [a.sid for a in admissions]
    batch = cache.batch(sids)
    for _ in range(5):  # decode: a SequenceBatch's tables (a width of its own)
        logits = to_numpy(model.decode(cache, batch, [seq[-1] for seq in seqs]))
        for seq, row in zip(seqs, logits, strict=True):
            assert_logits_close(row, seq, weights)
            seq.append(int(np.argmax(row)))
    cache.free(sids.pop())
    seqs.pop()
    for _ in range(9):  # forward, two rows: a step's tables, as wide as the longest (widened)
        new = [[seq[-1]] for seq in seqs]
        plan = cache.step(sids, num_tokens=[1, 1], tokens=new, tables=True)
        positions = np.array([len(seq) - 1 for seq in seqs])
        logits = to_numpy(model.forward(cache, plan, np.concatenate(new), positions, [0, 1]))
        for seq, row in zip(seqs, logits, strict=True):
            assert_logits_close(row, seq, weights)
            seq.append(int(np.argmax(row)))
    graphs = model.graphs
    # Captured: three rows; two rows at 4 blocks (16 tokens); at 8 blocks (the context of 17).
    assert graphs.captures == 3 * CONFIG.num_layers
    assert graphs.replays == 14 * CONFIG.num_layers - graphs.captures
    cache.check_invariants()


def test_graphs_follow_the_cache_they_decode(xp, weights):
    """A second cache with a batch of the same size: its steps must not replay the graphs
    captured on the first (they would write and read the first cache's K/V)."""
    if xp is np:
        pytest.skip("the CPU backend refuses CUDA graphs (test_cpu_backend_refuses_graphs)")
    model = Llama(CONFIG, weights, xp, dtype="float32")
    model.use_cuda_graphs()
    rng = np.random.default_rng(8)
    for _ in range(2):  # a fresh cache each round, the same batch size
        cache = model.make_cache(num_blocks=64, block_size=4)
        prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (5, 11, 7)]
        admissions = [cache.admit(prompt) for prompt in prompts]
        logits = to_numpy(model.prefill(cache, admissions, prompts))
        seqs = [[*p, int(np.argmax(row))] for p, row in zip(prompts, logits, strict=True)]
        batch = cache.batch([a.sid for a in admissions])
        for _ in range(2):
            logits = to_numpy(model.decode(cache, batch, [seq[-1] for seq in seqs]))
            for seq, row in zip(seqs, logits, strict=True):
                assert_logits_close(row, seq, weights)
                seq.append(int(np.argmax(row)))
        cache.check_invariants()
    assert model.graphs.captures == 2 * CONFIG.num_layers  # captured again for the new cache


def test_cpu_backend_refuses_graphs(weights):
    model = Llama(CONFIG, weights, np, dtype="float32")
    with pytest.raises(ValueError, match="CPU backend, which cannot capture CUDA graphs"):
        model.use_cuda_graphs()
    assert model.graphs is None
    model.use_cuda_graphs(False)  # turning it off is always fine
