"""Muon on every layout against torch.optim.Muon (the blocks' matrices) + torch.optim.AdamW (the rest) in one process."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.api import DataParallel, PipelineParallel, TensorParallel, parallelize
from paratrain.parallel.muon import MuonRecipe
from paratrain.parallel.rules import newton_schulz_flops as ns_flops
from paratrain.precision import Precision
from paratrain.testing import run_on_ranks
from paratrain.models import Transformer
from paratrain.parallel.expert import moe_layers
from test_data_parallel import _hf_model  # the Llama of transformers, built from a config
import parallel_cases
from paratrain.error_model import FP64_PARITY
from parallel_cases import TINY, assert_matches_reference, batches, launch_once, loss_sum, make_model, parallel_run

STEPS = 3

# The parity runs are in fp64. Newton–Schulz rounds its input to bf16 (ε = 2⁻⁸) whatever the dtype: in fp32 a
# gradient that another reduction order moves by its last bit flips some of those roundings, and the
# orthogonalization spreads each flip over its matrix (measured on this model after 4 steps: 1e-2 to 6e-2 of a
# tiny matrix's norm, on one process against another as much as on any layout; the losses within 1.5e-5). In fp64
# a reordered sum moves a gradient by ~1e-16 of itself, which crosses a bf16 rounding boundary about never: every
# layout must then give one process's numbers to fp64's summation-order bound (`FP64_PARITY`), which a misplaced
# row or a wrong owner misses by orders of magnitude.
FP64 = Precision("fp64", torch.float64, torch.float64, torch.float64)
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
    """One process: torch's Muon on the blocks' matrices (each expert's on its own), AdamW on the rest."""
    muon, adamw = reference_optimizers(model, blocks)
    experts = PerExpertMuon([p for n, p in model.named_parameters() if n.startswith(blocks) and p.dim() == 3])
    return parallel_cases.reference_run(model, data, clip=clip, optimizers=[adamw, muon, experts])




# -- one process, no process group ----------------------------------------------------------------------------

NO_CLIP = 1e9  # clipping by a norm summed in another order would round the step differently; this one scales by 1


def _one_rank_mesh():
    from paratrain.mesh import Mesh

    return Mesh(shape=MeshShape(), rank=0, groups={"pp": None, "dp": None, "tp": None, "world": None})


def _one_process(config, steps=STEPS, factory=None, offload=None):
    model, optimizer = parallelize(make_model(config), _one_rank_mesh(), optimizer=factory or recipe(),
                                   data=DataParallel(offload=offload))
    for layer in moe_layers(model.module):
        layer.aux_rows = batches(steps=1)[0][0].shape[0]
    losses = parallel_run(model, optimizer, batches(steps=steps), 0, 1, lambda t: None, clip=NO_CLIP)
    return losses, {k: v.clone() for k, v in model.full_state_dict().items()}, optimizer


@pytest.mark.filterwarnings("ignore:offload on the CPU")
@pytest.mark.parametrize("moe, offload", [(False, None), (True, None), (True, "optimizer")],
                         ids=["dense", "moe", "moe-offload"])
def test_one_process_is_torchs_muon_and_adamw_to_the_bit(moe, offload):
    """The recipe on one rank: torch.optim.Muon on the blocks' matrices (each expert's matrix of an MoE), AdamW on
    the rest, bit for bit; the Newton–Schulz FLOPs counted are every matrix's, every step. Offloaded: the momentum
    and AdamW's moments are the host masters' state, apart from every tensor the engine computes with, and each
    update goes to the device and back through its staging buffer: the same bits."""
    config = MOE if moe else TINY
    reference = make_model(config)
    for layer in moe_layers(reference):
        layer.aux_rows = batches(steps=1)[0][0].shape[0]
    ref_losses, ref_params = reference_run(reference, batches(steps=STEPS), clip=NO_CLIP)
    losses, params, optimizer = _one_process(config, offload=offload)
    assert losses == pytest.approx(ref_losses, rel=1e-6)  # (summed in fp64 here, in fp32 there)
    for name, value in ref_params.items():
        assert torch.equal(params[name], value), name
    shapes = [p.shape for n, p in reference.named_parameters() if n.startswith("layers.") and p.dim() >= 2]
    assert optimizer.ns_flops == STEPS * sum(ns_flops(s) * (s[0] if len(s) == 3 else 1) for s in shapes)
    if offload:
        model = optimizer.model
        host = {t.untyped_storage().data_ptr() for t in model.masters()}
        engine = {t.untyped_storage().data_ptr() for t in [*model.engine.masters(), *model.module.parameters()]}
        momenta = [s["momentum_buffer"] for s in optimizer.state.values() if "momentum_buffer" in s]
        moments = [s["exp_avg"] for s in optimizer.state.values() if "exp_avg" in s]
        assert momenta and moments and {id(p) for p in optimizer.state} <= {id(m) for m in model.masters()}
        state = {t.untyped_storage().data_ptr() for t in momenta + moments}
        staging = {t.untyped_storage().data_ptr() for t in optimizer.host.buffers.values()}
        assert host and not (host | state | staging) & engine and len(optimizer.host.buffers) == len(momenta)


def test_the_planner_counts_muons_state_as_the_optimizer_holds_it():
    """One fp32 momentum buffer per matrix element, Adam's two moments for the rest: the planner's bytes equal the
    state tensors of a real step."""
    from paratrain.parallel.contract import optimizer_state_bytes
    from paratrain.plan.memory import Layout, Workload, stage_model_states

    _, _, optimizer = _one_process(TINY, steps=1)
    planned = stage_model_states(Workload.for_model(TINY, precision="fp32", optimizer="muon"), Layout(), 0)
    assert optimizer_state_bytes(optimizer) == planned.adam_moments
    adamw = stage_model_states(Workload.for_model(TINY, precision="fp32"), Layout(), 0)
    assert planned.adam_moments < adamw.adam_moments


@pytest.mark.filterwarnings("ignore:offload on the CPU")
def test_the_planner_counts_muons_offloaded_state_as_the_host_holds_it():
    """Offloaded: the host's masters and gradient buffers, the momentum and AdamW's moments, and the staging
    buffers of the bf16 updates are the planner's host bytes; nothing of the optimizer's is left on the device."""
    from paratrain.parallel.contract import optimizer_state_bytes
    from paratrain.plan.memory import Layout, Workload, stage_model_states

    _, _, optimizer = _one_process(TINY, steps=1, offload="optimizer")
    held = optimizer.model.offload.host_bytes() + optimizer_state_bytes(optimizer) + optimizer.host.host_bytes()
    workload = Workload.for_model(TINY, precision="fp32", optimizer="muon")
    planned = stage_model_states(workload, Layout(offload="optimizer"), 0)
    assert planned.host == held and planned.optimizer_state == 0
    assert planned.host < stage_model_states(Workload.for_model(TINY, precision="fp32"), Layout(offload="optimizer"),
                                             0).host


def test_the_planner_prices_newton_schulz_and_its_exchange_only_with_muon():
    from paratrain.plan.collectives import dp_collectives
    from paratrain.plan.compute import newton_schulz_seconds
    from paratrain.plan.hardware import get_hardware
    from paratrain.plan.memory import Layout, Workload
    from paratrain.plan.muon import muon_sent_bytes, stage_muon_params

    model = dataclasses.replace(TINY, n_layers=4)
    h200, layout = get_hardware("h200"), Layout(dp=4, zero=1)
    muon, adamw = (Workload.for_model(model, optimizer=o) for o in ("muon", "adamw"))
    assert newton_schulz_seconds(adamw, layout, h200, 0) == 0 < newton_schulz_seconds(muon, layout, h200, 0)
    one_rank = newton_schulz_seconds(muon, Layout(), h200, 0)
    assert newton_schulz_seconds(muon, layout, h200, 0) == pytest.approx(one_rank / 4)  # the work is split
    sent = {o: sum(c.bytes_sent for c in dp_collectives(w, layout, 0)["dp"].calls) for o, w in (("m", muon),
                                                                                                 ("a", adamw))}
    elements = stage_muon_params(muon, layout, 0, 0.0)
    assert sent["m"] - sent["a"] == pytest.approx(muon_sent_bytes(elements, 4, 1)) and elements > 0


def test_the_planner_prices_muons_offloaded_step_whole_and_unoverlapped():
    """Offloaded Muon steps in the caller's thread once every gradient is on the host: the copies, the host's
    passes and the bf16 update's way out and back one after the other, none beside the next forward."""
    from paratrain.plan import compute
    from paratrain.plan.hardware import get_hardware
    from paratrain.plan.memory import Layout, Workload
    from paratrain.plan.muon import MUON_HOST_BYTES, stage_muon_params

    h200, model = get_hardware("h200"), dataclasses.replace(TINY, n_layers=4)
    layout = Layout(dp=2, zero=1, offload="optimizer")
    muon, adamw = (Workload.for_model(model, optimizer=o) for o in ("muon", "adamw"))
    seconds = {o: [compute._optimizer_seconds(w, layout, h200, 0, 1, f) for f in (0.0, 1e-3)]
               for o, w in (("muon", muon), ("adamw", adamw))}
    assert seconds["muon"][0] == seconds["muon"][1] and seconds["adamw"][1] < seconds["adamw"][0]
    elements, m = 1e6, 4e5
    serial = (h200.host_seconds(28 * (elements - m) + MUON_HOST_BYTES * m, 1) + 2 * h200.copy_seconds(4 * elements)
              + 2 * h200.copy_seconds(2 * m))
    assert compute.offload_seconds(h200, elements, 1, muon=m) == pytest.approx(serial)
    assert stage_muon_params(muon, layout, 0, 0.0) > 0


# -- bad input: one line each ---------------------------------------------------------------------------------

def test_torchs_muon_over_vectors_says_to_use_the_recipe():
    from paratrain.parallel.muon import MuonConfigError

    with pytest.raises(MuonConfigError, match=r"optimizer=torch.optim.Muon over \S+ of shape \[32\], which is not "
                                              "a matrix: use paratrain.MuonRecipe") as info:
        parallelize(make_model(), _one_rank_mesh(), optimizer=functools.partial(torch.optim.Muon, lr=0.02))
    assert "\n" not in str(info.value)


def test_a_muon_option_torch_lacks_is_named():
    from paratrain.parallel.muon import MuonConfigError

    with pytest.raises(MuonConfigError, match=r"Muon option 'ns_iters': torch \S+'s torch.optim.Muon has no such "
                                              "option; use one of adjust_lr_fn, eps, lr, momentum, nesterov, "
                                              "ns_coefficients, ns_steps, weight_decay"):
        MuonRecipe(muon={"ns_iters": 5})


@pytest.mark.parametrize("args, message", [
    (["--optimizer", "sgd"], "--optimizer must be one of adamw, muon, got 'sgd'"),
    (["--optimizer", "muon", "--muon-adjust-lr", "rms"], "--muon-adjust-lr must be one of original, match_rms_adamw"),
    (["--optimizer", "muon", "--muon-momentum", "1.5"], "--muon-momentum must be in [0, 1), got 1.5"),
])
def test_bad_optimizer_options_end_in_one_line(args, message, tmp_path, capsys):
    from paratrain.cli import main

    assert main(["train", "--steps", "1", "--out", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()  # refused before anything is written or launched


@pytest.mark.parametrize("args, message", [
    (["plan", "--model", "tiny", "--gpus", "4", "--optimizer", "sgd"], "--optimizer must be adamw or muon, got 'sgd'"),
    (["plan", "--params", "7B", "--gpus", "4", "--optimizer", "muon"], "--optimizer muon needs the model's shape"),
    (["verify", "--layouts", "dp2", "--optimizer", "sgd"], "--optimizer must be one of adamw, muon, got 'sgd'"),
])
def test_plan_and_verify_refuse_an_unknown_optimizer_in_one_line(args, message, capsys):
    from paratrain.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_verifys_default_bound_is_the_optimizers_too():
    """fp32: Muon's own bound (Newton–Schulz's bf16 input, rounded in every run), looser than AdamW's; in 16-bit or
    FP8 the looser of the precision's and Muon's, each component."""
    from paratrain.error_model import BF16_ADAMW, FP32_ADAMW_MODEL, FP8_ADAMW, MUON, default_bound

    assert default_bound("fp32", optimizer="adamw") is FP32_ADAMW_MODEL and default_bound("fp32", optimizer="muon") is MUON
    assert MUON.param_rtol > FP32_ADAMW_MODEL.param_rtol and MUON.loss_rtol > FP32_ADAMW_MODEL.loss_rtol
    for precision, fp8, base in (("bf16", "", BF16_ADAMW), ("bf16", "rowwise", FP8_ADAMW)):
        bound = default_bound(precision, fp8, "muon")
        assert bound.bounds(3) == (3 * max(base.loss_rtol, MUON.loss_rtol), 3 * max(base.param_rtol, MUON.param_rtol))
        assert "Muon" in bound.name and bound.scope == "model"


# -- the layouts ------------------------------------------------------------------------------------------

MOE = dataclasses.replace(TINY, n_layers=2, ffn_dim=48, n_experts=4, top_k=2, expert_ffn_dim=16, aux_loss_coef=0.1,
                          z_loss_coef=0.01)
HF_BLOCKS = ("model.layers.",)


def _train(mesh, zero: int, model=None, tensor=None, pipeline=None, moe=False, steps=STEPS, offload=None):
    """Losses and whole parameters of `steps` Muon steps; the step's bytes by axis and this rank's NS FLOPs."""
    if model is None:
        config = MOE if moe else TINY
        with torch.device("meta"):
            model = Transformer(config).double()
        init = lambda name, shape: Transformer(config).param_init(name, shape, 0).double()  # noqa: E731
    else:
        model, init = model.double(), None
    model, optimizer = parallelize(model, mesh, optimizer=recipe(), init=init, tensor=tensor, pipeline=pipeline,
                                   precision=FP64, data=DataParallel(zero=zero, grad_reduction="sum", offload=offload))
    for layer in moe_layers(model.module):
        layer.aux_rows = batches(steps=1)[0][0].shape[0]  # the auxiliary loss over the global batch
    data = batches(steps=steps)
    if pipeline is None:
        comm = model.comm
        losses = parallel_run(model, optimizer, data, mesh.coord("dp"), mesh.size("dp"), model.comm_sum)
    else:
        losses = _pipeline_run(model, optimizer, mesh, data)
    model.comm.reset()
    return (losses, {k: v.double() for k, v in model.full_state_dict().items()}, optimizer.ns_flops)


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
        # offloaded: the momentum and AdamW's state on the host, the pieces exchanged and orthogonalized on the device
        **{f"zero{z}_offload": _train(dp2, z, offload="optimizer") for z in (0, 1, 2, 3)},
        "zero3_offload_params": _train(dp2, 3, offload="params"),
        "tp2_sp_offload": _train(tp2, 0, tensor=TensorParallel(sequence_parallel=True), offload="optimizer"),
        "pp2_offload": _train(pp2, 0, pipeline=PipelineParallel(schedule="1f1b"), offload="optimizer"),
    }


_RESULTS: dict = {}


def _results(world: int, name: str):
    return [per_rank[name] for per_rank in launch_once(_RESULTS, world, _FNS[world], timeout=900)]


def _reference(name: str):
    if name.startswith("hf"):
        return reference_run(_hf_model().double(), batches(steps=STEPS), blocks=HF_BLOCKS)
    model = make_model(MOE if name.startswith("ep") else TINY).double()
    for layer in moe_layers(model):
        layer.aux_rows = batches(steps=1)[0][0].shape[0]
    return reference_run(model, batches(steps=STEPS))


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "tp2_sp", "pp2", "ep2", "ep2_zero1",
                                  "hf_zero2", "hf_zero3", "zero0_offload", "zero1_offload", "zero2_offload",
                                  "zero3_offload", "zero3_offload_params", "tp2_sp_offload", "pp2_offload"])
def test_muon_on_two_ranks_equals_torch_in_one_process(name):
    ref_losses, ref_params = _reference(name)
    for rank, (losses, params, _) in enumerate(_results(2, name)):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP64_PARITY, f"{name} rank {rank}")


def _four_ranks(rank, world):  # noqa: ARG001
    hybrid, dp4 = build_mesh(MeshShape(dp=4, dp_shard=2)), build_mesh(MeshShape(dp=4))
    dp2_tp2 = build_mesh(MeshShape(dp=2, tp=2))
    sp = TensorParallel(sequence_parallel=True)
    return {"hybrid_zero2": _train(hybrid, 2), "hybrid_zero3": _train(hybrid, 3), "dp4_zero1": _train(dp4, 1),
            "dp2_tp2_sp_zero1": _train(dp2_tp2, 1, tensor=sp), "dp2_tp2_sp_zero3": _train(dp2_tp2, 3, tensor=sp)}


_FNS = {2: _two_ranks, 4: _four_ranks}


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["hybrid_zero2", "hybrid_zero3", "dp4_zero1", "dp2_tp2_sp_zero1", "dp2_tp2_sp_zero3"])
def test_muon_on_four_ranks_equals_torch_in_one_process(name):
    ref_losses, ref_params = _reference(name)
    for rank, (losses, params, _) in enumerate(_results(4, name)):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP64_PARITY, f"{name} rank {rank}")


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

KILLED = {"zero1": ("--zero", "1"), "zero2_offload": ("--zero", "2", "--offload", "optimizer")}
KILLED_STEPS = 8  # the kill in step 7, the resume from step 4's checkpoint, one step after the killed one
# A small corpus (the json package's sources) and one held-out batch: the default corpus's load and statistics, and
# eight held-out batches, cost each run seconds the comparison of its steps does not need.
KILLED_DATA = ("--data", str(Path(json.__file__).parent), "--eval-batches", "1")


def _uninterrupted_runs(rank, world, runs):  # noqa: ARG001
    """Each command's `train(cfg)` straight through on these ranks, as each worker of `--nproc 2` runs it."""
    from paratrain.cli import build_parser
    from paratrain.commands.options import config_from_args
    from paratrain.train import train

    for argv in runs:
        train(config_from_args(build_parser().parse_args(argv)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run of each layout of `KILLED`, all in one launch of 2 ranks: `root / layout`."""
    from test_faults_launched import command

    root = tmp_path_factory.mktemp("muon-uninterrupted")
    runs = [command(root / name, "--optimizer", "muon", *layout, *KILLED_DATA, "--steps", str(KILLED_STEPS))[3:]
            for name, layout in KILLED.items()]
    run_on_ranks(_uninterrupted_runs, 2, runs, timeout=300)
    return root


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(KILLED))
def test_a_killed_muon_run_resumes_bit_equal(uninterrupted, tmp_path, layout):
    """`paratrain train --nproc 2 --optimizer muon --zero 1` (and ZeRO-2 with the optimizer offloaded): rank 1
    SIGKILLed in step 7, the launcher restarts the job from the step-4 checkpoint (Muon's momentum saved
    layout-free, as rows of each matrix; from the host under offload), and every loss and the final weights equal
    an uninterrupted run's of the same options on two ranks to the bit."""
    from test_faults_launched import assert_bit_equal, launch

    out = tmp_path / "run"
    result = launch(out, "--optimizer", "muon", *KILLED[layout], *KILLED_DATA, "--steps", str(KILLED_STEPS), "--max-restarts", "1",
                    fault="sigkill@rank1:step7")
    assert result.returncode == 0, result.stderr
    assert "checkpoints/step-00000004 at step 4" in result.stdout
    assert_bit_equal(out, uninterrupted / layout, steps=KILLED_STEPS)


# -- verify --------------------------------------------------------------------------------------------------

@pytest.mark.multirank
def test_verify_with_muon_passes_a_sound_layout_and_fails_a_broken_one(capsys, monkeypatch, tmp_path):
    """`paratrain verify --optimizer muon` at its default tolerance (fp32, Newton–Schulz in bf16 in every run):
    ZeRO-3 against one process PASSes; rank 1 negating its gradients FAILs. (Every other layout's Muon is held to
    torch's in one process by the tests above; this is verify's own path, its bound and its verdict.) The model: a
    small Llama directory trained from scratch; on a CPU without bf16 matrix units, Newton–Schulz's bf16 products
    on `tiny`'s 256 x 688 matrices take seconds a step."""
    pytest.importorskip("transformers")
    from hf_families import save_llama_config
    from paratrain.cli import main
    from paratrain.faults import FAULT_ENV
    from test_verify import SMALL

    assert SMALL[:2] == ["--model", "tiny"]
    verify = ["verify", "--model", str(save_llama_config(tmp_path / "llama")), *SMALL[2:], "--optimizer", "muon"]
    assert main([*verify, "--layouts", "dp2,zero3"]) == 0, capsys.readouterr().out
    table = capsys.readouterr().out.split("layout ")[-1].splitlines()
    assert [line.split()[5] for line in table[1:]] == ["PASS"], table
    monkeypatch.setenv(FAULT_ENV, "negate_grads@rank1:step*")
    assert main([*verify, "--layouts", "dp2,zero2"]) == 1
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[0] == "dp2,zero2" and row[5] == "FAIL", row
