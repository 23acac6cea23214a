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
NAN, INF = float("nan"), float("inf")


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
    "options, error, message",
    [
        ({"prefill_chunk": 0}, ValueError, "prefill_chunk: expected at least 1 token, got 0"),
        ({"max_batch": 0}, ValueError, "max_batch: expected at least 1 sequence, got 0"),
        ({"eos_id": -1}, ValueError, "eos_id: expected a token id >= 0, got -1"),
        ({"max_batch": NAN}, TypeError, "expected max_batch to be an int, got float"),
        ({"max_batch": 2.5}, TypeError, "expected max_batch to be an int, got float"),
        ({"max_batch": True}, TypeError, "expected max_batch to be an int, got True"),
        ({"prefill_chunk": 2.5}, TypeError, "expected prefill_chunk to be an int, got float"),
        ({"prefill_chunk": INF}, TypeError, "expected prefill_chunk to be an int, got float"),
        ({"eos_id": 2.0}, TypeError, "expected eos_id to be an int, got float"),
    ],
)
def test_the_engine_refuses_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        Engine(CountingModel(), counting_cache(4), **options)


def test_the_engine_takes_numpy_ints_as_ints():
    engine = Engine(
        CountingModel(), counting_cache(8), max_batch=np.int64(2), prefill_chunk=np.int32(3)
    )
    assert (engine.max_batch, engine.prefill_chunk) == (2, 3)
    assert type(engine.max_batch) is int and type(engine.prefill_chunk) is int


@pytest.mark.parametrize(
    "args, message",
    [
        (([], 4), "expected a prompt of at least one token, got an empty prompt 0"),
        (([1], 0), "expected max_new_tokens >= 1, got 0"),
        (([1], 2, 0), "expected num_samples >= 1, got 0"),
        (([1], 2, 1, -1), "expected arrival_step >= 0, got -1"),
    ],
)
def test_a_request_is_checked_when_it_is_made(args, message):
    with pytest.raises(ValueError, match=message):
        Request(0, *args)


BAD_COUNTS = [NAN, INF, -INF, 2.5, 3.0, True, "3", None]


@pytest.mark.parametrize("field", ["rid", "max_new_tokens", "num_samples", "arrival_step"])
@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
def test_a_request_refuses_counts_that_are_not_ints(field, value):
    """nan or inf as an arrival step made the engine wait for it forever; 2.5 tokens or
    samples failed half-way through a run."""
    good = {"rid": 0, "prompt": [1, 2], "max_new_tokens": 3, "num_samples": 1, "arrival_step": 0}
    shown = "True" if value is True else type(value).__name__
    with pytest.raises(TypeError, match=f"expected {field} to be an int, got {shown}"):
        Request(**{**good, field: value})


def test_a_request_refuses_a_negative_id():
    with pytest.raises(ValueError, match="expected rid >= 0, got -1"):
        Request(-1, [1], 2)


def test_a_request_takes_numpy_ints_as_ints():
    request = Request(np.int64(4), [1], np.int32(2), np.uint8(3), arrival_step=np.int64(10**12))
    assert (request.rid, request.max_new_tokens, request.num_samples) == (4, 2, 3)
    assert request.arrival_step == 10**12
    counts = (request.rid, request.max_new_tokens, request.num_samples, request.arrival_step)
    assert all(type(n) is int for n in counts)


# ---------------------------------------------------------------------------------- a run's edges


def bounded(limit):
    """An ``on_step`` that records the states and fails the test past ``limit`` steps (an engine
    that steps through idle time would otherwise never return)."""
    states = []

    def on_step(state):
        states.append(state)
        assert len(states) <= limit, f"more than {limit} engine steps: the engine spins"

    return states, on_step


def test_an_idle_engine_skips_to_the_next_arrival_at_once(rng):
    far = 10**12 + int(rng.integers(10**6))
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 5, 2)]
    requests = [
        Request(0, prompts[0], 3),
        Request(1, prompts[1], 4, arrival_step=far),
        Request(2, prompts[2], 2, num_samples=2, arrival_step=far + 7),
    ]
    cache = counting_cache(16)
    states, on_step = bounded(20)
    result = Engine(CountingModel(), cache).run(requests, on_step=on_step)
    assert result.outputs == {
        (r.rid, s): counted(r.prompt, r.max_new_tokens)
        for r in requests
        for s in range(r.num_samples)
    }
    # A step prefills and decodes: request 0 (3 tokens) runs in steps 0 and 1, request 1 (4) in
    # far .. far + 2, request 2 (2) in far + 7; the idle steps between are not run.
    assert [s.step for s in states] == [0, 1, far, far + 1, far + 2, far + 7]
    assert result.stats.steps == len(states)
    assert_all_free(cache)


def test_an_engine_idle_from_the_start_waits_no_step(rng):
    prompt = rng.integers(0, VOCAB, 4).tolist()
    states, on_step = bounded(5)
    result = Engine(CountingModel(), counting_cache(8)).run(
        [Request(3, prompt, 2, arrival_step=10**15)], on_step=on_step
    )
    assert result.outputs == {(3, 0): counted(prompt, 2)}
    assert [s.step for s in states] == [10**15]  # its prefill and the decode of token 2


def live_state(cache):
    """What a run must leave as it found: the live sequences, their lengths, the free blocks."""
    cache.check_invariants()
    sids = cache.sequence_ids
    return sids, [cache.seq_len(sid) for sid in sids], cache.num_free_blocks


def cache_with_a_bystander(rng, num_blocks, prompt=None):
    """A cache holding one sequence of the caller's own (of ``prompt``, else a random one), made
    before the run."""
    cache = counting_cache(num_blocks)
    if prompt is None:
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 2 * BLOCK))).tolist()
    cache.commit(cache.admit(prompt).sid)
    return cache


@pytest.mark.parametrize(
    "requests",
    [
        [Request(0, [1, 2], 3), Request(0, [5], 2)],
        [Request(4, [1, 2], 3), Request(1, [5], 2), Request(4, [7], 2, arrival_step=9)],
    ],
    ids=["same-step", "later-arrival"],
)
def test_duplicate_request_ids_are_refused_before_anything_runs(rng, requests):
    """Outputs are keyed by ``(rid, sample)``: a second request of one id overwrote the first's."""
    cache = cache_with_a_bystander(rng, 16)
    before = live_state(cache)
    model = GroupRecorder()
    rid = requests[-1].rid
    with pytest.raises(ValueError, match=f"expected distinct request ids .*, got {rid} twice"):
        Engine(model, cache).run(requests)
    assert model.groups == [] and live_state(cache) == before


def test_a_run_refuses_what_is_not_a_request(rng):
    cache = cache_with_a_bystander(rng, 8)
    before = live_state(cache)
    with pytest.raises(TypeError, match="expected Request objects in requests, got tuple"):
        Engine(CountingModel(), cache).run([Request(0, [1], 2), (1, [2], 2)])
    assert live_state(cache) == before


class Failing(CountingModel):
    """Raises ``error`` at the ``at``-th call (from 0) of ``method``, after the call reserved
    and committed what it does."""

    def __init__(self, method, at, error):
        self.method, self.at, self.error, self.calls = method, at, error, 0

    def after(self, method, logits):
        if method == self.method:
            self.calls += 1
            if self.calls > self.at:
                raise self.error
        return logits

    def prefill(self, *args):
        return self.after("prefill", super().prefill(*args))

    def decode(self, *args):
        return self.after("decode", super().decode(*args))

    def forward(self, *args):
        return self.after("forward", super().forward(*args))


def busy_workload(rng):
    """Prompts sharing a prefix, several samples, staggered arrivals: in a pool of 10 blocks
    the run forks, preempts and swaps back in."""
    shared = rng.integers(0, VOCAB, 2 * BLOCK).tolist()
    return [
        Request(0, shared + rng.integers(0, VOCAB, 3).tolist(), 9, num_samples=2),
        Request(1, rng.integers(0, VOCAB, 6).tolist(), 10, arrival_step=1),
        Request(2, shared + rng.integers(0, VOCAB, 1).tolist(), 8, arrival_step=1),
        Request(3, rng.integers(0, VOCAB, 2).tolist(), 12, num_samples=3, arrival_step=3),
    ]


@pytest.mark.parametrize(
    "prefill_chunk, method, at",
    [(None, "prefill", 0), (None, "prefill", 2), (None, "decode", 4), (3, "forward", 0)]
    + [(3, "forward", 5)],
)
def test_a_run_the_model_fails_frees_what_it_added(rng, prefill_chunk, method, at):
    """The model raising mid-run (on a group of prompts just prefilled, on a batch with forks
    and swapped-out sequences): the cache is as before the run, the caller's sequence kept."""
    requests = busy_workload(rng)
    cache = cache_with_a_bystander(rng, 12)
    before = live_state(cache)
    model = Failing(method, at, RuntimeError("the model failed"))
    engine = Engine(model, cache, prefill_chunk=prefill_chunk)
    with pytest.raises(RuntimeError, match="the model failed"):
        engine.run(requests)
    assert model.calls == at + 1
    assert live_state(cache) == before
    # The engine serves the next run as if the failed one had not been.
    model.at = 10**9
    result = engine.run(requests)
    assert result.outputs == {
        (r.rid, s): counted(r.prompt, r.max_new_tokens)
        for r in requests
        for s in range(r.num_samples)
    }
    assert live_state(cache) == before


@pytest.mark.parametrize("prefill_chunk", [None, 3], ids=["whole", "chunked"])
def test_a_run_interrupted_at_any_token_frees_what_it_added(rng, prefill_chunk):
    """Ctrl-C (or a callback raising) as a token of the run is chosen: the first, between the
    forks of a prompt, with sequences swapped out, the last."""
    requests = busy_workload(rng)
    prompt = rng.integers(0, VOCAB, int(rng.integers(1, 2 * BLOCK))).tolist()
    # An uninterrupted run says which tokens are chosen while a sequence is swapped out.
    cache = cache_with_a_bystander(rng, 12, prompt)
    swapped = []
    Engine(CountingModel(), cache, prefill_chunk=prefill_chunk).run(
        requests,
        on_logits=lambda seq, row: swapped.append(any(map(cache.is_swapped, cache.sequence_ids))),
    )
    while_swapped = np.flatnonzero(swapped)
    assert while_swapped.size, "the workload never swaps a sequence out"
    total = len(swapped)
    stops = {0, 1, total - 1, *rng.integers(2, total - 1, 4).tolist()}
    stops |= set(rng.choice(while_swapped, 2).tolist())
    for stop in sorted(stops):
        cache = cache_with_a_bystander(rng, 12, prompt)
        before = live_state(cache)
        seen = []

        def interrupt(seq, logits, stop=stop, seen=seen):
            if len(seen) == stop:
                raise KeyboardInterrupt
            seen.append(seq.sid)

        with pytest.raises(KeyboardInterrupt):
            Engine(CountingModel(), cache, prefill_chunk=prefill_chunk).run(
                requests, on_logits=interrupt
            )
        assert live_state(cache) == before, f"interrupted at token {stop}"


@pytest.mark.parametrize("prefill_chunk", [None, 2], ids=["whole", "chunked"])
def test_a_run_whose_sequence_outgrows_the_pool_frees_what_it_added(rng, prefill_chunk):
    cache = cache_with_a_bystander(rng, 6)
    before = live_state(cache)
    requests = [Request(0, [1, 2], 4, num_samples=2), Request(1, [1, 2, 3], 6 * BLOCK)]
    with pytest.raises(OutOfBlocksError):
        Engine(CountingModel(), cache, prefill_chunk=prefill_chunk).run(requests)
    assert live_state(cache) == before


def test_a_run_whose_on_step_raises_frees_what_it_added(rng):
    cache = cache_with_a_bystander(rng, 12)
    before = live_state(cache)
    states = []

    def on_step(state):
        states.append(state)
        if state.num_swapped:
            raise ValueError("the observer failed")

    with pytest.raises(ValueError, match="the observer failed"):
        Engine(CountingModel(), cache).run(busy_workload(rng), on_step=on_step)
    assert states[-1].num_swapped >= 1 and live_state(cache) == before


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
    "options, error, message",
    [
        ({"temperature": -0.1}, ValueError, "expected a finite temperature >= 0"),
        ({"top_p": 0.0}, ValueError, r"expected 0 < top_p <= 1"),
        ({"top_p": 1.5}, ValueError, r"expected 0 < top_p <= 1"),
        ({"top_p": NAN}, ValueError, r"expected 0 < top_p <= 1, got nan"),
        ({"top_k": -1}, ValueError, "expected top_k >= 0"),
        ({"top_k": 2.5}, TypeError, "expected top_k to be an int, got float"),
        ({"top_k": True}, TypeError, "expected top_k to be an int, got True"),
        ({"seed": 1.5}, TypeError, "expected seed to be an int, got float"),
        ({"seed": NAN}, TypeError, "expected seed to be an int, got float"),
        ({"temperature": "0.7"}, TypeError, "expected temperature to be a real number, got str"),
        ({"temperature": 1j}, TypeError, "expected temperature to be a real number, got complex"),
        ({"temperature": True}, TypeError, "expected temperature to be a real number, got bool"),
        ({"top_p": None}, TypeError, "expected top_p to be a real number, got NoneType"),
    ],
)
def test_the_sampler_refuses_bad_settings(options, error, message):
    with pytest.raises(error, match=message):
        Sampler(**options)


def test_the_sampler_takes_numpy_numbers():
    sampler = Sampler(
        temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(3), seed=np.uint32(7)
    )
    assert (sampler.temperature, sampler.top_p, sampler.top_k, sampler.seed) == (0.5, 0.9, 3, 7)
    assert type(sampler.temperature) is float and type(sampler.top_k) is int


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-300, 1e-30])
def test_a_tiny_temperature_samples_among_the_largest_logits(rng, temperature):
    """The limit of the softmax as the temperature goes to 0: the largest logits, equally. Dividing
    before subtracting the largest logit made 1e-320 give NaN probabilities."""
    logits = rng.normal(0, 3, 50).astype(np.float32)
    top = rng.choice(50, 2, replace=False)
    logits[top] = logits.max() + 1.0  # two tokens tie for the largest
    sampler = Sampler(temperature=temperature, seed=int(rng.integers(1000)))
    stream = sampler.generator(0, 0)
    drawn = [sampler.sample(logits, stream) for _ in range(200)]
    assert set(drawn) == set(top.tolist())
    # Through the engine: the counting model's largest logit is unique, so it runs greedy.
    requests = [Request(0, [3, 4], 6), Request(1, [9], 4, num_samples=2)]
    result = Engine(CountingModel(), counting_cache(16), sampler).run(requests)
    assert result.outputs == {
        (r.rid, s): counted(r.prompt, r.max_new_tokens)
        for r in requests
        for s in range(r.num_samples)
    }


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
