"""Muon on every layout against torch.optim.Muon (the blocks' matrices) + torch.optim.AdamW (the rest) in one process."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.api import DataParallel, PipelineParallel, TensorParallel, parallelize
from paratrain.parallel.muon import MuonRecipe, ns_flops
from paratrain.testing import run_on_ranks
from paratrain.models import Transformer
from paratrain.parallel.expert import moe_layers
from parallel_cases import (TINY, ErrorModel, assert_matches_reference, batches, launch_once, loss_sum, make_model,
                            parallel_run)

STEPS = 4

# fp32 reductions in another order, through Muon: Newton–Schulz rounds its input to bf16 (ε = 2⁻⁸), so where a
# gradient element differs in its last fp32 bit an element of the update can differ by a bf16 step, which the
# orthogonalization spreads over its matrix. Measured worst (see the tests' PARATRAIN_ERROR_REPORT) far below these.
FP32_MUON = ErrorModel("fp32 Muon", 1e-5, 1e-2, "reduction order under fp32 rounding, through bf16 Newton-Schulz; "
                                               "compared per tensor", per_step=True)
MUON = {"lr": 0.02, "weight_decay": 0.1}
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def recipe() -> MuonRecipe:
    return MuonRecipe(muon=dict(MUON), adamw=dict(ADAMW))


def reference_optimizers(model, blocks=("layers.",)):
    """torch's own: Muon over the blocks' matrices, AdamW over the rest (vectors without weight decay)."""
    named = list(model.named_parameters())
    matrix = lambda n, p: n.startswith(blocks) and p.dim() == 2  # noqa: E731
    muon = torch.optim.Muon([p for n, p in named if matrix(n, p)], **MUON)
    adamw = torch.optim.AdamW([{"params": [p for n, p in named if not n.startswith(blocks) and p.dim() >= 2]},
                               {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}], **ADAMW)
    return muon, adamw


class PerExpertMuon:
    """torch.optim.Muon on each expert's matrix of stacked [experts, a, b] tensors: one 2-D copy per expert, stepped
    by torch and written back (what "each expert's matrix whole" means, in torch's own terms)."""

    def __init__(self, stacked: list[torch.Tensor]):
        self.stacked = stacked
        self.copies = [[torch.nn.Parameter(t.detach()[e].clone()) for e in range(t.shape[0])] for t in stacked]
        self.muon = torch.optim.Muon([c for copies in self.copies for c in copies], **MUON) if stacked else None

    @torch.no_grad()
    def step(self):
        if self.muon is None:
            return
        for t, copies in zip(self.stacked, self.copies):
            for e, c in enumerate(copies):
                c.copy_(t[e])
                c.grad = t.grad[e].clone()
        self.muon.step()
        for t, copies in zip(self.stacked, self.copies):
            for e, c in enumerate(copies):
                t[e] = c


def reference_run(model, data, clip=1.0, blocks=("layers.",)):
    muon, adamw = reference_optimizers(model, blocks)
    experts = PerExpertMuon([p for n, p in model.named_parameters() if n.startswith(blocks) and p.dim() == 3])
    losses = []
    for x, y in data:
        tokens = (y != -100).sum()
        loss = loss_sum(model, x, y) / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        adamw.step()
        muon.step()
        experts.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}




# -- the layouts ------------------------------------------------------------------------------------------

MOE = dataclasses.replace(TINY, n_layers=2, ffn_dim=48, n_experts=4, top_k=2, expert_ffn_dim=16, aux_loss_coef=0.1,
                          z_loss_coef=0.01)
HF_BLOCKS = ("model.layers.",)


def _hf_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _train(mesh, zero: int, model=None, tensor=None, pipeline=None, moe=False, steps=STEPS):
    """Losses and whole parameters of `steps` Muon steps; the step's bytes by axis and this rank's NS FLOPs."""
    if model is None:
        config = MOE if moe else TINY
        with torch.device("meta"):
            model = Transformer(config)
        init = lambda name, shape: Transformer(config).param_init(name, shape, 0)  # noqa: E731
    else:
        init = None
    model, optimizer = parallelize(model, mesh, optimizer=recipe(), init=init, tensor=tensor, pipeline=pipeline,
                                   data=DataParallel(zero=zero, grad_reduction="sum"))
    for layer in moe_layers(model.module):
        layer.aux_rows = batches(steps=1)[0][0].shape[0]  # the auxiliary loss over the global batch
    data = batches(steps=steps)
    if pipeline is None:
        comm = model.comm
        losses = parallel_run(model, optimizer, data, mesh.coord("dp"), mesh.size("dp"), model.comm_sum)
    else:
        losses = _pipeline_run(model, optimizer, mesh, data)
    model.comm.reset()
    return (losses, {k: v.float() for k, v in model.full_state_dict().items()}, optimizer.ns_flops)


def _pipeline_run(model, optimizer, mesh, data):
    dp, dp_rank = mesh.size("dp"), mesh.coord("dp")
    losses = []
    for x, y in data:
        rows = x.shape[0] // dp
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        micro_batches = [(x[i:i + 2], y[i:i + 2]) for i in range(0, rows, 2)]
        tokens = model.comm_sum(torch.tensor(float((y != -100).sum()), dtype=torch.float64)).item()
        loss_sum = model.train_step(micro_batches, tokens).loss_sum
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(model.comm_sum(loss_sum.double()).item() / tokens)
    return losses


def _two_ranks(rank, world):  # noqa: ARG001
    dp2, tp2, pp2, ep2 = (build_mesh(MeshShape(**s)) for s in ({"dp": 2}, {"tp": 2}, {"pp": 2}, {"dp": 2, "ep": 2}))
    return {
        **{f"zero{z}": _train(dp2, z) for z in (0, 1, 2, 3)},
        "tp2_sp": _train(tp2, 0, tensor=TensorParallel(sequence_parallel=True)),
        "pp2": _train(pp2, 0, pipeline=PipelineParallel(schedule="1f1b")),
        "ep2": _train(ep2, 0, moe=True),
        "ep2_zero1": _train(ep2, 1, moe=True),
        "hf_zero2": _train(dp2, 2, model=_hf_model()),
        "hf_zero3": _train(dp2, 3, model=_hf_model()),
    }


_RESULTS: dict = {}


def _results(world: int, name: str):
    return [per_rank[name] for per_rank in launch_once(_RESULTS, world, _FNS[world], timeout=900)]


def _reference(name: str):
    if name.startswith("hf"):
        return reference_run(_hf_model(), batches(steps=STEPS), blocks=HF_BLOCKS)
    return reference_run(make_model(MOE if name.startswith("ep") else TINY), batches(steps=STEPS))


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "tp2_sp", "pp2", "ep2", "ep2_zero1",
                                  "hf_zero2", "hf_zero3"])
def test_muon_on_two_ranks_equals_torch_in_one_process(name):
    ref_losses, ref_params = _reference(name)
    for rank, (losses, params, _) in enumerate(_results(2, name)):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_MUON, f"{name} rank {rank}")


def _four_ranks(rank, world):  # noqa: ARG001
    hybrid, dp4 = build_mesh(MeshShape(dp=4, dp_shard=2)), build_mesh(MeshShape(dp=4))
    return {"hybrid_zero2": _train(hybrid, 2), "hybrid_zero3": _train(hybrid, 3), "dp4_zero1": _train(dp4, 1)}


_FNS = {2: _two_ranks, 4: _four_ranks}


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["hybrid_zero2", "hybrid_zero3", "dp4_zero1"])
def test_muon_on_four_ranks_equals_torch_in_one_process(name):
    ref_losses, ref_params = _reference(name)
    for rank, (losses, params, _) in enumerate(_results(4, name)):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_MUON, f"{name} rank {rank}")


@pytest.mark.multirank
def test_newton_schulz_work_is_split_over_four_data_ranks():
    """Each rank orthogonalizes its share: at most the average plus the largest matrix (counted per rank)."""
    shapes = [tuple(p.shape) for n, p in make_model().named_parameters() if n.startswith("layers.") and p.dim() == 2]
    per_step = [ns_flops(s, 5) for s in shapes]
    total, largest = STEPS * sum(per_step), STEPS * max(per_step)
    done = [flops for _, _, flops in _results(4, "dp4_zero1")]
    assert sum(done) == total  # every matrix once per step, on one rank
    assert max(done) <= total / 4 + largest, (done, total)


# -- the trainer: a killed run resumes bit-equal ------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.slow
def test_a_killed_muon_run_resumes_bit_equal(tmp_path):
    """`paratrain train --nproc 2 --optimizer muon --zero 1`: rank 1 SIGKILLed in step 7, the launcher restarts the
    job from the step-4 checkpoint (Muon's momentum saved layout-free, as rows of each matrix), and every loss and
    the final weights equal an uninterrupted run's to the bit."""
    from test_faults_launched import assert_bit_equal, launch

    reference, out = tmp_path / "reference", tmp_path / "run"
    assert launch(reference, "--optimizer", "muon", "--zero", "1").returncode == 0
    result = launch(out, "--optimizer", "muon", "--zero", "1", "--max-restarts", "1", fault="sigkill@rank1:step7")
    assert result.returncode == 0, result.stderr
    assert "checkpoints/step-00000004 at step 4" in result.stdout
    assert_bit_equal(out, reference)
