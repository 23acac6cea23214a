"""The one serving engine and the one sampler (``cupaged.serving``), on their own.

The engine's bookkeeping is tested with a counting model (token ``t`` is followed by ``t + 1``, no
K/V computed), so that every token, finish and preemption is known in advance; the round trip of
K/V through a swap-out and back is tested with the demo's tiny model, greedy, against a run that
never swaps.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import cupaged
import cupaged.demo.engine
import cupaged.serving.engine
import cupaged.serving.sampling
from cupaged import OutOfBlocksError, PagedCache
from cupaged.demo import DemoConfig, ModelConfig, TinyDecoder
from cupaged.models import Sampling
from cupaged.serving import Engine, Request, Sampler, ServeStats

VOCAB = 32
BLOCK = 4


class CountingModel:
    """After token ``t`` the likeliest token is ``t + 1`` (mod ``VOCAB``): logits
    ``-|v - (t + 1)|``. It reserves what a model must (``step``, ``commit``) and computes no
    K/V."""

    def prefill(self, cache, admissions, prompts):
        cache.commit([a.sid for a in admissions])
        return self.logits([p[-1] for p in prompts])

    def decode(self, cache, batch, tokens):
        cache.step(batch, tokens=np.asarray(tokens))  # OutOfBlocksError, nothing reserved
        return self.logits(tokens)

    def forward(self, cache, plan, tokens, positions, rows):
        return self.logits(np.asarray(tokens)[np.asarray(rows)])

    @staticmethod
    def logits(last):
        target = (np.asarray(last) + 1) % VOCAB
        return -np.abs(np.arange(VOCAB)[None, :] - target[:, None]).astype(np.float32)


def counting_cache(num_blocks):
    return PagedCache(
        num_blocks,
        block_size=BLOCK,
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        dtype="float32",
        device="cpu",
        enable_prefix_caching=True,
    )


def counted(prompt, n):
    """The tokens the counting model generates greedily after ``prompt``."""
    return [(prompt[-1] + i) % VOCAB for i in range(1, n + 1)]


def assert_all_free(cache):
    cache.check_invariants()
    assert cache.num_free_blocks == cache.num_blocks, "expected every block free at the end"


# ---------------------------------------------------------------------------------- finishing


def test_a_request_finishes_at_its_max_new_tokens():
    cache = counting_cache(16)
    requests = [Request(0, [1, 2, 3], 5), Request(1, [7], 1), Request(2, [20, 21], 3)]
    result = Engine(CountingModel(), cache).run(requests)
    assert result.outputs == {(r.rid, 0): counted(r.prompt, r.max_new_tokens) for r in requests}
    # The request of one token finishes at its prefill; the others decode 4 and 2 steps.
    assert result.stats.prefills == 3 and result.stats.decode_steps == 4
    assert_all_free(cache)


def test_a_request_finishes_at_eos_with_the_eos_token_kept():
    cache = counting_cache(16)
    eos = 6  # the prompt [1, 2, 3] reaches it at its third token, [10] never does
    requests = [Request(0, [1, 2, 3], 8), Request(1, [10], 5)]
    result = Engine(CountingModel(), cache, eos_id=eos).run(requests)
    assert result.outputs == {(0, 0): [4, 5, 6], (1, 0): [11, 12, 13, 14, 15]}
    assert_all_free(cache)


def test_eos_as_the_first_token_finishes_at_admission():
    cache = counting_cache(16)
    result = Engine(CountingModel(), cache, eos_id=4).run([Request(0, [3], 9, num_samples=2)])
    assert result.outputs == {(0, 0): [4], (0, 1): [4]}
    assert result.stats.decode_steps == 0
    assert_all_free(cache)


# ---------------------------------------------------------------------------------- preemption


def test_preemption_swaps_out_the_newest_sequence_and_brings_it_back():
    """Three requests that grow to 4 blocks each in a pool of 8: the newest is swapped out while
    the others grow, comes back when they finish, and every output is what a roomy pool gives."""
    requests = [Request(i, [4 * i + 1, 4 * i + 2, 4 * i + 3], 12, arrival_step=i) for i in range(3)]
    roomy = Engine(CountingModel(), counting_cache(64)).run(requests)
    assert roomy.stats.swap_outs == 0

    cache = counting_cache(8)
    swapped_out, states = [], []
    real_swap_out = cache.swap_out

    def spy(sid):
        swapped_out.append(sid)
        real_swap_out(sid)

    cache.swap_out = spy
    result = Engine(CountingModel(), cache).run(requests, on_step=states.append)
    assert result.outputs == roomy.outputs
    assert result.stats.swap_outs >= 1 and result.stats.swap_ins == result.stats.swap_outs
    # The first victim is the sequence admitted last (request 2's, admitted at step 2).
    newest = max(seq.sid for seq in states[2].running)
    assert swapped_out[0] == newest
    assert max(s.num_swapped for s in states) >= 1 and states[-1].num_swapped == 0
    assert_all_free(cache)


@pytest.mark.parametrize("prefill_chunk", [None, 5], ids=["whole", "chunked"])
def test_swapped_kv_comes_back_intact(prefill_chunk):
    """The tiny model, greedy: a pool that forces swapping generates what a roomy one does."""
    model = TinyDecoder(ModelConfig(), np, seed=3)
    rng = np.random.default_rng(5)
    requests = [
        Request(i, rng.integers(0, 256, n).tolist(), 14, num_samples=1 + (i == 1))
        for i, n in enumerate([13, 9, 20])
    ]
    runs = {}
    for num_blocks in (40, 7):
        cache = model.make_cache(num_blocks, 8)
        engine = Engine(model, cache, max_batch=4, prefill_chunk=prefill_chunk)
        runs[num_blocks] = engine.run(requests)
        assert_all_free(cache)
    assert runs[40].stats.swap_outs == 0 and runs[7].stats.swap_outs >= 1
    assert runs[7].stats.swap_ins == runs[7].stats.swap_outs
    assert runs[7].outputs == runs[40].outputs


def test_a_sequence_that_outgrows_the_pool_alone_raises():
    cache = counting_cache(2)  # 8 slots
    with pytest.raises(OutOfBlocksError):
        Engine(CountingModel(), cache).run([Request(0, [1, 2, 3], 10)])


def test_a_prompt_larger_than_the_pool_raises():
    cache = counting_cache(2)
    with pytest.raises(OutOfBlocksError):
        Engine(CountingModel(), cache).run([Request(0, list(range(9)), 1)])
    assert_all_free(cache)


# ---------------------------------------------------------------------------------- batching


def test_the_batch_stays_within_max_batch_and_forks_share_the_prompt():
    cache = counting_cache(64)
    requests = [
        Request(0, list(range(9)), 4, num_samples=3),
        Request(1, [5], 4),
        Request(2, [9, 9], 4),
    ]
    states = []
    result = Engine(CountingModel(), cache, max_batch=3).run(requests, on_step=states.append)
    assert max(len(s.running) for s in states) == 3
    assert result.stats.fork_shared_blocks == 2 * (9 // BLOCK)
    for request in requests:
        for sample in range(request.num_samples):
            assert result.outputs[(request.rid, sample)] == counted(request.prompt, 4)
    generated = [s.tokens_generated for s in states]
    assert generated == sorted(generated) and generated[-1] == 5 * 4
    assert_all_free(cache)


class GroupRecorder(CountingModel):
    """Records the prompts of every prefill call."""

    def __init__(self):
        self.groups = []

    def prefill(self, cache, admissions, prompts):
        self.groups.append([p[-1] for p in prompts])
        return super().prefill(cache, admissions, prompts)


def test_prompts_admitted_together_are_prefilled_together():
    model, cache = GroupRecorder(), counting_cache(64)
    requests = [Request(i, [i, i + 1, 10 + i], 3) for i in range(4)]
    result = Engine(model, cache).run(requests)
    assert model.groups == [[10, 11, 12, 13]] and result.stats.prefills == 4
    assert result.outputs == {(r.rid, 0): counted(r.prompt, 3) for r in requests}
    assert_all_free(cache)


def test_a_prompt_sharing_a_first_block_waits_for_the_group_and_attaches_it():
    model, cache = GroupRecorder(), counting_cache(64)
    shared = list(range(8))  # two full blocks
    requests = [Request(0, shared + [30], 2), Request(1, [20], 2), Request(2, shared + [31, 29], 2)]
    stats = ServeStats()
    Engine(model, cache).run(requests, stats=stats)
    assert model.groups == [[30, 20], [29]]  # one step: two prefills, the second attaching
    assert stats.prefix_cached_tokens == 8 and stats.prefills == 3 and stats.steps == 1
    assert_all_free(cache)


def test_a_prompt_that_does_not_fit_beside_the_group_is_decided_on_what_it_left():
    """The first prompt ends at its first token (EOS): its blocks are free again when the next
    prompt, which did not fit beside it, is decided again, in the same step."""
    model, cache = GroupRecorder(), counting_cache(6)
    requests = [Request(0, list(range(12)), 4), Request(1, list(range(20, 32)), 4)]
    result = Engine(model, cache, eos_id=12).run(requests)
    assert model.groups == [[11], [31]]  # 3 + 3 blocks, +1 each: not both at once
    assert result.outputs == {(0, 0): [12], (1, 0): counted(requests[1].prompt, 4)}
    assert result.stats.steps == 3  # both prefilled in the first step, then 3 decode steps
    assert_all_free(cache)


def test_chunked_prefill_computes_prompts_in_chunks_beside_decode_tokens():
    requests = [Request(0, list(range(11)), 3), Request(1, [5, 6], 6)]
    whole = Engine(CountingModel(), counting_cache(32)).run(requests)
    cache = counting_cache(32)
    chunked = Engine(CountingModel(), cache, prefill_chunk=4).run(requests)
    assert chunked.outputs == whole.outputs
    assert chunked.stats.prefill_chunks == 3 + 1 and chunked.stats.prefills == 0
    assert_all_free(cache)


def test_on_logits_sees_the_row_of_every_token_before_it_is_chosen():
    seen = []
    result = Engine(CountingModel(), counting_cache(16)).run(
        [Request(0, [1, 2], 3, num_samples=2)],
        on_logits=lambda seq, row: seen.append((seq.sample, len(seq.generated), int(row.argmax()))),
    )
    assert sorted(seen) == [(s, i, 3 + i) for s in (0, 1) for i in range(3)]
    assert result.outputs == {(0, 0): [3, 4, 5], (0, 1): [3, 4, 5]}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"prefill_chunk": 0}, "prefill_chunk: expected at least 1 token, got 0"),
        ({"max_batch": 0}, "max_batch: expected at least 1 sequence, got 0"),
    ],
)
def test_the_engine_refuses_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        Engine(CountingModel(), counting_cache(4), **options)


@pytest.mark.parametrize(
    "args, message",
    [
        (([], 4), "expected a prompt of at least one token, got an empty prompt 0"),
        (([1], 0), "expected max_new_tokens >= 1, got 0"),
        (([1], 2, 0), "expected at least 1 sample per request, got 0"),
    ],
)
def test_a_request_is_checked_when_it_is_made(args, message):
    with pytest.raises(ValueError, match=message):
        Request(0, *args)


# ---------------------------------------------------------------------------------- sampler

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 3.0, 0.5], np.float32)


def softmax(logits, temperature):
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def test_greedy_takes_the_first_largest_logit_whatever_the_seed():
    for seed in range(3):
        sampler = Sampler(seed=seed)
        assert sampler.sample(LOGITS, sampler.generator(0, 0)) == 1  # 1 and 4 tie: the first


def test_temperature_sampling_draws_from_the_softmax_with_the_samples_own_stream():
    sampler = Sampler(temperature=0.7, seed=11)
    rng = sampler.generator(rid=2, sample=1)
    drawn = [sampler.sample(LOGITS, rng) for _ in range(4000)]
    # The same draws as rng.choice over the softmax, from the same seeded stream.
    reference = np.random.default_rng([11, 2, 1])
    p = softmax(LOGITS, 0.7)
    assert drawn == [int(reference.choice(len(p), p=p)) for _ in range(4000)]
    frequencies = np.bincount(drawn, minlength=len(LOGITS)) / len(drawn)
    np.testing.assert_allclose(frequencies, p, atol=0.03)
    # Another sample's stream gives other tokens.
    other = sampler.generator(rid=2, sample=0)
    assert [sampler.sample(LOGITS, other) for _ in range(50)] != drawn[:50]


def test_top_k_keeps_only_the_k_likeliest_tokens():
    sampler = Sampler(temperature=1.0, top_k=3, seed=4)
    rng = sampler.generator(0, 0)
    drawn = np.array([sampler.sample(LOGITS, rng) for _ in range(3000)])
    assert set(drawn.tolist()) == {1, 2, 4}  # 3.0, 3.0, 2.5
    p = softmax(LOGITS, 1.0)[[1, 2, 4]]
    np.testing.assert_allclose(
        np.bincount(drawn, minlength=6)[[1, 2, 4]] / 3000, p / p.sum(), atol=0.03
    )
    one = Sampler(temperature=5.0, top_k=1, seed=4)
    assert {one.sample(LOGITS, rng) for _ in range(100)} == {1}  # greedy, at any temperature


def test_top_p_keeps_the_nucleus():
    p = softmax(LOGITS, 1.0)  # ranked: 1, 4 (0.35 each), 2 (0.21), 0 (0.05), ...
    sampler = Sampler(temperature=1.0, top_p=0.8, seed=2)
    rng = sampler.generator(0, 0)
    drawn = {sampler.sample(LOGITS, rng) for _ in range(2000)}
    assert drawn == {1, 2, 4}, (drawn, p)
    tiny = Sampler(temperature=1.0, top_p=1e-6)
    assert {tiny.sample(LOGITS, rng) for _ in range(100)} == {1}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"temperature": -0.1}, "expected a finite temperature >= 0"),
        ({"top_p": 0.0}, r"expected 0 < top_p <= 1"),
        ({"top_p": 1.5}, r"expected 0 < top_p <= 1"),
        ({"top_k": -1}, "expected top_k >= 0"),
    ],
)
def test_the_sampler_refuses_bad_settings(options, message):
    with pytest.raises(ValueError, match=message):
        Sampler(**options)


# ---------------------------------------------------------------------------------- docs


@pytest.mark.parametrize(
    "module", [cupaged.serving.engine, cupaged.serving.sampling, cupaged.demo.engine]
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


def test_serving_is_a_public_subpackage_on_the_public_api():
    assert "serving" not in cupaged.__all__  # a subpackage, like cupaged.models
    assert {"Engine", "Request", "Sampler", "ServeResult"} <= set(cupaged.serving.__all__)


def test_the_demo_and_generate_serve_through_the_one_engine(monkeypatch):
    from cupaged.demo import DemoConfig, run_demo
    from cupaged.models import generate

    runs = []
    real_run = Engine.run

    def spy(self, requests, *args, **kwargs):
        runs.append(len(requests))
        return real_run(self, requests, *args, **kwargs)

    monkeypatch.setattr(Engine, "run", spy)
    config = DemoConfig(device="cpu", requests=3, new_tokens=4, prompt_len=12, num_blocks=40)
    demo = run_demo(config)
    model = TinyDecoder(ModelConfig(), np, seed=config.seed)
    outputs = generate(model, model.make_cache(40, 16), [[1, 2, 3], [4, 5]], max_new_tokens=3)
    assert runs == [3, 2]
    assert demo.summary["checks"]["passed"] and [len(o[0]) for o in outputs] == [3, 3]


@pytest.mark.parametrize(
    "make",
    [
        lambda: Sampler(temperature=float("nan")),
        lambda: Sampler(temperature=float("inf")),
        lambda: Sampler(seed=-1),
        lambda: Sampling(temperature=float("nan")),
        lambda: DemoConfig(temperature=float("nan")),
        lambda: DemoConfig(seed=-1),
    ],
)
def test_settings_the_command_line_refuses_are_refused_by_the_library_too(make):
    with pytest.raises(ValueError, match="expected"):
        make()
