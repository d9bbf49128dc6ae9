"""A Hugging Face causal language model laid out for pipeline stages, from its own modules.

Pipeline parallelism cuts a model between its decoder layers, and each stage hands the next one
tensor. transformers' `…ForCausalLM` does not: its inner model builds the attention masks and the
rotary embeddings once and hands them to every decoder layer. For the families whose forward is

    embed_tokens → decoder layers (positions, mask of the layer's kind) → norm → lm_head (→ logit soft-cap)

(`paratrain.models.hf.PIPELINE_FAMILIES`, each proven against transformers' logits; the module names are those
the config's `base_model_pp_plan` gives) the same modules (the same parameters, nothing copied) are laid out two ways:

- `LayeredCausalLM`: the trainer's (`--pp`). A `paratrain.parallel.pipeline.stages.LayeredModel` whose
  parameter names are transformers' own (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``),
  so that a pipelined run's checkpoints and export are those of any other layout. Its forward takes token
  ids, or the hidden states where a stage lacks the embedding, and returns the logits, or the hidden states
  where it lacks the head.
- `as_sequential`: an `nn.Sequential` of embed_tokens · DecoderBlock(layer i) · norm · lm_head
  (· SoftCap), for `parallelize` and `verify --model-factory` users (its names are the Sequential's).

Every decoder layer gets what the family's own forward gives it: the rotary embeddings of the token
positions (by the keyword `position_ids`, default 0..s-1), and the mask of its kind (`layer_types`: full
or sliding-window attention; a family without them: the sliding window when the config sets one) made
by transformers' own `create_causal_mask` / `create_sliding_window_causal_mask`, which for unpadded SDPA
attention is none (`is_causal=True`) and for eager attention (Gemma 2's soft-capped scores) the causal,
or windowed, mask. Each layer sees the whole sequence, so a sliding window is kept under pipelining. Under
context parallelism the positions of this rank's chunks reach every layer by that keyword
(`paratrain.parallel.context.sdpa`).

`sequential_plan` rewrites a tensor-parallel plan written for the model's own names (e.g.
`HF_LLAMA_PLAN`) for the Sequential's. Another family, or a model whose pipeline plan names other
modules, is refused in one line saying why.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from paratrain.models.hf import PIPELINE_FAMILIES, HFCausalLM, SequentialError, check_layable, layer_kinds

def layer_masks(config, hidden: torch.Tensor, attention_mask, position_ids: torch.Tensor, kinds) -> dict:
    """{layer kind: the mask transformers gives a layer of that kind} for `hidden` [B, S, D] at `position_ids`. No
    `attention_mask`: an unpadded batch, every token attended (given none, transformers would read a jump in the
    positions, as context parallelism's two chunks have, as two packed sequences and mask them apart)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)

    make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    return {kind: make[kind](config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                             position_ids=position_ids) for kind in set(kinds)}


def _positions(hidden: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device)[None] if position_ids is None else position_ids


def _layer_output(out):
    return out[0] if isinstance(out, tuple) else out  # transformers < 4.54 returns (hidden, ...)


def soft_cap(config, logits: torch.Tensor) -> torch.Tensor:
    """The logits as the family's head returns them: Gemma 2's `final_logit_softcapping` (cap · tanh(z / cap))."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


class LayeredCausalLM(HFCausalLM):
    """An `HFCausalLM` laid out for pipeline stages (a `LayeredModel`), under transformers' parameter names.

    Its ``model`` is a container of the inner model's modules with the decoder layers in a ModuleDict
    (``model.layers.0`` …, as transformers names them); the split prunes it. `forward(tokens or hidden,
    position_ids, attention_mask, documents)` computes what the stage holds (see the module)."""

    def __init__(self, model: HFCausalLM):
        hf = model.hf
        embed, layers, norm = check_layable(hf.config)
        nn.Module.__init__(self)
        object.__setattr__(self, "hf", hf)  # as HFCausalLM holds it: not a child
        self.config = model.config
        prefix = hf.base_model_prefix
        inner = getattr(hf, prefix)
        head = next(n for n, m in hf.named_children() if m is hf.get_output_embeddings())
        body = nn.Module()
        for name, child in inner.named_children():
            if name == layers:
                child = nn.ModuleDict({str(i): child[i] for i in range(hf.config.num_hidden_layers)})
            elif name not in (embed, norm) and any(True for _ in child.parameters()):
                raise SequentialError(f"{hf.config.model_type}'s {prefix}.{name} holds parameters outside its "
                                      "pipeline plan")
            body.add_module(name, child)
        nn.Module.__setattr__(self, prefix, body)  # not transformers' own inner model, which stays whole
        setattr(self, head, hf.get_output_embeddings())
        self.pipeline_layers = f"{prefix}.{layers}"
        self.pipeline_first = (f"{prefix}.{embed}",)
        self.pipeline_last = (f"{prefix}.{norm}", head)
        self.parts = (prefix, embed, layers, norm, head)
        self.kinds = layer_kinds(hf.config)

    def get_output_embeddings(self) -> nn.Module | None:
        """The output head, None on a stage that does not hold it."""
        return getattr(self, self.parts[4])

    @property
    def documents_from_tokens(self) -> bool:
        """Whether a stage that takes hidden states needs the micro-batch's token ids (`forward`'s `documents`):
        with `config.document_eos` (--document-mask), to keep the packed documents apart."""
        return self.config.document_eos is not None

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of token ids [B, S] (`HFCausalLM.forward`'s); a stage without the embedding takes hidden
        states [B, S, D], one without the head returns them. With `config.document_eos` the packed documents are
        kept apart, found in `documents` (the whole sequences' ids) where the stage does not take the tokens."""
        prefix, embed, layers, norm, head = self.parts
        body = getattr(self, prefix)
        embedding = getattr(body, embed)
        hidden = embedding(tokens) if embedding is not None else tokens
        if self.config.document_eos is not None:
            ids = documents if documents is not None else tokens if embedding is not None else None
            if ids is None:
                raise ValueError("document masking needs the token ids: a pipeline stage that takes hidden states "
                                 "takes the micro-batch's token ids as `documents`")
            rows = position_ids[0] if position_ids is not None and documents is not None else None
            position_ids, attention_mask = self.document_layout(ids, rows)
        position_ids = _positions(hidden, position_ids)
        blocks = getattr(body, layers)
        kinds = [self.kinds[int(i)] for i in blocks]
        masks = layer_masks(self.hf.config, hidden, attention_mask, position_ids, kinds)
        rotary = body.rotary_emb(hidden, position_ids)
        for kind, layer in zip(kinds, blocks.values()):
            hidden = _layer_output(layer(hidden, attention_mask=masks[kind], position_ids=position_ids,
                                         position_embeddings=rotary))
        final = getattr(body, norm)
        hidden = final(hidden) if final is not None else hidden
        output = getattr(self, head)
        return soft_cap(self.hf.config, output(hidden)) if output is not None else hidden


class DecoderBlock(nn.Module):
    """One Hugging Face decoder layer as a layer of a Sequential: hidden states in and out, positions by keyword."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config, kind: str = "full_attention"):
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # the model's rotary embedding (buffers only), shared by every block
        self.kind = kind
        self.hf_config = config  # transformers' config: what its mask functions read

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        position_ids = _positions(hidden, position_ids)
        mask = layer_masks(self.hf_config, hidden, None, position_ids, [self.kind])[self.kind]
        return _layer_output(self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                                        position_embeddings=self.rotary(hidden, position_ids)))


class SoftCap(nn.Module):
    """The head's logit soft-capping (`soft_cap`) as the last layer of a Sequential."""

    def __init__(self, config):
        super().__init__()
        self.hf_config = config

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.hf_config, logits)


def as_sequential(model: nn.Module) -> nn.Sequential:
    """`model` (a Hugging Face causal LM of a `PIPELINE_FAMILIES` type) as an nn.Sequential sharing its modules."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", type(model).__name__)
    if kind not in PIPELINE_FAMILIES:
        raise SequentialError(f"as_sequential lays out {', '.join(PIPELINE_FAMILIES)} models, not {kind}; write the "
                              "model as an nn.Sequential of your own, or pipeline it with pp=1")
    embed, layers, norm = check_layable(config)
    inner = getattr(model, model.base_model_prefix)
    blocks = [DecoderBlock(layer, inner.rotary_emb, config, kind)
              for layer, kind in zip(getattr(inner, layers)[:config.num_hidden_layers], layer_kinds(config))]
    cap = [SoftCap(config)] if getattr(config, "final_logit_softcapping", None) is not None else []
    return nn.Sequential(getattr(inner, embed), *blocks, getattr(inner, norm), model.get_output_embeddings(), *cap)


def sequential_plan(plan: Mapping, sequential: nn.Sequential, prefix: str = "model.") -> dict:
    """`plan` (patterns over the model's names: `model.embed_tokens`, `model.layers.*…`, `lm_head`) over the
    names `as_sequential` gives the same modules."""
    head = next(str(i) for i in reversed(range(len(sequential))) if not isinstance(sequential[i], SoftCap))
    renames = {f"{prefix}embed_tokens": "0", f"{prefix}norm": str(int(head) - 1), "lm_head": head}
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
