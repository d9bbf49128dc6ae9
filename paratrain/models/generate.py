"""Autoregressive sampling from a `Transformer`, for eyeballing a trained model.

torch is imported inside the functions: `paratrain.models` exports `generate` without importing
torch, so that reading a model config (the planner) stays free of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.errors import ParatrainError

if TYPE_CHECKING:
    import torch


class GenerationError(ParatrainError, ValueError):
    """A sampling argument is out of range."""


def generate(
    model,
    tokens: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    max_context: int | None = None,
) -> torch.Tensor:
    """Extend token ids [B, S] by `max_new_tokens` sampled tokens; returns [B, S + max_new_tokens].

    temperature 0 picks the most likely token; otherwise logits are divided by it and,
    if `top_k` is given, all but the k most likely tokens are excluded. The whole context
    is re-run at each step (no KV cache), cropped to the last `max_context` tokens (default:
    `model.config.max_seq_len`; pass it for a wrapped model).
    """
    import torch

    _check_args(max_new_tokens, temperature, top_k)
    context = max_context or model.config.max_seq_len
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -context:])[:, -1, :].float()
            tokens = torch.cat((tokens, _sample(logits, temperature, top_k, generator)), dim=1)
    return tokens


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    import torch

    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_best = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def _check_args(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens={max_new_tokens} is negative; use 0 or more")
    if temperature < 0:
        raise GenerationError(f"temperature={temperature} is negative; use 0 (greedy) or more")
    if top_k is not None and top_k < 1:
        raise GenerationError(f"top_k={top_k} is invalid; use a positive integer or None")
