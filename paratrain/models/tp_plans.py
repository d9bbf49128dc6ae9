"""Tensor-parallel plans for the reference model and for the most used Hugging Face families.

A plan maps module-name patterns to the styles of `paratrain.parallel.tensor.plan`; these are the
ready ones. The model chooses its own (`reference_plan`, through `Transformer.tensor_parallel_plan`):
tensor parallelism is told the plan, it never looks the model up. `LLAMA_TP_PLAN` is Megatron's split of the reference `Transformer` (attention and
feed-forward column then row, vocabulary-split embedding and head); `LLAMA_SP_PLAN` adds sequence
parallelism; `HF_LLAMA_PLAN` and `HF_GPT2_PLAN` are the same ideas under Hugging Face's module names.
"""

from __future__ import annotations

from paratrain.parallel.tensor.plan import (
    AttentionRegion, Colwise, OutputHead, Rowwise, SequenceParallelNorm, SequenceShardInput, Style, TPRegion,
    VocabEmbedding,
)

LLAMA_TP_PLAN: dict[str, Style] = {
    "tok_embeddings": VocabEmbedding(),
    "layers.*.attention": AttentionRegion(),
    "layers.*.attention.wq": Colwise(),
    "layers.*.attention.wk": Colwise(),
    "layers.*.attention.wv": Colwise(),
    "layers.*.attention.wo": Rowwise(),
    "layers.*.feed_forward": TPRegion(),
    "layers.*.feed_forward.w1": Colwise(),
    "layers.*.feed_forward.w3": Colwise(),
    "layers.*.feed_forward.w2": Rowwise(),
    "output": OutputHead(),
}

# The reference model with MoE feed-forwards: attention split as above; each MoE layer stays whole on every tp
# rank, which routes the same tokens (its experts may be split over ep instead), so no region wraps it.
LLAMA_MOE_TP_PLAN: dict[str, Style] = {k: v for k, v in LLAMA_TP_PLAN.items() if ".feed_forward" not in k}

LLAMA_SP_PLAN: dict[str, Style] = {
    **LLAMA_TP_PLAN,
    "tok_embeddings": VocabEmbedding(defer_sp_reduce=True),
    "layers.0": SequenceShardInput(),
    "layers.*.attention_norm": SequenceParallelNorm(),
    "layers.*.ffn_norm": SequenceParallelNorm(),
    "norm": SequenceParallelNorm(),
}



def reference_plan(config, sequence_parallel: bool = False) -> dict[str, Style]:
    """The plan of the reference `Transformer` built from `config` (what `Transformer.tensor_parallel_plan` gives)."""
    return LLAMA_SP_PLAN if sequence_parallel else LLAMA_MOE_TP_PLAN if config.is_moe else LLAMA_TP_PLAN


# Hugging Face `LlamaForCausalLM` (and Mistral, Qwen2: the same module names), built from a config or
# loaded: the reference plan under Hugging Face's names. Its attention and MLP are called with keyword
# arguments (`self_attn(hidden_states=...)`): the regions find their input by that keyword.
HF_LLAMA_PLAN: dict[str, Style] = {
    "model.embed_tokens": VocabEmbedding(),
    "model.layers.*.self_attn": AttentionRegion(q="q_proj", kv=("k_proj", "v_proj")),
    "model.layers.*.self_attn.q_proj": Colwise(),
    "model.layers.*.self_attn.k_proj": Colwise(),
    "model.layers.*.self_attn.v_proj": Colwise(),
    "model.layers.*.self_attn.o_proj": Rowwise(),
    "model.layers.*.mlp": TPRegion(),
    "model.layers.*.mlp.gate_proj": Colwise(),
    "model.layers.*.mlp.up_proj": Colwise(),
    "model.layers.*.mlp.down_proj": Rowwise(),
    "lm_head": OutputHead(),
}

# Hugging Face `GPT2LMHeadModel`: the MLP's Conv1D layers split (c_fc by columns, c_proj by rows), the
# tied token embedding and head split by vocabulary. Attention stays replicated: GPT-2 projects q, k and
# v with one fused Conv1D (`attn.c_attn`) whose output the module cuts at a fixed width, so it cannot be
# column-split (`Colwise` refuses it); each tp rank computes the attention whole.
HF_GPT2_PLAN: dict[str, Style] = {
    "transformer.wte": VocabEmbedding(),
    "transformer.h.*.mlp": TPRegion(),
    "transformer.h.*.mlp.c_fc": Colwise(),
    "transformer.h.*.mlp.c_proj": Rowwise(),
    "lm_head": OutputHead(),
}
