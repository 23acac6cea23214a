"""The tokenizer of a GGUF file: GPT-2 byte-level BPE from its vocabulary and merges.

Built with the ``tokenizers`` library from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``.
Control tokens (``token_type`` 3, e.g. ``<|im_start|>``) are special: matched whole in the text,
never split. The pre-tokenizer follows ``tokenizer.ggml.pre`` as llama.cpp does; ``smollm`` (and
``gpt2``) split digits one by one, then apply GPT-2's byte-level regex.
"""

from __future__ import annotations

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
        CupagedError: the tokenizer is not GPT-2 byte-level BPE, or its pre-tokenizer is unknown.
    """

    def __init__(self, gguf: GGUFFile) -> None:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        kind = gguf.require("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CupagedError(f"expected a 'gpt2' (byte-level BPE) tokenizer, got {kind!r}")
        pre = gguf.metadata("tokenizer.ggml.pre", "default")
        tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
        self._merges: list[str] = gguf.require("tokenizer.ggml.merges")
        merges = [tuple(m.split(" ", 1)) for m in self._merges]
        types = gguf.metadata("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {token: i for i, token in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
        tok = HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in DIGITS_FIRST:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in PLAIN_BYTE_LEVEL:
            tok.pre_tokenizer = byte_level
        else:
            supported = sorted(DIGITS_FIRST | PLAIN_BYTE_LEVEL)
            raise CupagedError(f"unknown pre-tokenizer: expected one of {supported}, got {pre!r}")
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        self._tok = tok
        self.vocab_size = len(tokens)
        self.bos_id: int | None = gguf.metadata("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = gguf.metadata("tokenizer.ggml.eos_token_id")
        self.add_bos: bool = bool(gguf.metadata("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = gguf.metadata("tokenizer.chat_template")
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
            CupagedError: the GGUF has no chat template.
        """
        import jinja2.sandbox

        if not self.chat_template:
            raise CupagedError("expected a chat template (tokenizer.chat_template), got none")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self._token_or_empty(self.bos_id),
            eos_token=self._token_or_empty(self.eos_id),
        )

    def _token_or_empty(self, token_id: int | None) -> str:
        return self._tokens[token_id] if token_id is not None else ""
