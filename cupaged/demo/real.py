"""The demo's request stream for a real model (``cupaged demo --model smollm2``).

A small built-in list of varied prompts: chat questions behind one shared system message (the
chat template puts it first, so those prompts share their leading blocks and prefix caching
serves them after the first), and plain-text openings without a template. The lengths of the
continuations, the samples per request and the arrivals are drawn from the run's seed as for the
seeded model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..serving import Request

SYSTEM = (
    "You are a concise assistant for a museum of science and history. Answer every question in "
    "one or two plain sentences, without lists, and do not repeat the question."
)
# (kind, text): "chat" prompts go through the chat template behind SYSTEM; "text" prompts are
# plain text, continued as they are.
PROMPTS = [
    ("chat", "Why is the sky blue?"),
    ("text", "The capital of France is"),
    ("chat", "What is the boiling point of water at sea level?"),
    ("text", "def fibonacci(n):"),
    ("chat", "Who painted the Mona Lisa?"),
    ("text", "Once upon a time, in a small village by the sea,"),
    ("chat", "How many legs does a spider have?"),
    ("chat", "What does a paged KV cache store?"),
    ("text", "The three primary colors are"),
    ("chat", "Name a planet with rings."),
]


def encode_prompts(tokenizer: Any) -> list[list[int]]:
    """Token ids of every built-in prompt (chat ones through the template, behind SYSTEM)."""
    ids = []
    for kind, text in PROMPTS:
        if kind == "chat":
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(messages)
        ids.append(tokenizer.encode(text))
    return ids


def make_real_requests(
    prompts: list[list[int]], num_requests: int, new_tokens: int, max_len: int, seed: int
) -> list[Request]:
    """The first ``num_requests`` prompts (all of them at most) as requests: lognormal lengths
    around ``new_tokens``, every fourth request (from the second) two or three samples, arrivals
    spread over the first steps.

    Raises:
        ValueError: a prompt leaves no room for a token within ``max_len``.
    """
    rng = np.random.default_rng(seed)
    requests = []
    for rid, prompt in enumerate(prompts[:num_requests]):
        if len(prompt) >= max_len:
            raise ValueError(
                f"--max-len: expected more than the {len(prompt)} tokens of built-in prompt "
                f"{rid}, got {max_len}"
            )
        new = int(np.clip(rng.lognormal(np.log(new_tokens), 0.5), 1, max_len - len(prompt)))
        samples = int(rng.choice([2, 3])) if rid % 4 == 1 else 1
        arrival = int(rng.integers(0, 2 * len(prompts)))
        requests.append(Request(rid, prompt, new, samples, arrival_step=arrival))
    return requests


def one_line(text: str, width: int = 72) -> str:
    """``text`` on one line (newlines shown as ``⏎``), cut to ``width`` characters."""
    flat = " ⏎ ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
