"""A Hugging Face causal language model as an `nn.Sequential` of its own modules, for pipeline stages.

Pipeline parallelism cuts an `nn.Sequential` between layers, and each layer hands the next one
tensor. A `LlamaForCausalLM` is not one: its `LlamaModel` builds the causal mask and the rotary
embeddings once and hands them to every decoder layer. `as_sequential` lays the same modules
(the same parameters, nothing copied) out as

    0: embed_tokens · 1..L: DecoderBlock(decoder layer i) · L+1: norm · L+2: lm_head

where each `DecoderBlock` takes the hidden states, and the token positions by the keyword
`position_ids` (default: 0..s-1), computes the rotary embeddings from the model's own rotary
module and calls its decoder layer without a mask, so that the layer's SDPA attention runs with
`is_causal=True`, as `LlamaModel` calls it for an unpadded batch. Under context parallelism the
positions of this rank's chunks reach every block by that keyword
(`paratrain.parallel.context.sdpa`), so the Sequential also pipelines with `--cp`.

`sequential_plan` rewrites a tensor-parallel plan written for the model's own names (e.g.
`HF_LLAMA_PLAN`) for the Sequential's.

Only models whose decoder computes exactly this are accepted (`SUPPORTED`): a model that scales
its embeddings, windows its attention or soft-caps its logits would compute something else, and
is refused in one line.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from paratrain.errors import ParatrainError

SUPPORTED = ("llama",)  # model_type values whose forward is embed → layers(positions) → norm → lm_head


class SequentialError(ParatrainError, ValueError):
    """A model `as_sequential` cannot lay out; the message names why."""


class DecoderBlock(nn.Module):
    """One Hugging Face decoder layer as a layer of a Sequential: hidden states in and out, positions by keyword."""

    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # the model's rotary embedding (buffers only), shared by every block

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
        out = self.layer(hidden, attention_mask=None, position_ids=position_ids,
                         position_embeddings=self.rotary(hidden, position_ids))
        return out[0] if isinstance(out, tuple) else out  # transformers < 4.54 returns (hidden, ...)


def as_sequential(model: nn.Module) -> nn.Sequential:
    """`model` (a Hugging Face causal LM of a `SUPPORTED` type) as an nn.Sequential sharing its modules."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", type(model).__name__)
    if kind not in SUPPORTED:
        raise SequentialError(f"as_sequential lays out {', '.join(SUPPORTED)} models, not {kind}; write the model "
                              "as an nn.Sequential of your own, or pipeline it with pp=1")
    inner = model.model
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        raise SequentialError(f"as_sequential needs attn_implementation 'sdpa' or 'eager', not "
                              f"{config._attn_implementation!r}")
    blocks = [DecoderBlock(layer, inner.rotary_emb) for layer in inner.layers[:config.num_hidden_layers]]
    return nn.Sequential(inner.embed_tokens, *blocks, inner.norm, model.lm_head)


def sequential_plan(plan: Mapping, sequential: nn.Sequential, prefix: str = "model.") -> dict:
    """`plan` (patterns over the model's names: `model.embed_tokens`, `model.layers.*…`, `lm_head`) over the
    names `as_sequential` gives the same modules."""
    head = str(len(sequential) - 1)
    renames = {f"{prefix}embed_tokens": "0", f"{prefix}norm": str(len(sequential) - 2), "lm_head": head}
    out = {}
    for pattern, style in plan.items():
        if pattern in renames:
            out[renames[pattern]] = style
        elif pattern.startswith(f"{prefix}layers."):
            index, _, rest = pattern[len(f"{prefix}layers."):].partition(".")
            block = "*" if index == "*" else str(int(index) + 1)
            out[f"{block}.layer" + (f".{rest}" if rest else "")] = style
        else:
            raise SequentialError(f"tensor-parallel plan pattern {pattern!r} names no module of the Sequential")
    return out
