"""Parameter names of `Transformer` ↔ Hugging Face `LlamaForCausalLM`.

The two models share the rotary convention (rotate-half), so weights move across
under these names unchanged: no permutation of `wq`/`wk` is needed.
"""

from __future__ import annotations

import re


class HFNameError(ValueError):
    """A parameter name has no counterpart in the other naming scheme."""


_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_INV = {v: k for k, v in _TOP.items()}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}
_OURS_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(name: str) -> str:
    """Hugging Face Llama name of our parameter `name`, e.g. layers.3.attention.wq.weight →
    model.layers.3.self_attn.q_proj.weight."""
    return _translate(name, _TOP, _OURS_BLOCK, _BLOCK, "model.layers.{}.{}")


def from_hf_name(name: str) -> str:
    """Our parameter name for the Hugging Face Llama name `name`; the inverse of `hf_name`."""
    return _translate(name, _TOP_INV, _HF_BLOCK, _BLOCK_INV, "layers.{}.{}")


def _translate(name: str, top: dict, block_re: re.Pattern, block: dict, block_fmt: str) -> str:
    if name in top:
        return top[name]
    match = block_re.fullmatch(name)
    if match and match.group(2) in block:
        return block_fmt.format(match.group(1), block[match.group(2)])
    raise HFNameError(f"parameter name {name!r} has no Llama counterpart; check the model's state_dict keys")
