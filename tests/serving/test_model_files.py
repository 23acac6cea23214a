"""A model file that does not fit together is refused when it loads, with an error that names
what was expected and what the file holds (issue 39): every tensor's shape and storage type (not
only layer 0's), the tokenizer's lists and special ids, and a chat template that does not render.

The files are tiny GGUFs written here with the ``gguf`` package: a Llama of a few layers (head
dimension 64, the smallest the kernels take, so that ``cupaged generate`` runs over one), a
vocabulary of eight tokens. The real model is never needed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import cupaged.models  # noqa: E402
from cupaged import CupagedError  # noqa: E402
from cupaged.__main__ import main  # noqa: E402
from cupaged.models import GGUFFile, Llama, LlamaConfig, Tokenizer, load_weights  # noqa: E402

HIDDEN, HEADS, KV_HEADS, FFN = 128, 2, 1, 32  # head_dim 64
LAYERS = 8
TOKENS = ["<|im_start|>", "<|im_end|>", "a", "b", "ab", "Ġ", "Ġa", "c"]
TYPES = [3, 3, 1, 1, 1, 1, 1, 1]  # the first two are control tokens
MERGES = ["a b", "Ġ a"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LAYER_PARTS = {
    "attn_norm": (HIDDEN,),
    "attn_q": (HEADS * 64, HIDDEN),
    "attn_k": (KV_HEADS * 64, HIDDEN),
    "attn_v": (KV_HEADS * 64, HIDDEN),
    "attn_output": (HIDDEN, HEADS * 64),
    "ffn_norm": (HIDDEN,),
    "ffn_gate": (FFN, HIDDEN),
    "ffn_up": (FFN, HIDDEN),
    "ffn_down": (HIDDEN, FFN),
}
GENERATE = ["generate", "--model", "smollm2", "--device", "cpu", "--max-new-tokens", "2"]


def toy_shapes(layers: int = LAYERS, tied: bool = True) -> dict[str, tuple[int, ...]]:
    """The NumPy-order shape of every tensor of the toy model, by GGUF name."""
    shapes = {"token_embd.weight": (len(TOKENS), HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (len(TOKENS), HIDDEN)
    for i in range(layers):
        shapes |= {f"blk.{i}.{part}.weight": s for part, s in LAYER_PARTS.items()}
    return shapes


def write_model(
    path,
    rng: np.random.Generator,
    layers: int = LAYERS,
    tied: bool = True,
    tensors: dict | None = None,
    meta: dict | None = None,
) -> dict[str, np.ndarray]:
    """Write a toy Llama GGUF to ``path``; return the float32 tensors written.

    Args:
        tensors: name -> a shape (float32 of that shape instead), an array (written as it is,
            its dtype choosing the storage type) or None (left out); new names are added.
        meta: key -> (writer method suffix, value) or None (left out), over the toy's metadata.
    """
    import gguf

    arrays = {
        name: rng.standard_normal(s).astype(np.float32)
        for name, s in toy_shapes(layers, tied).items()
    }
    for name, change in (tensors or {}).items():
        if change is None:
            del arrays[name]
        elif isinstance(change, tuple):
            arrays[name] = rng.standard_normal(change).astype(np.float32)
        else:
            arrays[name] = change
    metadata = {
        "llama.block_count": ("uint32", layers),
        "llama.embedding_length": ("uint32", HIDDEN),
        "llama.attention.head_count": ("uint32", HEADS),
        "llama.attention.head_count_kv": ("uint32", KV_HEADS),
        "llama.feed_forward_length": ("uint32", FFN),
        "llama.vocab_size": ("uint32", len(TOKENS)),
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.pre": ("string", "smollm"),
        "tokenizer.ggml.tokens": ("array", TOKENS),
        "tokenizer.ggml.token_type": ("array", TYPES),
        "tokenizer.ggml.merges": ("array", MERGES),
        "tokenizer.ggml.bos_token_id": ("uint32", 0),
        "tokenizer.ggml.eos_token_id": ("uint32", 1),
        "tokenizer.ggml.add_bos_token": ("bool", False),
        "tokenizer.chat_template": ("string", TEMPLATE),
    } | (meta or {})
    writer = gguf.GGUFWriter(path, "llama")
    for key, entry in metadata.items():
        if entry is not None:
            kind, value = entry
            getattr(writer, f"add_{kind}")(key, value)
    for name, array in arrays.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return arrays


def no_reads(*args, **kwargs):
    raise AssertionError("expected the file refused from its headers, but a tensor was read")


def refusal(path, monkeypatch) -> str:
    """The message with which ``load_weights`` refuses ``path``, read from headers only."""
    file = GGUFFile(path)
    config = LlamaConfig.from_gguf(file)
    monkeypatch.setattr(GGUFFile, "tensor", no_reads)
    with pytest.raises(CupagedError) as error:
        load_weights(file, config)
    return str(error.value)


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """``cupaged argv`` in this process: its exit status and its one line of stderr."""
    status = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    return status, lines[0]


@pytest.fixture
def registry(monkeypatch):
    """``smollm2`` resolved to a toy file: returns a function that points it at ``path``, the
    registry's cache shape that of a toy of ``layers`` layers (so that ``generate`` runs)."""

    def point(path, layers: int = LAYERS) -> None:
        source = cupaged.models.MODELS["smollm2"]
        toy = replace(source, num_layers=layers, num_kv_heads=KV_HEADS, head_dim=64)
        monkeypatch.setitem(cupaged.models.MODELS, "smollm2", toy)
        monkeypatch.setattr(cupaged.models, "fetch", lambda name, progress=None: path)
        monkeypatch.setattr(cupaged.models, "limit_blas_threads", lambda n=1: False)

    return point


# ---------------------------------------------------------------------------------- tensors


def test_a_good_toy_file_loads_as_written(tmp_path, rng):
    written = write_model(tmp_path / "toy.gguf", rng, tied=False)
    file = GGUFFile(tmp_path / "toy.gguf")
    config = LlamaConfig.from_gguf(file)
    weights = load_weights(file, config)
    assert sorted(weights) == sorted(written)
    for name, array in written.items():
        np.testing.assert_array_equal(weights[name], array, err_msg=name)
    model = Llama(config, weights, np)
    logits = model.forward_full([2, 3, 4])
    assert logits.shape == (len(TOKENS),) and np.isfinite(logits).all()


@pytest.mark.parametrize(
    "name",
    [
        "blk.7.attn_q.weight",
        "blk.7.attn_k.weight",
        "blk.7.attn_output.weight",
        "blk.7.ffn_down.weight",
        "blk.7.ffn_norm.weight",
        "blk.3.attn_v.weight",
        "blk.5.ffn_gate.weight",
        "token_embd.weight",
        "output_norm.weight",
        "output.weight",
    ],
)
def test_every_tensor_shape_is_checked_before_any_is_read(name, tmp_path, rng, monkeypatch):
    """A wrong shape anywhere (its axes swapped, or one more row where that is the same) is refused
    from the headers, naming the tensor, the shape expected and the shape found."""
    expected = toy_shapes(tied=False)[name]
    swapped = expected[::-1]
    wrong = swapped if swapped != expected else (expected[0] + 1, *expected[1:])
    write_model(tmp_path / "toy.gguf", rng, tied=False, tensors={name: wrong})
    message = refusal(tmp_path / "toy.gguf", monkeypatch)
    assert message == f"expected tensor {name!r} of shape {expected} in toy.gguf, got {wrong}"


@pytest.mark.parametrize("dtype, kind", [(np.int32, "I32"), (np.float64, "F64"), (np.int8, "I8")])
def test_a_tensor_stored_as_other_than_float_weights_is_refused(
    dtype, kind, tmp_path, rng, monkeypatch
):
    name = "blk.7.ffn_up.weight"
    values = rng.integers(-3, 3, LAYER_PARTS["ffn_up"]).astype(dtype)
    write_model(tmp_path / "toy.gguf", rng, tensors={name: values})
    message = refusal(tmp_path / "toy.gguf", monkeypatch)
    assert message.startswith(f"expected tensor {name!r} in toy.gguf stored as one of ("), message
    assert message.endswith(f"got {kind}"), message
    # Nor can the tensor be read on its own (the gguf package would raise NotImplementedError).
    monkeypatch.undo()
    with pytest.raises(CupagedError, match=f"got {kind}$"):
        GGUFFile(tmp_path / "toy.gguf").tensor(name)


def test_every_storage_type_accepted_is_one_the_gguf_package_dequantizes():
    import gguf
    from gguf.quants import dequantize

    from cupaged.models.gguf import FLOAT_TYPES

    for kind in FLOAT_TYPES:
        qtype = gguf.GGMLQuantizationType[kind]
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        values = dequantize(np.zeros(nbytes, np.uint8), qtype)
        assert values.shape == (block,) and not values.any(), kind


def test_a_missing_tensor_of_the_last_layer_is_refused(tmp_path, rng, monkeypatch):
    write_model(tmp_path / "toy.gguf", rng, tensors={"blk.7.ffn_gate.weight": None})
    message = refusal(tmp_path / "toy.gguf", monkeypatch)
    assert message.startswith("expected tensor 'blk.7.ffn_gate.weight' in toy.gguf, got none")


@pytest.mark.parametrize(
    "extra",
    [
        {"blk.8.attn_q.weight": LAYER_PARTS["attn_q"]},  # a layer past llama.block_count
        {"blk.0.attn_q.bias": (HEADS * 64,)},  # a bias the model would ignore
    ],
)
def test_a_tensor_the_model_would_not_use_is_refused(extra, tmp_path, rng, monkeypatch):
    write_model(tmp_path / "toy.gguf", rng, tensors=extra)
    message = refusal(tmp_path / "toy.gguf", monkeypatch)
    assert message == (
        f"expected only the tensors of a {LAYERS}-layer Llama in toy.gguf, got 1 more: "
        f"{next(iter(extra))}"
    )


def test_llama_checks_the_shape_of_every_weight_it_is_given(tmp_path, rng):
    written = write_model(tmp_path / "toy.gguf", rng, tied=False)
    config = LlamaConfig.from_gguf(GGUFFile(tmp_path / "toy.gguf"))
    bad = dict(written)
    bad["blk.7.attn_k.weight"] = written["blk.7.attn_k.weight"].T
    with pytest.raises(ValueError) as error:
        Llama(config, bad, np)
    assert str(error.value) == (
        f"expected weight 'blk.7.attn_k.weight' of shape {(64, HIDDEN)}, got {(HIDDEN, 64)}"
    )
    del bad["blk.7.attn_k.weight"]
    with pytest.raises(ValueError, match="expected weight 'blk.7.attn_k.weight' .* got none"):
        Llama(config, bad, np)


def test_generate_refuses_a_bad_last_layer_in_one_line(tmp_path, rng, capsys, registry):
    write_model(tmp_path / "toy.gguf", rng, tensors={"blk.7.attn_v.weight": (65, HIDDEN)})
    registry(tmp_path / "toy.gguf")
    status, line = cli([*GENERATE, "ab"], capsys)
    assert (status, line) == (
        1,
        f"cupaged generate: error: expected tensor 'blk.7.attn_v.weight' of shape (64, {HIDDEN}) "
        f"in toy.gguf, got (65, {HIDDEN})",
    )


# ---------------------------------------------------------------------------------- tokenizer


def tokenizer_refusal(path) -> str:
    with pytest.raises(CupagedError) as error:
        Tokenizer(GGUFFile(path))
    return str(error.value)


def test_a_good_toy_tokenizer_encodes_and_renders(tmp_path, rng):
    write_model(tmp_path / "toy.gguf", rng, meta={"tokenizer.ggml.bos_token_id": ("uint32", 7)})
    tokenizer = Tokenizer(GGUFFile(tmp_path / "toy.gguf"))
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (7, 1, len(TOKENS))
    assert tokenizer.encode("ab a<|im_end|>") == [4, 6, 1]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "ab"}])
    assert text == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "types, got",
    [
        (TYPES[:-1], "got 7 entries"),  # one short
        (TYPES[:1], "got 1 entries"),
        ([*TYPES, 1], "got 9 entries"),
        ([1.5] * len(TOKENS), "got entry 0 1.5"),
    ],
)
def test_a_token_type_list_of_another_length_is_refused(types, got, tmp_path, rng):
    write_model(tmp_path / "toy.gguf", rng, meta={"tokenizer.ggml.token_type": ("array", types)})
    assert tokenizer_refusal(tmp_path / "toy.gguf") == (
        f"expected tokenizer.ggml.token_type a list of {len(TOKENS)} integers (one per token) "
        f"in toy.gguf, {got}"
    )


@pytest.mark.parametrize("which", ["bos", "eos"])
@pytest.mark.parametrize(
    "kind, value", [("uint32", len(TOKENS)), ("uint32", 10**9), ("int32", -1), ("string", "0")]
)
def test_a_special_id_outside_the_vocabulary_is_refused(which, kind, value, tmp_path, rng):
    key = f"tokenizer.ggml.{which}_token_id"
    write_model(tmp_path / "toy.gguf", rng, meta={key: (kind, value)})
    assert tokenizer_refusal(tmp_path / "toy.gguf") == (
        f"expected {key} a token id in [0, {len(TOKENS)}) (the vocabulary) in toy.gguf, "
        f"got {value!r}"
    )


def test_bos_to_be_added_must_be_given(tmp_path, rng):
    meta = {"tokenizer.ggml.add_bos_token": ("bool", True), "tokenizer.ggml.bos_token_id": None}
    write_model(tmp_path / "toy.gguf", rng, meta=meta)
    assert tokenizer_refusal(tmp_path / "toy.gguf") == (
        "expected tokenizer.ggml.bos_token_id in toy.gguf (add_bos_token is true), got none"
    )
    meta = {"tokenizer.ggml.add_bos_token": ("uint8", 1)}
    write_model(tmp_path / "toy.gguf", rng, meta=meta)
    assert tokenizer_refusal(tmp_path / "toy.gguf") == (
        "expected tokenizer.ggml.add_bos_token true or false in toy.gguf, got 1"
    )


@pytest.mark.parametrize(
    "merges, message",
    [
        (
            ["a b", "ab"],
            "expected merge 1 of tokenizer.ggml.merges two tokens apart by a space ('a b') in "
            "toy.gguf, got 'ab'",
        ),
        (["a z"], "expected tokenizer.ggml.merges of tokens in the vocabulary in toy.gguf, got"),
    ],
)
def test_a_merge_that_is_not_two_tokens_of_the_vocabulary_is_refused(
    merges, message, tmp_path, rng
):
    write_model(tmp_path / "toy.gguf", rng, meta={"tokenizer.ggml.merges": ("array", merges)})
    assert tokenizer_refusal(tmp_path / "toy.gguf").startswith(message)


def test_load_model_refuses_more_tokens_than_embedding_rows(tmp_path, rng, registry):
    """A vocabulary larger than ``llama.vocab_size``: its last ids have no embedding row."""
    rows = len(TOKENS) - 2
    tensors = {"token_embd.weight": (rows, HIDDEN)}
    meta = {"llama.vocab_size": ("uint32", rows)}
    write_model(tmp_path / "toy.gguf", rng, tensors=tensors, meta=meta)
    registry(tmp_path / "toy.gguf")
    with pytest.raises(CupagedError) as error:
        cupaged.models.load_model("smollm2", device="cpu")
    assert str(error.value) == (
        f"expected at most {rows} tokens (the embedding's rows) in tokenizer.ggml.tokens of "
        f"toy.gguf, got {len(TOKENS)}"
    )


def test_generate_refuses_an_out_of_range_bos_in_one_line(tmp_path, rng, capsys, registry):
    meta = {"tokenizer.ggml.add_bos_token": ("bool", True)}
    meta["tokenizer.ggml.bos_token_id"] = ("uint32", 100)
    write_model(tmp_path / "toy.gguf", rng, layers=2, meta=meta)
    registry(tmp_path / "toy.gguf", layers=2)
    status, line = cli([*GENERATE, "ab"], capsys)
    assert (status, line) == (
        1,
        f"cupaged generate: error: expected tokenizer.ggml.bos_token_id a token id in "
        f"[0, {len(TOKENS)}) (the vocabulary) in toy.gguf, got 100",
    )


# ---------------------------------------------------------------------------------- chat template


@pytest.mark.parametrize(
    "template, message",
    [
        (
            "{% for m in messages %}{{ m['content'] }}",
            "expected the chat template (tokenizer.chat_template) valid Jinja, got a syntax "
            "error on line 1: Unexpected end of template.",
        ),
        (
            "{{ system.content }}",
            "expected the chat template (tokenizer.chat_template) to render, got UndefinedError: "
            "'system' is undefined",
        ),
        (
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message "
            "first, please') }}{% endif %}",
            "the chat template (tokenizer.chat_template) refused the messages: a system message "
            "first, please",
        ),
        (
            "{{ messages | length // 0 }}",
            "expected the chat template (tokenizer.chat_template) to render, got "
            "ZeroDivisionError: integer division or modulo by zero",
        ),
    ],
)
def test_a_chat_template_that_does_not_render_is_one_clear_error(template, message, tmp_path, rng):
    write_model(tmp_path / "toy.gguf", rng, meta={"tokenizer.chat_template": ("string", template)})
    tokenizer = Tokenizer(GGUFFile(tmp_path / "toy.gguf"))  # loading does not render it
    with pytest.raises(CupagedError) as error:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value


def test_generate_chat_with_a_broken_template_is_one_line(tmp_path, rng, capsys, registry):
    meta = {"tokenizer.chat_template": ("string", "{{ messages[0].content.nope() }}")}
    write_model(tmp_path / "toy.gguf", rng, layers=2, meta=meta)
    registry(tmp_path / "toy.gguf", layers=2)
    status, line = cli([*GENERATE, "--chat", "ab"], capsys)
    assert status == 1
    assert line.startswith(
        "cupaged generate: error: expected the chat template (tokenizer.chat_template) to "
        "render, got "
    ), line
