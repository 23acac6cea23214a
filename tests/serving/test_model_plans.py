"""The project's own model plans its attention once per step (issue 22): one ``PrefillPlan`` per
prefill or mixed step, one ``DecodePlan`` per decode step, shared by every layer.

A small Llama with random weights runs through its public paths (``prefill``, ``decode``,
``forward`` for chunked and decode-only mixed steps, and ``generate``) while the constructions of
the two public plan classes are counted; every step's logits are compared with a float64 forward
over the whole sequence that shares no code with :mod:`cupaged.models.llama` (GGUF row order,
adjacent rotary pairs, no cache), through the tolerance table.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TOLERANCES

import cupaged
from cupaged import to_numpy
from cupaged.models import Llama, LlamaConfig, generate

CONFIG = LlamaConfig(
    num_layers=3,
    hidden=256,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=64,
    ffn=192,
    vocab_size=101,
    rms_eps=1e-5,
    rope_base=10000.0,
)


def random_weights(seed: int) -> dict[str, np.ndarray]:
    """GGUF-named float32 weights, scaled so that activations stay near unit size."""
    rng = np.random.default_rng(seed)
    c = CONFIG

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    weights = {
        "token_embd.weight": rng.standard_normal((c.vocab_size, c.hidden)).astype(np.float32),
        "output_norm.weight": norm(c.hidden),
    }
    weights["output.weight"] = matrix(c.vocab_size, c.hidden)
    q_rows, kv_rows = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        layer = {
            "attn_norm": norm(c.hidden),
            "attn_q": matrix(q_rows, c.hidden) * np.float32(2.0),  # a sharper softmax
            "attn_k": matrix(kv_rows, c.hidden) * np.float32(2.0),
            "attn_v": matrix(kv_rows, c.hidden),
            "attn_output": matrix(c.hidden, q_rows),
            "ffn_norm": norm(c.hidden),
            "ffn_gate": matrix(c.ffn, c.hidden),
            "ffn_up": matrix(c.ffn, c.hidden),
            "ffn_down": matrix(c.hidden, c.ffn),
        }
        weights.update({f"blk.{i}.{name}.weight": w for name, w in layer.items()})
    return weights


def float64_logits(weights: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """``[vocab]`` float64 logits after the last of ``tokens``: the whole sequence, causal, no
    cache, the GGUF rows as stored (llama.cpp's rotary convention: adjacent pairs)."""
    c, w = CONFIG, {name: x.astype(np.float64) for name, x in weights.items()}
    n, d = len(tokens), c.head_dim
    group = c.num_q_heads // c.num_kv_heads
    angles = np.arange(n)[:, None] * c.rope_base ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + c.rms_eps) * weight

    def rope(x):
        out = np.empty_like(x)
        even, odd = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
        return out

    x = w["token_embd.weight"][tokens]
    for i in range(c.num_layers):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(n, c.num_q_heads, d))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(n, c.num_kv_heads, d))
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, c.num_kv_heads, d)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    return rms(x[-1], w["output_norm.weight"]) @ w["output.weight"].T


def assert_logits_close(got, tokens: list[int], weights) -> None:
    """Normwise, as the real model's test: ``max|diff| <= atol + rtol * max|logits|``."""
    want = float64_logits(weights, tokens)
    tolerance = TOLERANCES["float32"]
    error = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    bound = tolerance["atol"] + tolerance["rtol"] * float(np.max(np.abs(want)))
    assert error <= bound, f"expected logits within {bound:.2e} of float64, got {error:.2e}"


@pytest.fixture
def plans(monkeypatch) -> dict[str, int]:
    """Constructions of the public plan classes, counted while the test runs."""
    counts = {"DecodePlan": 0, "PrefillPlan": 0}
    for cls in (cupaged.DecodePlan, cupaged.PrefillPlan):
        real = cls.__init__

        def init(self, *args, _real=real, _name=cls.__name__, **kwargs):
            counts[_name] += 1
            _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", init)
    return counts


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return random_weights(seed=7)


def test_each_path_builds_one_plan_per_step_and_matches_float64(weights, plans):
    model = Llama(CONFIG, weights, np, dtype="float32")
    cache = model.make_cache(num_blocks=48, block_size=16)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (37, 9)]

    # A prefill of two prompts: one PrefillPlan.
    admissions = [cache.admit(prompt) for prompt in prompts]
    logits = to_numpy(model.prefill(cache, admissions, prompts))
    assert plans == {"DecodePlan": 0, "PrefillPlan": 1}
    seqs = [list(p) for p in prompts]
    for seq, row in zip(seqs, logits, strict=True):
        assert_logits_close(row, seq, weights)
        seq.append(int(np.argmax(row)))

    # Decode steps: one DecodePlan each, whatever the layers.
    batch = cache.batch([a.sid for a in admissions])
    for step in range(3):
        logits = to_numpy(model.decode(cache, batch, [seq[-1] for seq in seqs]))
        assert plans == {"DecodePlan": step + 1, "PrefillPlan": 1}
        for seq, row in zip(seqs, logits, strict=True):
            assert_logits_close(row, seq, weights)
            seq.append(int(np.argmax(row)))

    # Mixed steps: a third prompt in two chunks beside the two decode rows (one PrefillPlan
    # each), then a step of decode rows only through forward (one DecodePlan).
    third = rng.integers(0, CONFIG.vocab_size, 21).tolist()
    sids = [cache.add_sequence(), *batch.sids.tolist()]
    done = 0
    for chunk in (third[:13], third[13:], None):
        new = [[] if chunk is None else chunk, *([seq[-1]] for seq in seqs)]
        if chunk is None:
            new[0] = [int(np.argmax(logits[0]))]
            third.append(new[0][0])
        starts = [done, *(len(seq) - 1 for seq in seqs)]
        step = cache.step(sids, num_tokens=[len(t) for t in new], tokens=new, tables=True)
        positions = np.concatenate(
            [np.arange(s, s + len(t)) for s, t in zip(starts, new, strict=True)]
        )
        rows = step.query_start_loc[1:] - 1
        logits = to_numpy(model.forward(cache, step, np.concatenate(new), positions, rows))
        done += len(new[0])
        assert_logits_close(logits[0], third[:done], weights)
        for seq, row in zip(seqs, logits[1:], strict=True):
            assert_logits_close(row, seq, weights)
            seq.append(int(np.argmax(row)))
    assert plans == {"DecodePlan": 4, "PrefillPlan": 3}
    cache.check_invariants()


def test_generate_builds_at_most_one_plan_per_step(weights, plans):
    """Greedy generation of one prompt, as ``cupaged generate`` runs it: a prefill, then a decode
    step per token, each one plan for every layer (issue 22's bar: at most 7 plans for 6
    tokens, where every layer used to build its own); the tokens are the float64 forward's
    greedy ones."""
    model = Llama(CONFIG, weights, np, dtype="float32")
    cache = model.make_cache(num_blocks=32, block_size=16)
    prompt = np.random.default_rng(3).integers(0, CONFIG.vocab_size, 18).tolist()
    new_tokens = 6
    [[generated]] = generate(model, cache, [prompt], new_tokens)
    assert plans["PrefillPlan"] == 1 and 1 <= plans["DecodePlan"] <= new_tokens - 1
    seq = list(prompt)
    for _ in range(new_tokens):
        seq.append(int(np.argmax(float64_logits(weights, seq))))
    assert generated == seq[len(prompt) :]
