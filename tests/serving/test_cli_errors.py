"""The command line's errors: one line on stderr, no traceback, exit status 2 for a bad option
value (argparse) and 1 for anything else, and before the work (issue 23, item 6).

"Before the work" is checked by replacing the work with a function that fails the test: the
model load for ``generate``, the demo's setup (or its run, where the setup is what reads the
weights file). The checks of :class:`~cupaged.models.LlamaConfig` (item 7) use tiny GGUF files
written with the ``gguf`` package: metadata only, no tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import run_main, the_work

import cupaged.demo
import cupaged.models
import cupaged.models.cli
from cupaged import CupagedError
from cupaged.demo.model import ModelConfig, TinyDecoder, WeightsError, weight_shapes

GENERATE = ["generate", "--model", "smollm2", "--device", "cpu"]
NOT_UTF8 = os.fsdecode(b"\xff\xfe")  # what Python makes of argv bytes that are not UTF-8


# ---------------------------------------------------------------------------------- generate


@pytest.mark.parametrize(
    "options, message",
    [
        (["--max-new-tokens", "1000000000"], "--max-new-tokens: expected at most 8191"),
        (
            ["--max-new-tokens", str(2**40)],
            f"expected at most 8191 (the 8192-token context of "
            f"smollm2 holds the prompt too), got {2**40}",
        ),
        (["--block-size", "1000"], "--block-size: expected block_size in 1..256, got 1000"),
        (["--temperature", "nan"], "--temperature: expected a finite number, got nan"),
        (["--temperature", "inf"], "--temperature: expected a finite number, got inf"),
        (["--seed", "-1"], "--seed: expected >= 0, got -1"),
        (["--json", "no-such-folder/out.json"], "--json: expected a file in an existing folder"),
    ],
)
def test_generate_refuses_a_bad_option_when_parsing(options, message, no_work, capsys):
    status, line = run_main([*GENERATE, *options, "hi"], capsys)
    assert status == 1, line
    assert line.startswith("cupaged generate: error: argument ") and message in line, line


def test_generate_refuses_a_prompt_that_is_not_utf8(no_work, capsys):
    status, line = run_main([*GENERATE, NOT_UTF8], capsys)
    assert status == 1
    assert r"argument PROMPT: expected UTF-8 text, got the bytes b'\xff\xfe'" in line, line


def test_generate_refuses_a_folder_as_the_json_file(tmp_path, no_work, capsys):
    status, line = run_main([*GENERATE, "--json", str(tmp_path), "hi"], capsys)
    assert status == 1 and "--json: expected a file to write, got the folder" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--num-blocks", "1000000000"],
            "the KV cache of --num-blocks 1000000000 (smollm2, float32): expected at most the ",
        ),
        (
            ["-n", "100000"],
            "the KV cache of 300,001 blocks for -n 100000 samples of "
            "--max-new-tokens 32 (smollm2, float32): expected at most the 16.0 GiB available on cpu, "
            "got 206.0 GiB",
        ),
    ],
)
def test_generate_refuses_a_pool_the_memory_cannot_hold_before_loading(
    options, message, no_work, monkeypatch, capsys
):
    monkeypatch.setattr(cupaged.models.cli, "available_memory", lambda device: 16 * 2**30)
    status, line = run_main([*GENERATE, *options, "hi"], capsys)
    assert status == 1, line
    assert line.startswith("cupaged generate: error: ") and message in line, line


def test_generate_refuses_a_pool_larger_than_this_machine(no_work, capsys):
    """Without a patched memory size: no machine has the 737 TB that this pool asks for."""
    status, line = run_main([*GENERATE, "--num-blocks", "1000000000", "hi"], capsys)
    assert status == 1 and "got 686,645.5 GiB" in line, line


def test_the_registry_records_the_shape_of_the_model_it_pins():
    """The shape the command sizes its cache with before loading is the GGUF's own."""
    from cupaged.models import GGUFFile, LlamaConfig
    from cupaged.models.fetch import MODELS, gguf_path

    path = gguf_path("smollm2")
    if not path.exists():
        pytest.skip("smollm2 is not in the cache (tests/serving/test_real_model.py fetches it)")
    gguf = GGUFFile(path)
    config, source = LlamaConfig.from_gguf(gguf), MODELS["smollm2"]
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (
        source.num_layers,
        source.num_kv_heads,
        source.head_dim,
    )
    assert gguf.metadata("llama.context_length") == source.context_length


# ---------------------------------------------------------------------------------- demo


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_demo_refuses_an_output_in_a_missing_folder_when_parsing(option, tmp_path, no_work, capsys):
    target = tmp_path / "missing" / "out"
    status, line = run_main(["demo", "--device", "cpu", option, str(target)], capsys)
    assert status == 1, line
    assert f"argument {option}: expected a file in an existing folder" in line, line
    assert list(tmp_path.iterdir()) == []


def test_demo_refuses_more_requests_than_it_can_build_before_the_work(no_work, capsys):
    status, line = run_main(["demo", "--device", "cpu", "--requests", "1000000000"], capsys)
    assert status == 1, line
    assert "--requests: expected at most 100,000" in line and "got 1,000,000,000" in line, line


def test_demo_refuses_a_missing_weights_file_or_a_folder_when_parsing(tmp_path, no_work, capsys):
    status, line = run_main(["demo", "--weights", str(tmp_path / "none.npz")], capsys)
    assert status == 1 and "argument --weights: expected a readable file" in line, line
    assert "No such file or directory" in line, line
    status, line = run_main(["demo", "--weights", str(tmp_path)], capsys)
    assert status == 1 and "(a folder)" in line, line


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A weights file that TinyDecoder.save wrote, and its arrays."""
    path = tmp_path_factory.mktemp("weights") / "tiny.npz"
    TinyDecoder(ModelConfig(), np, seed=1).save(path)
    with np.load(path) as data:
        return path, dict(data)


def write_weights(path, arrays, compressed=False):
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


def bad_weights(kind, saved, folder):
    path, arrays = saved
    target = folder / f"{kind}.npz"
    if kind == "truncated":
        data = path.read_bytes()
        target.write_bytes(data[: len(data) // 2])
        return target
    if kind == "string head_dim":
        return write_weights(target, arrays | {"config.head_dim": np.asarray("64")})
    if kind == "huge sizes":
        config = {k: v for k, v in arrays.items() if k.startswith("config.")}
        huge = {"config.vocab_size": np.asarray(10**12), "config.num_layers": np.asarray(10**9)}
        return write_weights(target, config | huge)
    if kind == "zero heads":
        return write_weights(target, arrays | {"config.num_kv_heads": np.asarray(0)})
    if kind == "compressed":
        return write_weights(target, arrays, compressed=True)
    if kind == "not a zip":
        target.write_text("not an npz")
        return target
    raise AssertionError(kind)


WEIGHTS_CASES = {
    "truncated": "File is not a zip file",
    "string head_dim": "expected config.head_dim a number, got an array of dtype <U2",
    "huge sizes": "expected the 846,336,000,000,256 weights that its config declares in the file",
    "zero heads": "expected num_kv_heads an integer >= 1, got 0",
    "compressed": "uncompressed (as save writes it), got it compressed",
    "not a zip": "File is not a zip file",
}


@pytest.mark.parametrize("kind", WEIGHTS_CASES)
def test_demo_refuses_a_weights_file_it_cannot_use_before_the_run(
    kind, saved, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(cupaged.demo.Demo, "run", the_work)
    path = bad_weights(kind, saved, tmp_path)
    start = time.perf_counter()
    status, line = run_main(["demo", "--device", "cpu", "--weights", str(path)], capsys)
    assert status == 1, line
    assert line.startswith(f"cupaged demo: error: weights {path}: "), line
    assert WEIGHTS_CASES[kind] in line, line
    # Nothing the file asks for is allocated: no model is built, so it fails at once.
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("kind", WEIGHTS_CASES)
def test_load_checks_every_size_before_allocating(kind, saved, tmp_path):
    with pytest.raises(WeightsError, match="weights .*") as error:
        TinyDecoder.load(bad_weights(kind, saved, tmp_path), np)
    assert WEIGHTS_CASES[kind] in str(error.value)
    assert isinstance(error.value, CupagedError) and isinstance(error.value, ValueError)


def test_load_refuses_a_member_whose_header_declares_another_shape(saved, tmp_path):
    """A weight's header is read before its data: a shape other than the config's is refused."""
    path, arrays = saved
    wrong = arrays | {"blk.0.attn_q.weight": np.zeros((3, 3), np.float32)}
    with pytest.raises(WeightsError, match=r"expected blk.0.attn_q.weight of shape \(256, 256\)"):
        TinyDecoder.load(write_weights(tmp_path / "wrong.npz", wrong), np)


def test_weight_shapes_counts_what_num_parameters_says():
    config = ModelConfig(num_layers=3, vocab_size=100, hidden_size=96)
    assert sum(int(np.prod(s)) for s in weight_shapes(config).values()) == config.num_parameters


@pytest.mark.parametrize(
    "field, value",
    [
        ("head_dim", "64"),
        ("head_dim", 63),
        ("num_layers", 0),
        ("num_kv_heads", -2),
        ("num_q_heads", True),
        ("vocab_size", 1.5),
        ("rope_theta", float("nan")),
    ],
)
def test_model_config_refuses_what_is_not_a_size(field, value):
    with pytest.raises(ValueError, match=f"expected .*{field}"):
        ModelConfig(**{field: value})


# ---------------------------------------------------------------------------------- subprocess


def test_the_installed_command_prints_one_line_for_non_utf8_argv_and_bad_weights(tmp_path, saved):
    """Through ``python -m cupaged`` with real argv bytes: no model is fetched, no traceback."""
    env = os.environ | {"CUPAGED_CACHE_DIR": str(tmp_path), "PIP_NO_INDEX": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "cupaged", *GENERATE, b"\xff\xfe"],
        capture_output=True,
        env=env,
        timeout=120,
    )
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 1 and len(err.strip().splitlines()) == 1, err
    assert "expected UTF-8 text" in err and not (tmp_path / "models").exists(), err
    weights = bad_weights("truncated", saved, tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "cupaged", "demo", "--device", "cpu", "--weights", str(weights)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"cupaged demo: error: weights {weights}: File is not a zip file"
    ], done.stderr


# ---------------------------------------------------------------------------------- LlamaConfig


def write_gguf(path, **changes):
    """A GGUF of a small Llama's metadata, no tensors; ``changes``: key -> (type, value) or None
    to leave the key out."""
    import gguf

    meta = {
        "llama.block_count": ("uint32", 2),
        "llama.embedding_length": ("uint32", 128),
        "llama.attention.head_count": ("uint32", 2),
        "llama.attention.head_count_kv": ("uint32", 1),
        "llama.feed_forward_length": ("uint32", 256),
        "llama.vocab_size": ("uint32", 32),
    } | changes
    writer = gguf.GGUFWriter(path, "llama")
    for key, entry in meta.items():
        if entry is not None:
            kind, value = entry
            getattr(writer, f"add_{kind}")(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_config_from_a_good_gguf(tmp_path):
    pytest.importorskip("gguf")
    from cupaged.models import GGUFFile, LlamaConfig

    config = LlamaConfig.from_gguf(GGUFFile(write_gguf(tmp_path / "ok.gguf")))
    assert (config.num_layers, config.hidden, config.num_q_heads, config.num_kv_heads) == (
        2,
        128,
        2,
        1,
    )
    assert (config.head_dim, config.ffn, config.vocab_size) == (64, 256, 32)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"llama.attention.head_count": ("uint32", 0)},
            "expected llama.attention.head_count a positive integer in bad.gguf, got 0",
        ),
        (
            {"llama.embedding_length": ("int32", -128)},
            "expected llama.embedding_length a positive integer in bad.gguf, got -128",
        ),
        ({"llama.block_count": ("int32", -1)}, "expected llama.block_count a positive integer"),
        (
            {"llama.feed_forward_length": ("int64", 0)},
            "llama.feed_forward_length a positive integer",
        ),
        ({"llama.vocab_size": ("int32", -5)}, "expected llama.vocab_size a positive integer"),
        ({"llama.attention.head_count_kv": ("uint32", 0)}, "head_count_kv a positive integer"),
        (
            {"llama.attention.head_count_kv": ("uint32", 3)},
            "expected num_q_heads a multiple of num_kv_heads=3, got 2",
        ),
        (
            {"llama.embedding_length": ("uint32", 127)},
            "expected llama.embedding_length a multiple of llama.attention.head_count=2",
        ),
        ({"llama.feed_forward_length": ("string", "256")}, "got '256'"),
        (
            {"llama.rope.freq_base": ("float32", float("nan"))},
            "llama.rope.freq_base a finite number > 0",
        ),
        ({"llama.attention.layer_norm_rms_epsilon": ("float32", -1.0)}, "a finite number > 0"),
    ],
)
def test_llama_config_refuses_every_bad_size(changes, message, tmp_path):
    pytest.importorskip("gguf")
    from cupaged.models import GGUFFile, LlamaConfig

    gguf = GGUFFile(write_gguf(tmp_path / "bad.gguf", **changes))
    with pytest.raises(CupagedError) as error:
        LlamaConfig.from_gguf(gguf)
    assert message in str(error.value), str(error.value)


def test_llama_config_made_directly_checks_its_sizes_too():
    from cupaged.models import LlamaConfig

    good = dict(
        num_layers=1,
        hidden=128,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        ffn=256,
        vocab_size=32,
        rms_eps=1e-5,
        rope_base=1e4,
    )
    LlamaConfig(**good)
    for field, value in (
        ("num_q_heads", 0),
        ("head_dim", -64),
        ("vocab_size", "32"),
        ("rope_base", float("inf")),
    ):
        with pytest.raises(ValueError, match=f"expected {field} "):
            LlamaConfig(**(good | {field: value}))
