"""SmolLM2-135M over an fp8 KV cache: ``cupaged generate --kv-dtype``, ``--kv-scales auto``, and
the model's logits against the float16 cache's.

The accuracy study (perplexity over 2,083 tokens, greedy agreement) is ``scripts/fp8-perplexity``
(docs/fp8.md); here the model runs a few steps, so that the wiring is checked in CI: the cache
is fp8, its scales are calibrated by the first prefill and stay fixed, and the next-token
distribution stays close to the float16 cache's (the only new error is the quantization of K/V).
The first run downloads the model, as ``tests/serving/test_real_model.py`` does.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cupaged import to_numpy
from cupaged.__main__ import main
from cupaged.models import GGUFFile, Llama, LlamaConfig, Tokenizer, generate, load_weights
from cupaged.models.fetch import fetch

PROMPT = "The capital of France is"
STEPS = 3
FORMATS = ["float8_e4m3", "float8_e5m2"]


@pytest.fixture(scope="module")
def loaded():
    file = GGUFFile(fetch("smollm2"))
    config = LlamaConfig.from_gguf(file)
    return config, load_weights(file, config), Tokenizer(file)


def _run(loaded, kv_dtype, kv_scales):
    """Greedy tokens and each step's logits of the prompt, and the cache they went through."""
    config, weights, tokenizer = loaded
    model = Llama(config, weights, np, dtype="float16", kv_dtype=kv_dtype)
    cache = model.make_cache(8, 16, kv_scales=kv_scales)
    rows = []
    out = generate(
        model,
        cache,
        [tokenizer.encode(PROMPT)],
        STEPS,
        eos_id=None,
        on_logits=lambda prompt, sample, row: rows.append(np.array(row, dtype=np.float64)),
    )
    cache.check_invariants()
    return out[0][0], np.array(rows), cache


@pytest.mark.parametrize("name", FORMATS)
def test_auto_scales_are_calibrated_by_the_prefill_and_fixed(loaded, name):
    config = loaded[0]
    _, _, cache = _run(loaded, name, "auto")
    assert cache.spec.dtype == name, f"expected an {name} cache, got {cache.spec.dtype}"
    for layer in range(config.num_layers):
        for which, scale in zip("kv", cache.kv_scales(layer), strict=True):
            s = to_numpy(scale)
            assert s.shape == (config.num_kv_heads,), (layer, which, s.shape)
            assert np.all(np.isfinite(s)) and np.all(s > 0), (layer, which, s)
            # amax / fp8 max of real activations: never the default 1.0, and far below it.
            assert np.all(s < 1.0), f"layer {layer} {which}: expected calibrated scales, got {s}"
    # Fixed after the first write: a second cache calibrated by the same prompt agrees exactly.
    _, _, again = _run(loaded, name, "auto")
    for layer in (0, config.num_layers - 1):
        for a, b in zip(cache.kv_scales(layer), again.kv_scales(layer), strict=True):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


@pytest.fixture(scope="module")
def float16_run(loaded):
    """The float16 cache's greedy tokens and logits, the fp8 runs' baseline."""
    tokens, logits, _ = _run(loaded, None, None)
    return tokens, logits


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("scales", [None, "auto"])
def test_fp8_logits_stay_near_the_float16_caches(loaded, float16_run, name, scales):
    tokens16, logits16 = float16_run
    tokens8, logits8, _ = _run(loaded, name, scales)
    assert logits8.shape == logits16.shape == (STEPS, loaded[0].vocab_size)
    # The prefill's step sees the same tokens in both: its distribution is compared directly.
    p16, p8 = (np.exp(x - x.max()) / np.exp(x - x.max()).sum() for x in (logits16[0], logits8[0]))
    tv = 0.5 * float(np.abs(p16 - p8).sum())
    # e5m2 keeps 2 mantissa bits (e4m3 3): over 30 layers its distance is chaotic in the last
    # bits of each layer's attention. The WMMA prefill and paged_prefill_flash, whose outputs on
    # the same inputs differ by a few ulps at most (mean 2e-9), gave e5m2 with auto scales 0.037
    # and 0.129, e4m3 0.024-0.053 and 0.021-0.043.
    limit = 0.2 if name == "float8_e5m2" else 0.1
    assert tv < limit, f"expected total variation < {limit} from the float16 cache's, got {tv:.3f}"
    assert tokens8[0] == tokens16[0], f"expected first token {tokens16[0]}, got {tokens8[0]}"
    assert not np.array_equal(logits8[0], logits16[0]), "the fp8 cache changed nothing"


def test_generate_command_over_fp8_with_auto_scales(tmp_path, capsys):
    out = tmp_path / "out.json"
    code = main(
        [
            *"generate --model smollm2 --device cpu --max-new-tokens 3 --kv-dtype".split(),
            "float8_e4m3",
            "--kv-scales",
            "auto",
            "--json",
            str(out),
            PROMPT,
        ]
    )
    assert code == 0, f"expected exit 0, got {code}: {capsys.readouterr().err}"
    result = json.loads(out.read_text())["results"][0]
    assert len(result["output_ids"]) == 3, result


@pytest.mark.parametrize(
    "options, words",
    [
        (["--kv-scales", "2.0"], "--kv-scales: expected an fp8 --kv-dtype"),
        (["--dtype", "float16", "--kv-dtype", "float32"], "--kv-dtype: expected --dtype"),
    ],
)
def test_generate_command_refuses_inconsistent_kv_options(capsys, options, words):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "smollm2", "--device", "cpu", *options, PROMPT])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and words in err, (exit_info.value.code, err)


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "big", "1e+39"])
def test_generate_command_refuses_a_bad_scale(capsys, bad):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "smollm2", "--kv-dtype", "float8_e4m3", "--kv-scales", bad])
    err = capsys.readouterr().err
    words = "--kv-scales: expected 'auto' or a positive number, finite in float32, got"
    assert exit_info.value.code == 1 and words in err and bad in err, (exit_info.value.code, err)
