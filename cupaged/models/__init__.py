"""Real models over the paged cache: GGUF loading, tokenizer, a Llama forward, generation.

Needs the ``model`` extra (``pip install "cupaged[model]"``: ``gguf``, ``tokenizers``, ``jinja2``).

Public names::

    load_model            fetch (if needed) and load a model of the registry: (Llama, Tokenizer)
    fetch, MODELS         the registry and its download into the user's cache
    GGUFFile              metadata and dequantized tensors of a GGUF file
    Tokenizer             byte-level BPE from a GGUF's vocabulary, with its chat template
    Llama, LlamaConfig    the model in array ops; prefill and decode through a PagedCache
    generate, Sampling    serve several prompts together (the engine of cupaged.serving)
    add_cli_commands      the ``generate`` and ``model fetch`` subcommands, on an argparse parser
    integer, real, input_file, output_file, error_line, COMMAND_ERRORS
                          the command line's checked option types and its one-line errors
                          (shared by ``cupaged demo``)
    add_kv_options, check_kv_options
                          ``--kv-dtype`` / ``--kv-scales`` (fp8 caches), shared by ``demo``
    limit_blas_threads    one OpenBLAS thread on the CPU device (the commands set it; see .threads)
"""

from __future__ import annotations

from collections.abc import Callable

from .. import CupagedError, device_module, resolve_device
from .cli import (
    COMMAND_ERRORS,
    add_kv_options,
    check_kv_options,
    error_line,
    input_file,
    integer,
    output_file,
    real,
)
from .cli import add_commands as add_cli_commands
from .fetch import MODELS, fetch
from .generate import GenerationStats, Sampling, generate
from .gguf import GGUFFile
from .llama import Llama, LlamaConfig, check_kv_dtype, load_weights
from .threads import limit_blas_threads
from .tokenizer import Tokenizer

DTYPES = ("float32", "float16", "bfloat16")
KV_DTYPES = (*DTYPES, "float8_e4m3", "float8_e5m2")


def load_model(
    name: str,
    device: str | None = None,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
    kv_dtype: str | None = None,
    batch_invariant: bool = False,
    cascade: bool | None = None,
) -> tuple[Llama, Tokenizer]:
    """Fetch (once) and load a model of :data:`MODELS` on a device.

    Args:
        name: e.g. ``"smollm2"``.
        device: ``"cuda"``, ``"cpu"`` or ``None`` (CUDA when usable).
        dtype: the model's attention dtype (Q/K/V, attention output), and the KV cache's
            element type unless ``kv_dtype`` is given.
        progress: receives the download message (default: stderr).
        kv_dtype: the KV cache's element type: ``dtype`` or an fp8 format (docs/fp8.md).
        batch_invariant: the model's attention bitwise the same for a sequence whatever the
            batch (:class:`Llama`; docs/batch-invariance.md).
        cascade: the decode plans' cascade (:class:`Llama`; docs/cascade.md).

    Raises:
        CupagedError: unknown model, failed or corrupt download, missing ``model`` extra, or a
            file that does not fit together (checked before its weights are read: the config,
            the tokenizer, every tensor's shape and storage type).
        ValueError: an unknown dtype, or a ``kv_dtype`` that is neither ``dtype`` nor fp8.
    """
    if dtype not in DTYPES:
        raise ValueError(f"expected a dtype in {DTYPES}, got {dtype!r}")
    check_kv_dtype(dtype, kv_dtype)  # before the download
    try:
        import gguf  # noqa: F401
        import jinja2  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as error:
        raise CupagedError(
            f"real models need the model extra (pip install 'cupaged[model]'): {error}"
        ) from None
    device = resolve_device(device)
    path = fetch(name, progress=progress)
    file = GGUFFile(path)
    config = LlamaConfig.from_gguf(file)
    tokenizer = Tokenizer(file)
    if tokenizer.vocab_size > config.vocab_size:  # an id past the embedding's rows
        raise CupagedError(
            f"expected at most {config.vocab_size} tokens (the embedding's rows) in "
            f"tokenizer.ggml.tokens of {file.path.name}, got {tokenizer.vocab_size}"
        )
    weights = load_weights(file, config)
    model = Llama(
        config,
        weights,
        device_module(device),
        dtype=dtype,
        kv_dtype=kv_dtype,
        batch_invariant=batch_invariant,
        cascade=cascade,
    )
    return model, tokenizer


__all__ = [
    "COMMAND_ERRORS",
    "DTYPES",
    "KV_DTYPES",
    "MODELS",
    "GGUFFile",
    "GenerationStats",
    "Llama",
    "LlamaConfig",
    "Sampling",
    "Tokenizer",
    "add_cli_commands",
    "add_kv_options",
    "check_kv_options",
    "error_line",
    "fetch",
    "generate",
    "input_file",
    "integer",
    "limit_blas_threads",
    "load_model",
    "load_weights",
    "output_file",
    "real",
]
