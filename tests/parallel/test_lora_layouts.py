"""LoRA and QLoRA over two ranks (DDP, ZeRO-1/2/3 and hybrid sharding, the optimizer offloaded, pipeline, context,
tensor and sequence parallelism) against one plain process: the same losses and adapters under fp32 AdamW's error model, the frozen base bit-unchanged, the
optimizer state of the adapters only.

The reference is the model converted by `convert_to_lora` and trained by plain PyTorch (`reference_run`); every
layout's cases run in one launch of two ranks."""

from __future__ import annotations

import pytest
import torch

from parallel_cases import (TINY, adamw, assert_matches_reference, batches, launch_once, make_model, parallel_run,
                            reference_run)
from paratrain.error_model import FP32_ADAMW
from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel.api import DataParallel, TensorParallel, parallelize
from paratrain.parallel.lora import LoRA, convert_to_lora
from paratrain.train import train_step

STEPS = 3  # B's gradients are non-zero from step 1, A's (B zero at the start) from step 2
# (ZeRO stage, base dtype, ranks of a shard group: 0 all of them, 1 hybrid sharding's replicas of whole shards)
CASES = [(0, None, 0), (0, "nf4", 0), (1, None, 0), (2, None, 0), (2, "nf4", 0), (3, None, 0), (3, "bf16", 0),
         (3, "nf4", 0), (3, "fp8", 0), (3, None, 1), (3, "nf4", 1)]
MESHES = {"pp2": MeshShape(pp=2), "cp2": MeshShape(cp=2), "dp2 offload": MeshShape(dp=2)}
MESH_CASES = [(mesh, base_dtype) for mesh in MESHES for base_dtype in (None, "nf4")]
LORA = dict(rank=4, alpha=8, targets=("attention.*", "w1", "w2"))
# tp2 with sequence parallelism (ZeRO-1, and ZeRO-3 over a model built on the meta device), on a model wide enough
# that a row-parallel linear's NF4 base splits on whole blocks of 64 (wo's and w2's 128 input features, 64 a rank):
# (zero, base dtype, LoRA dropout)
WIDE = ModelConfig(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
TP_CASES = [(1, None, 0.0), (1, "nf4", 0.0), (3, "nf4", 0.0), (1, None, 0.25), (1, "fp8", 0.0), (3, "fp8", 0.0)]
DROPOUT_SEED = 7  # every rank's generator and the reference's: one process's dropout masks


def _adapters(named) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): t.detach().float().clone() for n, t in named
            if ".lora_A." in n or ".lora_B." in n}


def _frozen(model) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
            if ".lora_" not in n}


def _cases(rank, world):
    results = {}
    for zero, base_dtype, dp_shard in CASES:
        mesh = build_mesh(MeshShape(dp=world, dp_shard=dp_shard))
        model, optimizer = parallelize(make_model(), mesh, optimizer=adamw, lora=LoRA(**LORA, base_dtype=base_dtype),
                                       data=DataParallel(zero=zero, grad_reduction="sum"))
        before = _frozen(model)
        losses = parallel_run(model, optimizer, batches(steps=STEPS), rank, world,
                              lambda t: model.comm.all_reduce(t, "dp"))
        after = _frozen(model)
        state = [t.numel() for s in optimizer.state.values() for k, t in s.items() if k != "step"]
        results[zero, base_dtype, dp_shard] = (losses, _adapters(model.full_state_dict().items()),
                                     all(torch.equal(before[n], after[n]) for n in before) and before.keys() == after.keys(),
                                     sum(state), sum(m.numel() for m in model.masters()))
    for name, base_dtype in MESH_CASES:  # the trainer's step: its loss is the global batch's on every rank
        model, optimizer = parallelize(make_model(), build_mesh(MESHES[name]), optimizer=adamw,
                                       lora=LoRA(**LORA, base_dtype=base_dtype),
                                       data=DataParallel(zero=2, grad_reduction="sum",  # the trainer's
                                                         offload="optimizer" if "offload" in name else None))
        before = _frozen(model)
        data = [(x[rank::world], y[rank::world]) if name.startswith("dp") else (x, y) for x, y in batches(steps=STEPS)]
        losses = [train_step(model, optimizer, [batch], 1.0).loss for batch in data]
        after = _frozen(model)
        results[name, base_dtype] = (losses, _adapters(model.full_state_dict().items()),
                                     all(torch.equal(before[n], after[n]) for n in before) and before.keys() == after.keys(),
                                     sum(t.numel() for s in optimizer.state.values() for k, t in s.items() if k != "step"),
                                     sum(m.numel() for m in model.masters()))
    for zero, base_dtype, dropout in TP_CASES:  # both ranks see every batch; each holds half of each split linear
        with torch.device("meta"):  # ZeRO-3 as the trainer builds it: each rank materializes its slices alone
            meta = Transformer(WIDE)
        model, optimizer = parallelize(meta if zero == 3 else make_model(WIDE), build_mesh(MeshShape(tp=2)),
                                       optimizer=adamw,
                                       lora=LoRA(**LORA, base_dtype=base_dtype, dropout=dropout),
                                       tensor=TensorParallel(sequence_parallel=True),
                                       data=DataParallel(zero=zero, grad_reduction="sum"))
        before = _frozen(model)
        torch.manual_seed(DROPOUT_SEED)
        losses = [train_step(model, optimizer, [batch], 1.0).loss for batch in batches(steps=STEPS)]
        after = _frozen(model)
        results["tp2 sp", zero, base_dtype, dropout] = (
            losses, _adapters(model.full_state_dict().items()),
            all(torch.equal(before[n], after[n]) for n in before) and before.keys() == after.keys(),
            sum(t.numel() for s in optimizer.state.values() for k, t in s.items() if k != "step"),
            sum(m.numel() for m in model.masters()))
    return results


_LAUNCH, _REFERENCE = {}, {}


def _reference(base_dtype, cfg: ModelConfig = TINY, dropout: float = 0.0):
    if (base_dtype, cfg, dropout) not in _REFERENCE:
        model = make_model(cfg)
        convert_to_lora(model, LoRA(**LORA, base_dtype=base_dtype, dropout=dropout))
        torch.manual_seed(DROPOUT_SEED)
        losses, params = reference_run(model, batches(steps=STEPS))
        _REFERENCE[base_dtype, cfg, dropout] = losses, _adapters(params.items())
    return _REFERENCE[base_dtype, cfg, dropout]


@pytest.mark.parametrize("zero, base_dtype, dp_shard", CASES)
def test_two_data_ranks_equal_one_process(zero, base_dtype, dp_shard):
    ref_losses, ref_adapters = _reference(base_dtype)
    assert len(ref_adapters) == 2 * 3 * 6  # wq wk wv wo w1 w2 in each of 3 blocks
    for rank, results in enumerate(launch_once(_LAUNCH, 2, _cases, timeout=300)):
        losses, adapters, frozen_unchanged, state, masters = results[zero, base_dtype, dp_shard]
        assert_matches_reference(losses, adapters, ref_losses, ref_adapters, FP32_ADAMW, what=f"rank {rank}")
        assert frozen_unchanged, "a frozen tensor of the base moved"
        # exp_avg and exp_avg_sq of the adapters this rank steps (ZeRO-1/2/3: its half of their rows), nothing more
        total = sum(t.numel() for t in ref_adapters.values())
        assert masters == (total if zero == 0 or dp_shard == 1 else total // 2) and state == 2 * masters


@pytest.mark.parametrize("mesh, base_dtype", MESH_CASES)
def test_pipeline_context_parallelism_and_offload_equal_one_process(mesh, base_dtype):
    """pp2: each stage holds and steps its layers' adapters; cp2: each rank half of every sequence; the optimizer
    of ZeRO-2 dp2 offloaded to the host."""
    ref_losses, ref_adapters = _reference(base_dtype)
    per_rank = [results[mesh, base_dtype] for results in launch_once(_LAUNCH, 2, _cases, timeout=300)]
    gathered = {}
    for rank, (losses, adapters, frozen_unchanged, state, masters) in enumerate(per_rank):
        assert_matches_reference(losses, {}, ref_losses, {}, FP32_ADAMW, what=f"rank {rank}")
        assert frozen_unchanged, "a frozen tensor of the base moved"
        assert state == 2 * masters
        gathered.update(adapters)
    assert_matches_reference(per_rank[0][0], gathered, ref_losses, ref_adapters, FP32_ADAMW)
    total = sum(t.numel() for t in ref_adapters.values())
    assert sum(masters for *_, masters in per_rank) == total  # every adapter stepped once, on one rank


@pytest.mark.parametrize("zero, base_dtype, dropout", TP_CASES)
def test_tensor_and_sequence_parallelism_equal_one_process(zero, base_dtype, dropout):
    """tp2 + sp: a column-parallel linear's B and a row-parallel one's A split with the base (an NF4 base quantized
    whole and its blocks split), the other adapter whole on both ranks; the dropout draws one process's masks."""
    ref_losses, ref_adapters = _reference(base_dtype, WIDE, dropout)
    per_rank = [results["tp2 sp", zero, base_dtype, dropout] for results in launch_once(_LAUNCH, 2, _cases, timeout=300)]
    total = sum(t.numel() for t in ref_adapters.values())
    split = sum(t.numel() for n, t in ref_adapters.items()
                if (".lora_B." in n) != any(f".{row}." in n for row in ("wo", "w2")))  # B of a column, A of a row
    for rank, (losses, adapters, frozen_unchanged, state, masters) in enumerate(per_rank):
        assert_matches_reference(losses, adapters, ref_losses, ref_adapters, FP32_ADAMW, what=f"rank {rank}")
        assert frozen_unchanged, "a frozen tensor of the base moved"
        whole = total - split // 2  # this rank's adapters: the split ones' halves, the others whole
        assert masters == whole and state == 2 * masters  # (one data rank: ZeRO shards nothing)
