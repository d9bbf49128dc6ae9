"""Tiny transformers causal LMs of the families people fine-tune, built from configs with random weights (no
download) and saved as a model directory: what `paratrain train --init-from DIR` and `--model DIR` read.

Every family is exercised for what sets it apart: Qwen2 (attention biases), Qwen3 (per-head QK norms, head_dim ≠
hidden/heads), Mistral, Gemma 2 (logit soft-capping, scaled embeddings, tied head, eager attention), Phi-3 (fused
qkv and gate/up projections), Qwen3-MoE (a mixture of experts, stored per expert). The vocabulary holds the byte
tokenizer's 259 ids; the norms and biases are perturbed so that a misplaced one changes the loss.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, HIDDEN, LAYERS = 320, 32, 2
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
               eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def _configs():
    import transformers as T

    return {
        "qwen2": lambda: T.Qwen2Config(**_COMMON),
        "qwen3": lambda: T.Qwen3Config(**{**_COMMON, "head_dim": 16}),
        "mistral": lambda: T.MistralConfig(**_COMMON, sliding_window=None),
        "gemma2": lambda: T.Gemma2Config(**{**_COMMON, "head_dim": 8, "tie_word_embeddings": True},
                                         sliding_window=64, final_logit_softcapping=5.0, attn_logit_softcapping=20.0),
        # Mistral attending over a sliding window that covers the tests' sequences: plain causal attention
        "mistral_window": lambda: T.MistralConfig(**_COMMON, sliding_window=32),
        "phi3": lambda: T.Phi3Config(**_COMMON),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**{**_COMMON, "head_dim": 8}, moe_intermediate_size=16, num_experts=4,
                                              num_experts_per_tok=2, norm_topk_prob=True),
    }


FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "phi3", "qwen3_moe")  # and the variant mistral_window


def hf_model(family: str, seed: int = 0):
    """The transformers model of `family`, random weights (seeded), fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[family](), dtype=torch.float32)
    with torch.no_grad():  # the default init leaves norms at 1 and biases at 0: perturb them
        for name, p in model.named_parameters():
            if p.dim() == 1 or "gate.weight" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_family(family: str, directory: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """`hf_model(family)` saved with save_pretrained into `directory` (sharded with an index if `max_shard_size`)."""
    model = hf_model(family, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return Path(directory)


def save_llama_config(directory: Path) -> Path:
    """A Llama of the families' shape, its config.json alone: the directory `--model DIR` trains from scratch."""
    from transformers import LlamaConfig

    LlamaConfig(**_COMMON).save_pretrained(directory)
    return Path(directory)


def hf_loss(model, tokens: torch.Tensor) -> float:
    """transformers' own loss of `tokens` (labels = the tokens, shifted inside the model)."""
    with torch.no_grad():
        return model(input_ids=tokens, labels=tokens).loss.item()
