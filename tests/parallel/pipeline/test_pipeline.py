"""Pipeline parallelism against one process: every schedule, pp 2 and 4, 1 to 8 micro-batches, 3D.

The pipeline entries of `parallel_cases.LAYOUTS`. Each case trains AdamW steps (clipping included) of the same
global batches as one process, with uneven target counts per row, so the token-weighted loss over micro-batches
is exercised. fp64 makes the comparison exact (1e-9): 3 steps show a schedule right (a wrong gradient moves the
second step's loss and the parameters by far more; the second step's transfers are the steady ones). One fp32
case per schedule holds FP32_ADAMW's bound over the same 3 steps against one fp32 process at lr 1e-3 (at 1e-2 an
8-layer toy is chaotic in fp32: 8 micro-batches of one row round differently from one batch of 8, and by step
20 that shows at ~4e-5 whatever the schedule). Each case's model has one block per model chunk (pp × virtual
stages): a schedule moves the same boundary tensors whatever a chunk computes, and more blocks only cost each
micro-batch more. All cases of one world size share one launch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from torch import nn

from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import Transformer
from paratrain.parallel.api import DataParallel, ParallelConfigError, PipelineParallel, TensorParallel, parallelize
from paratrain.parallel.pipeline.stages import PipelineError, balanced_boundaries, split_for_pipeline
from paratrain.parallel.pipeline.schedules import ScheduleError
from paratrain.precision import DTYPES, Precision
from paratrain.testing import run_on_ranks
from paratrain.error_model import FP32_ADAMW, FP64_PARITY
from parallel_cases import (BATCH, LR, SEQ, TINY, Layout, adamw, assert_matches_reference, batches, launch_once,
                             make_model, pipelines, reference_run, variant)

FP64 = Precision("fp64", torch.float64, torch.float64, torch.float64)
EIGHT_LAYERS = dataclasses.replace(TINY, n_layers=8)


@dataclasses.dataclass(frozen=True)
class Case(Layout):
    tied: bool = False  # the head tied to the embedding: a copy of the table on the first and the last stage
    blocks: int = 0  # the model's blocks; 0: one per model chunk

    @property
    def config(self):
        """`blocks` blocks, by default one per model chunk, on each of the pp × virtual stages."""
        return dataclasses.replace(TINY, n_layers=self.blocks or self.pp * self.virtual_stages,
                                   tie_embeddings=self.tied)

    @property
    def fp32(self) -> bool:
        return self.precision == "fp32"  # else fp64, where agreement with one process is exact (1e-9)

    @property
    def steps(self) -> int:
        return 3

    @property
    def lr(self) -> float:
        return 1e-3 if self.fp32 else LR


CASES = {name: variant(Case, name) for name in [
    *pipelines(2, "fp64"), *pipelines(4, "fp64"), *pipelines(2, "fp32"), *pipelines(4, "fp32"),
    "pp2_interleaved_v2_m4_tp2_sp_fp64",  # on 4 ranks: tensor parallelism with sequence parallelism across stages
    # 3D, on 8 ranks; hybrid sharding inside each stage: 2 replicas × 2 shards of ZeRO-1/2
    "pp2_1f1b_m2_dp2_tp2_zero1_fp64", "pp2_interleaved_v2_m2_dp2_tp2_zero2_fp64", "pp2_1f1b_m2_dp2_tp2_zero1",
    "pp2_zb-h1_m2_dp2_tp2_sp_zero1_fp64", "pp2_1f1b_m2_hsdp2x2_zero1", "pp2_1f1b_m2_hsdp2x2_zero2"]}
# A tied head (Megatron's embedding group): each end stage holds a copy of the table; their gradients summed over pp.
# 1F1B and interleaved (the copies on ranks 0 and 1 of 2 whatever the chunks), under DDP, ZeRO-1 and ZeRO-2 with tp.
TIED = [f"{name}_tied" for name in ("pp2_1f1b_m4_fp64", "pp2_interleaved_v2_m4_fp64", "pp2_1f1b_m2_dp2_zero1",
                                     "pp2_1f1b_m2_dp2_tp2_zero1_fp64", "pp2_interleaved_v2_m2_dp2_tp2_zero2_fp64")]
CASES.update({name: variant(Case, name.removesuffix("_tied"), tied=True) for name in TIED})
CASES["pp2_1f1b_m2_dp2_fp64_tied"] = Case(pp=2, microbatches=2, dp=2, precision="fp64", tied=True)  # DDP
TIED.append("pp2_1f1b_m2_dp2_fp64_tied")


def _train(case: Case, mesh, steps: int | None = None):
    """`case` trained `steps` steps (default: the case's)."""
    with torch.device("meta"):
        model = Transformer(case.config).to(torch.float32 if case.fp32 else torch.float64)
    model, optimizer = parallelize(model, mesh, optimizer=functools.partial(adamw, lr=case.lr),
                                   precision="fp32" if case.fp32 else FP64, init=lambda name,
                                   shape: model.param_init(name, shape, 0),
                                   data=DataParallel(zero=case.zero, grad_reduction="sum"),
                                   tensor=TensorParallel(sequence_parallel=case.sp),
                                   pipeline=PipelineParallel(schedule=case.schedule, virtual_stages=case.virtual_stages))
    dp, dp_rank = mesh.size("dp"), mesh.coord("dp")
    losses, sent, norms = [], [], []
    for x, y in batches()[:steps or case.steps]:
        rows = BATCH // dp
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        micro = rows // case.microbatches
        micro_batches = [(x[i:i + micro], y[i:i + micro]) for i in range(0, rows, micro)]
        tokens = model.comm_sum(torch.tensor(float((y != -100).sum()), dtype=torch.float64)).item()
        model.comm.reset()
        loss_sum = model.train_step(micro_batches, tokens).loss_sum
        summary = model.comm.summary()  # of the forward and backward passes
        transfers = (summary.get("pp", {}).get("send", {}).get("bytes", 0),
                     summary.get("tp", {}).get("all_gather", {}).get("bytes", 0))
        norms.append(model.clip_grad_norm_(1.0).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reductions = {axis: kinds["all_reduce"]["calls"] for axis, kinds in model.comm.summary().items()
                      if "all_reduce" in kinds}  # the whole step's
        sent.append((*transfers, reductions))
        losses.append(model.comm_sum(loss_sum.double()).item() / tokens)
    copies = {n: model.module.get_parameter(n).detach().clone() for n in model.pipeline.split.shared}
    return losses, model.full_state_dict(), sent, norms, copies


def _all_cases(rank, world):
    results = {}
    for name, case in CASES.items():
        if case.world != world:
            continue
        mesh = build_mesh(case.mesh_shape())
        results[name] = _train(case, mesh)
    return results


_RESULTS: dict = {}


def _results(world: int, name: str):
    return [per_rank[name] for per_rank in launch_once(_RESULTS, world, _all_cases)]


_REFERENCE: dict = {}


def _reference(case: Case, steps: int | None = None):
    steps = steps or case.steps
    key = (steps, case.fp32, case.config)
    if key not in _REFERENCE:
        model = make_model(case.config).to(torch.float32 if case.fp32 else torch.float64)
        norms = []
        _REFERENCE[key] = (*reference_run(model, batches()[:steps], lr=case.lr, norms=norms), norms)
    return _REFERENCE[key]


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_one_process(name):
    case = CASES[name]
    ref_losses, ref_params, _ = _reference(case)
    for losses, params, *_ in _results(case.world, name):
        assert params.keys() == ref_params.keys()
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW if case.fp32 else FP64_PARITY)


@pytest.mark.parametrize("name", ["pp2_1f1b_m4_fp64", "pp4_gpipe_m8_fp64", "pp2_interleaved_v2_m4_fp64",
                                  "pp4_interleaved_v2_m8_fp64", "pp4_zb-h1_m2_fp64", "pp2_interleaved_v2_m4_tp2_sp_fp64",
                                  "pp2_1f1b_m2_dp2_tp2_zero1_fp64"])
def test_point_to_point_bytes_match_theory(name):
    """Summed over one pipeline: 2·(v·p − 1)·m·b·s·h elements per step (activations and their grads), each tp
    rank sending 1/t of them and all-gathering what it receives over tp (Megatron's scatter/gather)."""
    case = CASES[name]
    b, h, stages = BATCH // (case.dp * case.microbatches), case.config.dim, case.pp * case.virtual_stages
    boundary = 2 * (stages - 1) * case.microbatches * b * SEQ * h * (4 if case.fp32 else 8)
    per_rank = [sent for i, (_, _, sent, *_) in enumerate(_results(case.world, name)) if i % (case.dp * case.tp) == 0]
    assert sum(sent[1][0] for sent in per_rank) == boundary // case.tp  # step 2: shapes were agreed at step 1
    # + one 8-int header per boundary, at the first step: a gradient has its activation's shape
    assert sum(sent[0][0] for sent in per_rank) == boundary // case.tp + (stages - 1) * 8 * 8
    if case.tp > 1 and not case.sp:  # every tp all-gather is a received boundary tensor's: (t−1)/t of it
        assert sum(sent[1][1] for sent in per_rank) == boundary * (case.tp - 1) // case.tp


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.dp == c.tp == 1])
def test_a_step_reduces_once_over_the_mesh(name):
    """The loss of the last stage reaches the other stages in the step's agreement: no all-reduce of its own. A tied
    head adds one all-reduce over pp: its two copies' gradients summed."""
    once = {"world": 1, **({"pp": 1} if CASES[name].tied else {})}
    for i, (_, _, sent, *_) in enumerate(_results(CASES[name].world, name)):
        assert [step[2] for step in sent] == [once] * len(sent), f"rank {i}"


@pytest.mark.parametrize("name", TIED)
def test_tied_head_copies_take_one_gradient_counted_once(name):
    """A tied table's two copies: their gradients summed over pp (skipping the sum, each copy steps on its own stage's
    part: the parameters leave one process's, and the copies differ), the norm counting the table once (counted on
    both stages, the norm is off by the table's part: FP64 makes that visible at any step), the copies bit-equal
    after every step, each rank's copy the one its pp peer (same dp and tp coordinates) holds; the whole model has
    the table once."""
    case = CASES[name]
    ref_norms = _reference(case)[2]
    results = _results(case.world, name)
    half = case.world // 2  # pp is the slowest axis: rank i and i + half are pp peers
    for rank, (_, params, _, norms, copies) in enumerate(results):
        bound = 1e-9 if not case.fp32 else 1e-4
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)) <= bound, (rank, norms, ref_norms)
        assert set(copies) == {"tok_embeddings.weight" if rank < half else "output.weight"}, copies.keys()
    for rank in range(half):
        first, last = results[rank][4]["tok_embeddings.weight"], results[rank + half][4]["output.weight"]
        assert torch.equal(first, last), f"the copies on ranks {rank} and {rank + half} differ"
    assert "output.weight" not in results[0][1]


# -- splitting and errors (no processes) ----------------------------------------------------------

def test_balanced_boundaries():
    assert balanced_boundaries([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert balanced_boundaries([1] * 8, 2, first_extra=2) == [(0, 3), (3, 8)]
    assert balanced_boundaries([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    with pytest.raises(PipelineError, match="3 pipeline stages .* but only 2 layers"):
        balanced_boundaries([1, 1], 3)


def test_split_keeps_whole_model_names_and_only_this_ranks_layers():
    with torch.device("meta"):
        model = Transformer(EIGHT_LAYERS)
    split = split_for_pipeline(model, pp=2, rank=1, virtual_stages=2)
    assert split.stages == (1, 3)
    assert list(split.module.layers) == ["2", "3", "6", "7"]
    assert split.module.tok_embeddings is None and split.module.output is not None
    assert split.param_owner["tok_embeddings.weight"] == 0 and split.param_owner["output.weight"] == 3
    assert "layers.6.attention.wq.weight" in dict(split.module.named_parameters())
    shell = split.shell(3)
    assert list(shell.layers) == ["6", "7"] and shell.layers["6"] is split.module.layers["6"]


def test_sequential_split_and_explicit_boundaries():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    split = split_for_pipeline(model, pp=2, rank=0, boundaries=[2])
    assert list(split.module._modules) == ["0", "1"] and split.ranges == [(0, 2), (2, 6)]


def test_tied_embeddings_across_stages_are_shared_copies():
    """A tied head at pp=2: each end rank holds a copy, named by the whole model's name; at pp=4 the middle ranks
    hold none, and the sum over pp would need them: refused in one line."""
    def split(pp, rank, virtual=1):
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(EIGHT_LAYERS, tie_embeddings=True))
        return split_for_pipeline(model, pp=pp, rank=rank, virtual_stages=virtual)

    first, last = split(2, 0), split(2, 1)
    assert first.shared == {"tok_embeddings.weight": "tok_embeddings.weight"}
    assert last.shared == {"output.weight": "tok_embeddings.weight"}
    assert "output.weight" not in last.param_owner and last.param_owner["tok_embeddings.weight"] == 0
    assert split(2, 1, virtual=2).shared == {"output.weight": "tok_embeddings.weight"}
    with pytest.raises(PipelineError, match="needs a copy on every pipeline rank"):
        split(4, 0)


def test_the_layout_rules_refuse_a_tied_head_beyond_two_stages():
    """The trainer's and the planner's rule (`rules.pipeline_model_violations`): a tied head at pp 2 (any virtual
    stages) runs, at pp 4 it is refused in one line naming the fix; an untied one runs at both."""
    from paratrain.parallel.rules import LayoutSpec, LayoutRuleError, check_layout

    tied = dataclasses.replace(EIGHT_LAYERS, tie_embeddings=True)
    for model, pp in ((tied, 2), (EIGHT_LAYERS, 4)):
        check_layout(LayoutSpec(dp=1, tp=1, pp=pp, world_size=pp, model=model, global_batch=8, micro_batch=1))
    with pytest.raises(LayoutRuleError, match="tied to the embedding.*use pp 2"):
        check_layout(LayoutSpec(dp=1, tp=1, pp=4, world_size=4, model=tied, global_batch=8, micro_batch=1))


def _errors(rank, world):
    mesh = build_mesh(MeshShape(pp=2))
    out = []
    for kwargs in ({"data": DataParallel(zero=3)}, {"pipeline": lambda: PipelineParallel(schedule="zigzag")},
                   {"pipeline": lambda: PipelineParallel(schedule="1f1b", virtual_stages=2)}):
        with torch.device("meta"):
            model = Transformer(EIGHT_LAYERS)
        try:
            parallelize(model, mesh, **{k: v() if callable(v) else v for k, v in kwargs.items()})
        except (ParallelConfigError, ScheduleError) as error:
            out.append(str(error))
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(EIGHT_LAYERS, n_layers=1))
    try:
        parallelize(model, mesh)
    except PipelineError as error:
        out.append(str(error))
    return out


def test_clear_errors():
    messages = run_on_ranks(_errors, 2, timeout=120)[0]
    assert len(messages) == 4, messages
    assert "--zero 3 with --pp 2 is refused" in messages[0]
    assert "unknown schedule 'zigzag'" in messages[1]
    assert "virtual" in messages[2]
    assert "2 pipeline stages (pp × virtual stages) but only 1 layers" in messages[3]


class _Upcast(nn.Module):
    """A layer whose output is fp32 whatever its input: the stage after it receives fp32 activations."""

    def forward(self, x):
        return x.float()


def _squared_error(out, target):
    return (out.float() - target).square().sum()


NORMALIZER = 1024.0  # small gradients: fp16's first loss scale (2^16) does not overflow them


def _float_pipeline(rank, world):
    """An nn.Sequential fed fp32 inputs over 2 stages in bf16 and fp16 (the second stage receives fp32 from
    the first), and torch's autocast on the same weights: the step's loss, the weights after one AdamW step
    (the reference's loss scaled alike) and an evaluation after it."""
    mesh = build_mesh(MeshShape(pp=2))
    g = torch.Generator().manual_seed(1)
    x, y, x_eval = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g), torch.randn(4, 16, generator=g)
    micro = [(x[:4], y[:4]), (x[4:], y[4:])]
    results = {}
    for precision in ("bf16", "fp16"):
        dtype = DTYPES[precision]
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), _Upcast(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        reference = copy.deepcopy(net)
        model, optimizer = parallelize(net, mesh, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                                       precision=precision, pipeline=PipelineParallel(boundaries=(3,)))
        result = model.train_step(micro, NORMALIZER, _squared_error)
        optimizer.step()
        loss_ref = torch.zeros((), dtype=torch.float64)
        for inputs, target in micro:
            with torch.autocast("cpu", dtype=dtype):
                token_loss = _squared_error(reference(inputs), target)
            (token_loss / NORMALIZER * model.scaler.scale).backward()
            loss_ref += token_loss.detach()
        for p in reference.parameters():
            p.grad /= model.scaler.scale  # a power of two: exact
        torch.optim.AdamW(reference.parameters(), lr=1e-2).step()
        with torch.autocast("cpu", dtype=dtype), torch.no_grad():
            eval_ref = _squared_error(reference(x_eval), y[:4])
        results[precision] = {
            "loss": result.loss_sum.item(), "loss_ref": loss_ref.item(), "skipped": model.scaler.skipped_steps,
            "eval": model.eval_loss_sum(x_eval, y[:4], _squared_error).item(), "eval_ref": eval_ref.item(),
            "params": {n: v.to(dtype) for n, v in model.full_state_dict().items()},
            "params_ref": {n: p.detach().to(dtype) for n, p in reference.named_parameters()}}
    return results


_FLOAT: dict = {}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_stage_casts_its_floating_point_input_to_the_compute_dtype(precision):
    for result in launch_once(_FLOAT, 2, _float_pipeline, timeout=120):  # both precisions in one launch
        r = result[precision]
        assert r["skipped"] == 0 and r["loss"] == r["loss_ref"] and r["eval"] == r["eval_ref"]
        assert r["params"].keys() == r["params_ref"].keys()
        for name, value in r["params_ref"].items():
            assert torch.equal(r["params"][name], value), name
