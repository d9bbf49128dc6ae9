"""`paratrain plan --lora RANK [--base-dtype bf16|nf4]`: the planner's LoRA against the converted model and the NF4
codec, the model states of a frozen base, the step a frozen base shortens, and the 70B-on-two-24-GB question.

The measured side (a whole step's peak under ZeRO-3 within 10% of the plan) is `tests/parallel/test_lora_memory.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.cli import main
from paratrain.models import ModelConfig, Transformer, get_model_config
from paratrain.parallel.lora import LoRA, convert_to_lora
from paratrain.parallel.nf4 import NF4
from paratrain.parallel.rules import nf4_bytes_per_parameter
from paratrain.plan import Layout, PlanError, Workload, estimate_memory
from paratrain.plan import lora as plan_lora
from paratrain.plan.compute import stage_pass_times, step_flops
from paratrain.plan.ops import Shape, _gemm_seconds, backward_gemms, block_gemms
from paratrain.plan.hardware import get_hardware
from paratrain.plan.search import SearchSpace, search

CFG = ModelConfig(vocab_size=256, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=320, max_seq_len=64)


MOE = dataclasses.replace(CFG, n_experts=4, top_k=2, expert_ffn_dim=64)


@pytest.mark.parametrize("cfg", [CFG, MOE, dataclasses.replace(MOE, shared_expert=True)],
                         ids=["dense", "moe", "moe shared"])
def test_the_planners_adapters_and_base_are_the_converted_models(cfg):
    """The default targets: every block linear (a mixture's router and shared expert; its routed experts, grouped
    tensors, stay frozen in the compute dtype)."""
    model = Transformer(cfg)
    convert_to_lora(model, LoRA(8))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    targets = sum(m.weight.numel() for name, m in model.named_modules() if hasattr(m, "lora_A"))
    assert adapters == cfg.n_layers * plan_lora.adapter_params(cfg, 8)
    assert targets == cfg.n_layers * plan_lora.target_params(cfg)
    assert sum(p.numel() for p in model.layers["0"].parameters()) == plan_lora.block_params(cfg) + \
        plan_lora.adapter_params(cfg, 8)


def test_a_mixture_of_experts_plans_its_frozen_experts_at_the_compute_dtypes_bytes():
    """QLoRA on a mixture: the targets in NF4, the routed experts (no linears) whole in bf16; `plan` answers."""
    nf4 = estimate_memory(Workload.for_model(MOE, seq_len=64, lora=8, base_dtype="nf4"), Layout())
    plain = estimate_memory(Workload.for_model(MOE, seq_len=64, lora=8), Layout())
    targets = MOE.n_layers * plan_lora.target_params(MOE)
    assert plain.params - nf4.params == pytest.approx(targets * (2 - nf4_bytes_per_parameter(2)))
    assert main(["plan", "--model", "mixtral-8x7b", "--seq-len", "2048", "--lora", "16", "--base-dtype", "nf4",
                 "--gpus", "8"]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_bytes_per_parameter_are_the_codecs(dtype):
    weight = torch.randn(384, 2048, dtype=dtype)  # 12,288 blocks: 48 blocks of scales
    packed = NF4.encode(weight)
    mean = packed.mean.nbytes
    assert (packed.nbytes() - mean) / weight.numel() == nf4_bytes_per_parameter(dtype.itemsize)
    assert packed.rows().nbytes + packed.factors.nbytes == packed.nbytes() - mean


@pytest.mark.parametrize("zero", [0, 3])
def test_tensor_parallelism_splits_the_base_and_one_adapter_of_each_linear(zero):
    """tp2: a column-parallel linear's B and a row-parallel one's (o, down) A split with the base, the other adapter
    whole on both ranks (as `paratrain.parallel.tensor.adapters` splits the converted model's); the frozen targets
    and the tables halved, the norms whole."""
    model = Transformer(CFG)
    convert_to_lora(model, LoRA(8))
    split = {name: (m.lora_A.weight.numel() // 2 + m.lora_B.weight.numel() if name.endswith(("wo", "w2"))
                    else m.lora_A.weight.numel() + m.lora_B.weight.numel() // 2)
             for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert sum(split.values()) == CFG.n_layers * plan_lora.adapter_params(CFG, 8, tp=2)
    workload = Workload.for_model(CFG, seq_len=64, lora=8, base_dtype="nf4")
    lora = estimate_memory(workload, Layout(dp=2, tp=2, zero=zero))
    alone = estimate_memory(Workload.for_params(sum(split.values()), seq_len=64), Layout(dp=2, zero=zero))
    assert (lora.grads, lora.master_weights, lora.adam_moments) == (alone.grads, alone.master_weights,
                                                                     alone.adam_moments)
    frozen = sum(p.numel() // (1 if name.endswith("norm.weight") else 2) for name, p in model.named_parameters()
                 if not p.requires_grad and ".weight_nf4" not in name and not any(f"{t}.weight" == name
                                                                                  for t in split))
    targets = CFG.n_layers * plan_lora.target_params(CFG) / 2
    base = (targets * nf4_bytes_per_parameter(2) + frozen * 2) / (2 if zero == 3 else 1)
    assert lora.params == pytest.approx(alone.params + base)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("base_dtype", [None, "bf16", "nf4"])
def test_only_the_adapters_hold_gradients_masters_and_optimizer_state(zero, base_dtype):
    """The frozen base: its stored bytes (whole below ZeRO-3, sharded at it); the adapters: what a model of their
    size holds."""
    dp, psi = 2, CFG.num_params()
    lora = estimate_memory(Workload.for_model(CFG, seq_len=64, lora=8, base_dtype=base_dtype),
                           Layout(dp=dp, zero=zero))
    adapters = CFG.n_layers * plan_lora.adapter_params(CFG, 8)
    alone = estimate_memory(Workload.for_params(adapters, seq_len=64), Layout(dp=dp, zero=zero))
    assert (lora.grads, lora.master_weights, lora.adam_moments) == (alone.grads, alone.master_weights,
                                                                     alone.adam_moments)
    targets = CFG.n_layers * plan_lora.target_params(CFG)
    stored = {None: 2, "bf16": 2, "nf4": nf4_bytes_per_parameter(2)}[base_dtype]
    frozen = (targets * stored + (psi - targets) * 2) / (dp if zero == 3 else 1)
    assert lora.params == pytest.approx(alone.params + frozen)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_lora_keeps_the_adapters_outputs_and_not_the_frozen_norms_values(recompute):
    """Per token and layer, A's output of each of the 7 adapted linears (kept unless the layer is recomputed whole),
    less the two frozen norms' normalized values where an eager block keeps them (no recomputation); the final
    norm's, whatever the mode (it is no block's)."""
    tokens, p = 64, 2
    plain = estimate_memory(Workload.for_model(CFG, seq_len=tokens), Layout(recompute=recompute)).activations
    lora = estimate_memory(Workload.for_model(CFG, seq_len=tokens, lora=8), Layout(recompute=recompute)).activations
    per_layer = {"none": 7 * 8 - 2 * CFG.dim, "selective": 7 * 8, "full": 0}[recompute] * tokens * p
    assert 0 < lora == plain + CFG.n_layers * per_layer - tokens * p * CFG.dim


def test_a_frozen_weight_computes_no_weight_gradient():
    """Per token, 2 FLOPs per parameter of every frozen matmul fewer than the whole model's 6, 6 per adapter
    parameter more; in time, the backward of a micro-batch loses the blocks' weight-gradient matmuls and gains the
    adapters' small ones, its forward gains those alone."""
    plain = Workload.for_model(CFG, seq_len=64, global_batch=4)
    lora = Workload.for_model(CFG, seq_len=64, global_batch=4, lora=8)
    tokens = 4 * 64
    frozen = CFG.n_layers * plan_lora.target_params(CFG) + CFG.vocab_size * CFG.dim
    adapters = CFG.n_layers * plan_lora.adapter_params(CFG, 8)
    assert step_flops(lora, Layout()).model == step_flops(plain, Layout()).model + (6 * adapters - 2 * frozen) * tokens
    big, hw = get_model_config("llama2-7b"), get_hardware("h100-80gb")
    times = [stage_pass_times(Workload.for_model(big, seq_len=4096, global_batch=8, **kw), Layout(dp=8), hw, 0)
             for kw in ({}, {"lora": 16})]
    x = Shape.of(big, 1, 4096, 1, False, "bf16", True)
    weight_grads = big.n_layers * _gemm_seconds(hw, [backward_gemms(g)[1] for g in block_gemms(x)], "bf16")
    assert times[0].backward - times[1].backward == pytest.approx(weight_grads, rel=0.1)
    assert 0 < times[1].forward - times[0].forward < 0.05 * times[0].forward


def test_seventy_billion_parameters_on_two_24_gb_gpus():
    """QLoRA's claim (Dettmers et al. 2023; FSDP-QLoRA): a 70B model's NF4 base and its adapters train on two 24 GB
    GPUs at 2,048 tokens. Llama 2 70B fits as two pipeline stages; Llama 3.1 70B's vocabulary (four times Llama 2's)
    costs each stage its bf16 embedding or head besides, and fits with the parameter shards on the host."""
    hw = get_hardware("h100-80gb", memory_bytes=24e9)
    for name, offload in (("llama2-70b", None), ("llama3.1-70b", "params")):
        workload = Workload.for_model(get_model_config(name), seq_len=2048, global_batch=16, lora=16,
                                      base_dtype="nf4")
        space = SearchSpace(offload=offload, zero=(3,)) if offload else SearchSpace()
        best = search(workload, 2, hw, space).best
        assert best is not None and best.memory.total <= 24e9, name
    plain = Workload.for_model(get_model_config("llama2-70b"), seq_len=2048, global_batch=16)
    assert search(plain, 2, hw).best is None  # without LoRA nothing fits


@pytest.mark.parametrize("argv, message", [
    (["--base-dtype", "nf4"], "--base-dtype nf4 without --lora RANK"),
    (["--lora", "0"], "--lora must be a positive integer"),
    (["--lora", "8", "--fp8", "tensorwise"], "LoRA with --fp8 is not supported yet"),
])
def test_bad_lora_plans_are_one_line_errors(argv, message, capsys):
    assert main(["plan", "--model", "llama2-7b", "--seq-len", "2048", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_lora_needs_the_models_shape():
    with pytest.raises(PlanError, match="--lora needs the model's shape"):
        Workload.for_params(7e9, lora=8)
