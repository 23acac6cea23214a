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
    limit_blas_threads    one OpenBLAS thread on the CPU device (the commands set it; see .threads)
"""

from __future__ import annotations

from collections.abc import Callable

from .. import CupagedError, device_module, resolve_device
from .cli import COMMAND_ERRORS, error_line, input_file, integer, output_file, real
from .cli import add_commands as add_cli_commands
from .fetch import MODELS, fetch
from .generate import GenerationStats, Sampling, generate
from .gguf import GGUFFile
from .llama import Llama, LlamaConfig, load_weights
from .threads import limit_blas_threads
from .tokenizer import Tokenizer

DTYPES = ("float32", "float16", "bfloat16")


def load_model(
    name: str,
    device: str | None = None,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
) -> tuple[Llama, Tokenizer]:
    """Fetch (once) and load a model of :data:`MODELS` on a device.

    Args:
        name: e.g. ``"smollm2"``.
        device: ``"cuda"``, ``"cpu"`` or ``None`` (CUDA when usable).
        dtype: the KV cache's element type.
        progress: receives the download message (default: stderr).

    Raises:
        CupagedError: unknown model, failed or corrupt download, missing ``model`` extra.
        ValueError: an unknown dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"expected a dtype in {DTYPES}, got {dtype!r}")
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
    model = Llama(config, load_weights(file, config), device_module(device), dtype=dtype)
    return model, Tokenizer(file)


__all__ = [
    "COMMAND_ERRORS",
    "DTYPES",
    "MODELS",
    "GGUFFile",
    "GenerationStats",
    "Llama",
    "LlamaConfig",
    "Sampling",
    "Tokenizer",
    "add_cli_commands",
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
