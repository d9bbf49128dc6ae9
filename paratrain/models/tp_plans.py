"""Tensor-parallel plans for the reference model and for the most used Hugging Face families.

A plan maps module-name patterns to the styles of `paratrain.parallel.tensor.plan`; these are the
ready ones. The model chooses its own (`reference_plan`, through `Transformer.tensor_parallel_plan`):
tensor parallelism is told the plan, it never looks the model up. `LLAMA_TP_PLAN` is Megatron's split of the reference `Transformer` (attention and
feed-forward column then row, vocabulary-split embedding and head); `LLAMA_SP_PLAN` adds sequence
parallelism; `HF_LLAMA_PLAN` and `HF_GPT2_PLAN` are the same ideas under Hugging Face's module names.
"""

from __future__ import annotations

import fnmatch
import functools

from paratrain.parallel.tensor.plan import (
    AttentionRegion, Colwise, OutputHead, PartialGradients, Rowwise, SequenceParallelNorm, SequenceShardInput, Style,
    TPRegion, VocabEmbedding,
)
from paratrain.parallel.tensor.layers import TensorParallelError

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


# transformers' tensor-parallel styles (a config's `base_model_tp_plan`) as paratrain's. A fused projection whose
# module cuts its output into parts (Phi-3's qkv_proj, gate_up_proj) is "colwise_gather_output": its rows split
# over tp, its output gathered whole, so the parts are cut as on one process, and the projection after it
# "rowwise_split_input" keeps this rank's features of that whole input. The packed experts have none: the experts
# of a mixture stay whole on every tp rank (as `LLAMA_MOE_TP_PLAN` keeps the reference model's).
_HF_STYLES = {"colwise": Colwise, "rowwise": Rowwise, "replicated_with_grad_allreduce": PartialGradients,
              "colwise_gather_output": functools.partial(Colwise, gather_output=True),
              "rowwise_split_input": functools.partial(Rowwise, split_input=True)}
_HF_EXPERT_STYLES = ("packed_colwise", "moe_tp_experts", "local_colwise", "local_rowwise", "ep_router",
                     "grouped_gemm", "local_packed_rowwise")


def hf_plan(model, sequence_parallel: bool = False) -> dict[str, Style]:
    """The tensor-parallel plan of a transformers model (`paratrain.models.hf.HFCausalLM`) from its config's
    `base_model_tp_plan`, under the model's names.

    Each module holding column-split projections becomes a region entered once (the attention an
    `AttentionRegion` checking whole heads); the embedding and the head are split by vocabulary. With
    sequence parallelism the embedding defers its reduction to the first decoder layer (transformers reads
    the sequence length from the embedding's output), and every replicated module on the residual stream (the
    norms; a mixture of experts) has its grads summed over tp.
    A config without a plan, or with a style paratrain has no counterpart for, refuses in one line.
    """
    hf = model.hf
    base = getattr(hf.config, "base_model_tp_plan", None)
    kind = hf.config.model_type
    if not base:
        raise TensorParallelError(f"{kind} declares no base_model_tp_plan in its transformers config; use --tp 1")
    prefix = hf.base_model_prefix + "."
    names = [n for n, _ in model.named_modules() if n]
    plan: dict[str, Style] = {}
    for pattern, style in base.items():
        full = prefix + pattern
        if style in _HF_EXPERT_STYLES or ".experts" in pattern:
            continue
        if style not in _HF_STYLES:
            raise TensorParallelError(f"{kind}'s tensor-parallel plan splits {pattern} as {style!r}, which paratrain "
                                      f"has no style for (a fused projection); use --tp 1")
        if any(fnmatch.fnmatchcase(n, full) for n in names):  # a family's plan may name modules a config leaves out
            plan[full] = _HF_STYLES[style]()
    for parent in sorted({p.rpartition(".")[0] for p, s in plan.items() if isinstance(s, Colwise)}):
        children = {p.rpartition(".")[2] for p in plan if p.startswith(parent + ".")}
        plan[parent] = AttentionRegion(q="q_proj", kv=("k_proj", "v_proj")) \
            if {"q_proj", "k_proj", "v_proj"} <= children else TPRegion()
    embed = hf.get_input_embeddings()
    plan[_name_of(model, embed)] = VocabEmbedding(defer_sp_reduce=sequence_parallel)
    plan[_name_of(model, hf.get_output_embeddings())] = OutputHead()
    if sequence_parallel:
        # Every replicated module outside the regions runs on this rank's positions only (the norms, a mixture's
        # router and experts, which stay whole): its grads are partial sums over tp.
        plan[f"{prefix}layers.0"] = SequenceShardInput()
        regions = [c for c, style in plan.items() if isinstance(style, TPRegion)]
        for name, module in model.named_modules():
            planned = any(fnmatch.fnmatchcase(name, p) for p in plan)
            inside = any(fnmatch.fnmatchcase(name, r + ".*") for r in regions)
            if name and not planned and not inside and any(p is not None for p in module._parameters.values()):
                plan[name] = SequenceParallelNorm()
    return plan


def _name_of(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)
