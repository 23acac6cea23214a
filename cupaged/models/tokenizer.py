"""The tokenizer of a GGUF file: GPT-2 byte-level BPE from its vocabulary and merges.

Built with the ``tokenizers`` library from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``.
Control tokens (``token_type`` 3, e.g. ``<|im_start|>``) are special: matched whole in the text,
never split. The pre-tokenizer follows ``tokenizer.ggml.pre`` as llama.cpp does; ``smollm`` (and
``gpt2``) split digits one by one, then apply GPT-2's byte-level regex.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

from ..errors import CupagedError
from .gguf import GGUFFile

CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
# Pre-tokenizers whose rules this module implements (llama.cpp's names).
DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell"}
PLAIN_BYTE_LEVEL = {"gpt2", "default"}


class Tokenizer:
    """Encode text to token ids and back.

    Args:
        gguf: the GGUF file whose ``tokenizer.ggml.*`` metadata define the tokenizer.

    Raises:
        CupagedError: the tokenizer is not GPT-2 byte-level BPE, its pre-tokenizer is unknown,
            or its metadata do not fit together: tokens that are not a list of strings, a merge
            that is not two tokens of the vocabulary, a ``token_type`` list of another length
            than the tokens', a BOS or EOS id outside the vocabulary, BOS to be added but none
            given, a chat template that is not text.
    """

    def __init__(self, gguf: GGUFFile) -> None:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        kind = gguf.require("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CupagedError(f"expected a 'gpt2' (byte-level BPE) tokenizer, got {kind!r}")
        pre = gguf.metadata("tokenizer.ggml.pre", "default")
        file = gguf.path.name
        tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
        _check_list(gguf, "tokenizer.ggml.tokens", tokens, str, "strings")
        self._merges: list[str] = gguf.require("tokenizer.ggml.merges")
        _check_list(gguf, "tokenizer.ggml.merges", self._merges, str, "strings", empty=True)
        merges = [tuple(m.split(" ", 1)) for m in self._merges]
        for i, merge in enumerate(merges):
            if len(merge) != 2 or not all(merge):
                raise CupagedError(
                    f"expected merge {i} of tokenizer.ggml.merges two tokens apart by a space "
                    f"('a b') in {file}, got {self._merges[i]!r}"
                )
        types = gguf.metadata("tokenizer.ggml.token_type", [1] * len(tokens))
        _check_list(gguf, "tokenizer.ggml.token_type", types, Integral, "integers", len(tokens))
        vocab = {token: i for i, token in enumerate(tokens)}
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
        except Exception as error:  # the library raises a bare Exception for a merge off the vocab
            raise CupagedError(
                f"expected tokenizer.ggml.merges of tokens in the vocabulary in {file}, got {error}"
            ) from None
        tok = HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if isinstance(pre, str) and pre in DIGITS_FIRST:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif isinstance(pre, str) and pre in PLAIN_BYTE_LEVEL:
            tok.pre_tokenizer = byte_level
        else:
            supported = sorted(DIGITS_FIRST | PLAIN_BYTE_LEVEL)
            raise CupagedError(f"unknown pre-tokenizer: expected one of {supported}, got {pre!r}")
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        self._tok = tok
        self.vocab_size = len(tokens)
        # Both ids become tokens of a prompt (BOS, the chat template's ``eos_token``) or end one.
        self.bos_id = _token_id(gguf, "tokenizer.ggml.bos_token_id", self.vocab_size)
        self.eos_id = _token_id(gguf, "tokenizer.ggml.eos_token_id", self.vocab_size)
        self.add_bos = gguf.metadata("tokenizer.ggml.add_bos_token", False)
        if not isinstance(self.add_bos, bool):
            raise CupagedError(
                f"expected tokenizer.ggml.add_bos_token true or false in {file}, got "
                f"{_kind(self.add_bos)}"
            )
        if self.add_bos and self.bos_id is None:
            raise CupagedError(
                f"expected tokenizer.ggml.bos_token_id in {file} (add_bos_token is true), got none"
            )
        self.chat_template: str | None = gguf.metadata("tokenizer.chat_template")
        if not isinstance(self.chat_template, str | None):
            raise CupagedError(
                f"expected tokenizer.chat_template a string in {file}, got "
                f"{_kind(self.chat_template)}"
            )
        self._tokens = tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (BOS first only if the GGUF says to add it)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; control tokens are dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token(self, token_id: int) -> str:
        """The vocabulary entry of one id (byte-level form, e.g. ``'ĠParis'``)."""
        return self._tokens[token_id]

    @property
    def merges(self) -> tuple[str, ...]:
        """The BPE merges in rank order, as the GGUF stores them (``"Ġ t"``: merge ``Ġ`` and ``t``)."""
        return tuple(self._merges)

    def pre_tokenize(self, text: str) -> list[str]:
        """The words the BPE merges run within: ``text`` split and byte-level mapped, as
        :meth:`encode` splits it before merging (``"Hi there"`` -> ``["Hi", "Ġthere"]``)."""
        return [word for word, _ in self._tok.pre_tokenizer.pre_tokenize_str(text)]

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of a conversation, with the generation prompt of the assistant.

        Raises:
            CupagedError: the GGUF has no chat template, or its template does not render: a
                syntax error, an operation on an undefined variable, an error raised while it
                renders, or a ``raise_exception(message)`` of the template's own.
        """
        import jinja2.sandbox

        if not self.chat_template:
            raise CupagedError("expected a chat template (tokenizer.chat_template), got none")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception  # as Hugging Face's templates expect
        where = "the chat template (tokenizer.chat_template)"
        try:
            template = env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as error:
            raise CupagedError(
                f"expected {where} valid Jinja, got a syntax error on line {error.lineno}: "
                f"{_one_line(error.message)}"
            ) from None
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self._token_or_empty(self.bos_id),
                eos_token=self._token_or_empty(self.eos_id),
            )
        except _TemplateRaised as error:
            raise CupagedError(f"{where} refused the messages: {_one_line(error)}") from None
        except Exception as error:  # the file's template failed, whatever it raised
            raise CupagedError(
                f"expected {where} to render, got {type(error).__name__}: {_one_line(error)}"
            ) from None

    def _token_or_empty(self, token_id: int | None) -> str:
        return self._tokens[token_id] if token_id is not None else ""


class _TemplateRaised(Exception):
    """A chat template's own ``raise_exception(message)``."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _token_id(gguf: GGUFFile, key: str, vocab_size: int) -> int | None:
    """Metadata ``key``: ``None`` when absent, else an id in ``[0, vocab_size)``.

    Raises:
        CupagedError: another value (a negative or too large id, not an integer).
    """
    value = gguf.metadata(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value < vocab_size:
        raise CupagedError(
            f"expected {key} a token id in [0, {vocab_size}) (the vocabulary) in "
            f"{gguf.path.name}, got {_kind(value)}"
        )
    return int(value)


def _check_list(
    gguf: GGUFFile,
    key: str,
    value: Any,
    kind: type,
    kind_name: str,
    length: int | None = None,
    empty: bool = False,
) -> None:
    """Refuse metadata ``key`` unless it is a list of ``kind`` (bools are not integers), of
    ``length`` entries if given, empty only if ``empty``.

    Raises:
        CupagedError: naming the key, what it must be and what it is.
    """
    if not isinstance(value, list):
        got = _kind(value)
    elif length is not None and len(value) != length:
        got = f"{len(value)} entries"
    elif not value and not empty:
        got = "an empty list"
    else:
        bad = [i for i, v in enumerate(value) if not isinstance(v, kind) or isinstance(v, bool)]
        if not bad:
            return
        got = f"entry {bad[0]} {_kind(value[bad[0]])}"
    count = "" if length is None else f"{length} "
    per_token = "" if length is None else " (one per token)"
    raise CupagedError(
        f"expected {key} a list of {count}{kind_name}{per_token} in {gguf.path.name}, got {got}"
    )


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _kind(value: Any) -> str:
    """``value`` for an error message: a list by its length, anything else by its repr."""
    if isinstance(value, list):
        return f"a list of {len(value)} entries"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
