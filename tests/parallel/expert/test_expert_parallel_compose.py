"""Expert parallelism composed with the other strategies, each against one process.

ep2 with activation checkpointing (full and selective), in bf16, with ZeRO-3 (expert blocks
sharded over `ep_replicate`, the rest over the data axis), and pp2 × ep2 under GPipe, ZB-H1 and
interleaved 1F1B; every run is `ParallelModel.train_step` over micro-batches then AdamW with
clipping, the MoE's auxiliary loss included, against one process on the whole global batch (fp32:
losses and parameters within 1e-5; bf16: a one-process bf16 run, within the 2% that bf16 keeps
of fp32 elsewhere). The expert load a step reports sums every micro-batch's tokens once, however
often activation checkpointing runs a forward again (which sends its all-to-alls again: counted
here). One launch per world size.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.metrics import moe_counts, moe_layers as layers_by_index
from paratrain.models import Transformer
from paratrain.parallel.api import DataParallel, PipelineParallel, parallelize
from paratrain.parallel.expert import moe_layers
from paratrain.testing import Collectives
from paratrain.error_model import FP32_ADAMW
from parallel_cases import (Layout, adamw, assert_matches_reference, batches, launch_once, make_model, model_difference,
                             reference_run, variant)
from test_expert_parallel import MOE

STEPS, BATCH, LR = 4, 8, 1e-2
MOE4 = dataclasses.replace(MOE, n_layers=4)  # interleaved pp2 × v2: a layer per chunk


@dataclasses.dataclass(frozen=True)
class Case(Layout):
    @property
    def config(self):
        return MOE4 if self.pp > 1 else MOE


CASES = {
    "checkpoint_full": variant(Case, "m2_dp2_ep2_ac-full"),
    "checkpoint_selective": variant(Case, "m2_dp2_ep2_ac-selective"),
    "bf16": variant(Case, "m2_dp2_ep2_bf16"),
    "zero3": variant(Case, "m2_dp2_ep2_zero3"),
    "gpipe": variant(Case, "pp2_gpipe_m2_dp2_ep2"),
    "zb-h1": variant(Case, "pp2_zb-h1_m2_dp2_ep2"),
    "interleaved": variant(Case, "pp2_interleaved_v2_m2_dp2_ep2"),
    "dp4_zero3": variant(Case, "m2_dp4_ep2_zero3"),
}


def _train(case: Case, mesh):
    with torch.device("meta"):
        model = Transformer(case.config)
    model, optimizer = parallelize(model, mesh, optimizer=functools.partial(adamw, lr=LR), precision=case.precision,
                                   init=lambda name, shape: Transformer(case.config).param_init(name, shape, 0),
                                   data=DataParallel(zero=case.zero, grad_reduction="sum"),
                                   activation_checkpointing=case.recompute,
                                   pipeline=PipelineParallel(schedule=case.schedule, virtual_stages=case.virtual_stages))
    losses = []
    for x, y in batches(steps=STEPS, batch=BATCH):
        micro_batches = _my_micro_batches(x, y, mesh, BATCH // case.dp // case.microbatches)
        tokens = float((y != -100).sum())
        loss_sum = model.train_step(micro_batches, tokens).loss_sum
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(model.comm_sum(loss_sum.double()).item() / tokens)
    return losses, {k: v.float() for k, v in model.full_state_dict().items()}


def _my_micro_batches(x, y, mesh, micro: int):
    rows = x.shape[0] // mesh.size("dp")
    lo = mesh.coord("dp") * rows
    return [(x[i:i + micro], y[i:i + micro]) for i in range(lo, lo + rows, micro)]


def _step_load(mesh, checkpointing: str):
    """One step of ep2, 2 micro-batches of 2 rows per rank: (the step's counts summed over the data ranks, as the
    agreement sums `moe_counts`; the last forward's count of assignments, per layer; bytes sent on ep)."""
    with torch.device("meta"):
        model = Transformer(MOE)
    model, _ = parallelize(model, mesh, init=lambda name, shape: Transformer(MOE).param_init(name, shape, 0),
                           activation_checkpointing=checkpointing, data=DataParallel(grad_reduction="sum"))
    x, y = batches(steps=1, batch=BATCH)[0]
    counted = Collectives()
    with counted:
        model.train_step(_my_micro_batches(x, y, mesh, 2), float((y != -100).sum()))
    counts = moe_counts(layers_by_index(model.module), MOE.n_layers, MOE.n_experts)
    summed = {k: model.comm_sum(torch.as_tensor(v, dtype=torch.float64).clone()).item() for k, v in counts.items()}
    last = [int(layer.last_tokens_per_expert.sum()) for layer in moe_layers(model.module)]
    return summed, last, counted.by_axis(mesh).get("ep", 0.0)


def _all_cases(rank, world):  # noqa: ARG001
    results = {}
    for name, case in CASES.items():
        if case.world == world:
            results[name] = _train(case, build_mesh(case.mesh_shape()))
    if world == 2:
        mesh = build_mesh(MeshShape(dp=2, ep=2))
        results["load"] = {mode: _step_load(mesh, mode) for mode in ("none", "full", "selective")}
    return results


def _one_process_bf16(rank, world):  # noqa: ARG001
    return _train(Case(precision="bf16", microbatches=4), build_mesh(MeshShape()))


_CACHE: dict = {}


def _results(world: int, name: str):
    return [per_rank[name] for per_rank in launch_once(_CACHE, world, _all_cases)]


_REFERENCE: dict = {}


def _reference(config):
    if config not in _REFERENCE:
        model = make_model(config)
        for layer in moe_layers(model):
            layer.aux_rows = BATCH
        _REFERENCE[config] = reference_run(model, batches(steps=STEPS, batch=BATCH), lr=LR)
    return _REFERENCE[config]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.precision == "fp32"])
def test_ep_composes_like_one_process(name):
    case = CASES[name]
    ref_losses, ref_params = _reference(case.config)
    for rank, (losses, params) in enumerate(_results(case.world, name)):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW, f"{name} rank {rank}")


def test_ep2_in_bf16_tracks_one_bf16_process():
    """Not bitwise (measured: the losses within 1.1e-4, the model within 6.5e-3, its worst tensor an expert's at
    3.3e-2). The cause is routing: the experts' bf16 matmuls run over other groupings of tokens, their rounding
    differs, and from step 2 one token per layer near a tie is sent to the other of its two best experts (per-step
    expert counts: 62/57 against 61/58 in layer 0; in fp32 every count is equal), moving a whole token's gradient
    between two experts. So: the losses within the 2% that bf16 keeps
    elsewhere (`test_data_parallel.test_bf16_tracks_fp32`), the model within the 1e-2 `paratrain verify`
    allows a bf16 layout."""
    ref_losses, ref_params = launch_once(_CACHE, 1, _one_process_bf16)[0]
    for losses, params in _results(2, "bf16"):
        assert losses == pytest.approx(ref_losses, rel=2e-2)
        assert model_difference(params, ref_params) <= 1e-2


def test_a_steps_expert_load_counts_every_micro_batch_once():
    """Per layer: the step's tokens per expert, summed over the data ranks, are one process's count for the
    whole global batch (same weights, same routing), although each rank ran 2 micro-batches and activation
    checkpointing ran each forward again in backward; the last forward alone saw a quarter of them."""
    model = make_model(MOE)
    x, _ = batches(steps=1, batch=BATCH)[0]
    with torch.no_grad():
        model(x)
    for per_mode in _results(2, "load"):
        for mode, (summed, last, _) in per_mode.items():
            for i, layer in enumerate(moe_layers(model)):
                want = layer.last_tokens_per_expert.tolist()
                assert [int(summed[f"moe.{i}.e{e}"]) for e in range(MOE.n_experts)] == want, (mode, i)
                assert sum(want) == BATCH * 16 * MOE.top_k and last[i] == sum(want) // 4, (mode, i)


def test_recomputation_sends_a_forwards_all_to_alls_again():
    """Without recomputation a step sends, per layer and micro-batch, the counts (E/ep int64 to the other rank)
    and the rows out and back, forward, then the rows again backward: 2·R + C. Recomputing the blocks, full or
    selective (no communication is kept), runs the forward's three all-to-alls again: 3·R + 2·C."""
    counts = MOE.n_layers * 2 * (MOE.n_experts // 2) * 8  # layers × micro-batches × counts sent × int64
    for per_mode in _results(2, "load"):
        plain = per_mode["none"][2]
        rows = (plain - counts) / 2
        assert rows > 0
        for mode in ("full", "selective"):
            assert per_mode[mode][2] == 3 * rows + 2 * counts, mode
