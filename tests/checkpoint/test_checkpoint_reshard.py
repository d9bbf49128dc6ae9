"""Checkpoints of a parallel model load into any other layout: the resharding matrix, at the API level.

Every layout trains SAVE_AT steps of the same global batches from the same initialization and
saves; every other layout (and one process) loads each checkpoint, which must give back the
saved parameters bit for bit, then trains STEPS_AFTER more steps, which must equal those of a
single process that never changed layout (fp32, rel 1e-5). One launch per world size and
phase: the runs of one world size share their processes. The model has two blocks (one per
stage at pp2): each load reads, compares and trains every tensor, and more blocks add only more
of the same tensors. A mixture of experts has its own, smaller matrix across expert parallelism
(`MOE_LAYOUTS`). Loaded optimizer state lands where torch's own `load_state_dict` puts it, for
every kind of optimizer, on the host and off it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from paratrain.checkpoint import CheckpointReader, DistCoordinator, IncompatibleCheckpointError, save_checkpoint
from paratrain.run.model_state import load_model_shards, model_shards
from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import Transformer
from paratrain.parallel.api import DataParallel, parallelize
from paratrain.testing import run_on_ranks
from paratrain.train import train_step

from parallel_cases import TINY, adamw, batches, make_model

# Saved after one step, when every kind of optimizer state exists (Adam's moments and step count). Two steps after
# the load: the first's loss reads the loaded weights, the second's the update the loaded optimizer state made.
SAVE_AT, STEPS_AFTER, MICRO = 1, 2, 2
MODEL = dataclasses.replace(TINY, n_layers=2)
DATA = batches(vocab=MODEL.vocab_size, steps=SAVE_AT + STEPS_AFTER, batch=8, seq=16)


@dataclass(frozen=True)
class Layout:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    dp_shard: int = 0  # hybrid sharding: ZeRO shards over groups of this many data ranks (0: all of them)
    ep: int = 1  # expert parallelism: data ranks that split the experts of the MoE model (`MOE_LAYOUTS`)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


ONE = Layout("one")
# The named matrix: every layout saves once and loads every other layout's checkpoint.
LAYOUTS = [ONE, Layout("dp4_zero1", dp=4, zero=1), Layout("dp2_zero3", dp=2, zero=3),
           Layout("dp2_tp2", dp=2, tp=2), Layout("pp2_dp2_zero1", pp=2, dp=2, zero=1),
           Layout("hsdp2x2_zero3", dp=4, zero=3, dp_shard=2)]
# Checkpoints are layout-free across expert parallelism: a MoE model's expert tensors, saved as [E/ep, ...]
# blocks at offset ep_rank·E/ep (their optimizer state ZeRO-sharded over ep_replicate, under ZeRO-3 the blocks
# too), load into one process, plain data parallelism and ep2 alike.
MOE = dataclasses.replace(MODEL, n_experts=4, top_k=2, expert_ffn_dim=16, aux_loss_coef=0.1)
MOE_LAYOUTS = [ONE, Layout("dp2_zero1", dp=2, zero=1), Layout("dp2_ep2_zero1", dp=2, ep=2, zero=1),
               Layout("dp4_ep2_zero1", dp=4, ep=2, zero=1), Layout("dp2_ep2_zero3", dp=2, ep=2, zero=3)]

# A head tied to the embedding: under pp each end stage holds a copy of the table, saved once under the whole
# model's name (by the first stage) and loaded into both copies; one process and pp2 load each other's checkpoints.
TIED = dataclasses.replace(MODEL, tie_embeddings=True)
TIED_LAYOUTS = [ONE, Layout("pp2", pp=2), Layout("pp2_dp2_zero1", pp=2, dp=2, zero=1)]


def build(layout: Layout, seed: int = 0, config=TINY):
    mesh = build_mesh(MeshShape(dp=layout.dp, tp=layout.tp, pp=layout.pp, dp_shard=layout.dp_shard, ep=layout.ep))
    module = Transformer(config)
    module.init_weights(seed)
    return parallelize(module, mesh, optimizer=adamw, data=DataParallel(zero=layout.zero, grad_reduction="sum")) + (mesh,)


def run_steps(model, optimizer, mesh, steps: range) -> list[float]:
    """Train on this rank's rows of the global batches DATA[steps], micro-batches of MICRO rows."""
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    losses = []
    for step in steps:
        x, y = DATA[step]
        rows = x.shape[0] // dp
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        micro = [(x[i:i + MICRO], y[i:i + MICRO]) for i in range(0, rows, MICRO)]
        losses.append(train_step(model, optimizer, micro, 1.0).loss)
    return losses


def save(layout: Layout, root: Path, config=TINY) -> None:
    model, optimizer, mesh = build(layout, config=config)
    run_steps(model, optimizer, mesh, range(SAVE_AT))
    save_checkpoint(root / layout.name, SAVE_AT, model_shards(model, optimizer), coordinator=DistCoordinator())


def load_and_continue(layout: Layout, path: Path, config=TINY) -> dict:
    """Load `path` into a fresh `layout` (different init seed: everything must come from the file), train on."""
    model, optimizer, mesh = build(layout, seed=1, config=config)
    reader = CheckpointReader(path)
    load_model_shards(model, optimizer, reader)
    exact = all(torch.equal(tensor, reader.read(spec.name, spec.offset, tensor.shape))
                for spec, tensor in model_shards(model, optimizer).values())
    if layout.pp == 1:  # every parameter, whole, equals the saved one
        exact &= all(torch.equal(value.float(), reader.read(f"model/{name}"))
                     for name, value in model.full_state_dict().items())
    return {"exact": exact, "losses": run_steps(model, optimizer, mesh, range(SAVE_AT, SAVE_AT + STEPS_AFTER))}


def _phase(rank, world, root, saves, loads, config=TINY):
    """Save each layout of `saves`, then load each (layout, checkpoint) pair of `loads`; results on rank 0."""
    root = Path(root)
    for layout in saves:
        save(layout, root, config)
    results = {}
    for layout, source in loads:
        results[layout.name, source] = load_and_continue(layout, next((root / source).glob("step-*")), config)
    return results


def _reference(rank, world, config=TINY):
    model, optimizer, mesh = build(ONE, config=config)
    return run_steps(model, optimizer, mesh, range(SAVE_AT + STEPS_AFTER))


def _check_matrix(root: Path, layouts: list[Layout], config) -> None:
    """Every layout of `layouts` saves, every other one loads it: bit for bit, then trains on as one process."""
    reference = run_on_ranks(_reference, 1, config, timeout=60)[0][SAVE_AT:]
    by_world: dict[int, list[Layout]] = {}
    for layout in layouts:
        by_world.setdefault(layout.world, []).append(layout)
    results = {}
    # Phase 1 saves every layout (and loads what already exists); phase 2 loads the rest.
    for phase in (1, 2):
        for world, group in sorted(by_world.items()):
            saved = {l.name for w, ls in by_world.items() for l in ls if phase == 2 or w <= world}
            loads = [(l, s.name) for l in group for s in layouts
                     if s.name != l.name and (s.name in saved) and (l.name, s.name) not in results]
            saves = group if phase == 1 else []
            if saves or loads:
                results.update(run_on_ranks(_phase, world, str(root), saves, loads, config, timeout=180)[0])
    assert len(results) == len(layouts) * (len(layouts) - 1)
    for (layout, source), result in sorted(results.items()):
        assert result["exact"], f"{source} → {layout}: loaded parameters differ from the saved ones"
        assert result["losses"] == pytest.approx(reference, rel=1e-5), f"{source} → {layout}"


@pytest.mark.slow
def test_every_layout_loads_every_other_layouts_checkpoint(tmp_path):
    _check_matrix(tmp_path, LAYOUTS, MODEL)
    # Hybrid sharding saves each box once: the second replica of the shards writes nothing, so the
    # checkpoint is the one two ranks of plain ZeRO-3 write, box for box.
    hybrid, plain = (CheckpointReader(next((tmp_path / name).glob("step-*")))
                     for name in ("hsdp2x2_zero3", "dp2_zero3"))
    assert hybrid.names() == plain.names()
    assert all(hybrid.boxes(name) == plain.boxes(name) for name in plain.names())


def test_moe_checkpoints_load_across_expert_parallelism(tmp_path):
    _check_matrix(tmp_path, MOE_LAYOUTS, MOE)
    # The experts' blocks and their Adam moments are each written once: by the ep2 ranks of ep_replicate
    # coordinate 0, each its block of 2 of the 4 experts; under dp4 as ZeRO-1 rows of it, by both holders.
    for layout, boxes in (("dp2_ep2_zero1", [(0, 0, 0), (2, 0, 0)]), ("dp2_ep2_zero3", [(0, 0, 0), (2, 0, 0)]),
                          ("dp4_ep2_zero1", [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)])):
        reader = CheckpointReader(next((tmp_path / layout).glob("step-*")))
        for name in ("model/layers.0.feed_forward.experts.w1", "optim/layers.1.feed_forward.experts.w2/exp_avg_sq"):
            assert sorted(tuple(box.offset) for box in reader.boxes(name)) == boxes, (layout, name, reader.boxes(name))


def test_a_tied_head_checkpoints_once_across_pipeline_stages(tmp_path):
    _check_matrix(tmp_path, TIED_LAYOUTS, TIED)
    for layout in ("pp2", "pp2_dp2_zero1"):
        reader = CheckpointReader(next((tmp_path / layout).glob("step-*")))
        names = set(reader.names())
        assert "model/tok_embeddings.weight" in names and not any("output.weight" in name for name in names)
        boxes = [tuple(box.offset) for box in reader.boxes("optim/tok_embeddings.weight/exp_avg")]
        assert sorted(boxes) == ([(0, 0)] if layout == "pp2" else [(0, 0), (32, 0)]), boxes  # written once each


def _load_error(model, optimizer, path) -> str:
    try:
        load_model_shards(model, optimizer, CheckpointReader(path))
    except IncompatibleCheckpointError as e:
        return str(e)
    return "loaded"


def _wrong_models(rank, world, root):
    from paratrain.models import ModelConfig

    root = Path(root)
    model, optimizer, mesh = build(ONE)
    save_checkpoint(root / "a", 1, model_shards(model, optimizer), coordinator=DistCoordinator())
    wider = Transformer(ModelConfig(**{**TINY.__dict__, "dim": 64, "n_heads": 8, "n_kv_heads": 4}))
    other, other_opt = parallelize(wider, mesh, optimizer=adamw)
    double, double_opt = parallelize(Transformer(TINY).double(), mesh, optimizer=adamw)
    reader = CheckpointReader(root / "a" / "step-00000001")
    cast = []  # mixed precision: the bf16 compute weights follow the loaded fp32 masters
    for zero in (0, 2):
        mixed, mixed_opt = parallelize(Transformer(TINY), mesh, optimizer=adamw, precision="bf16",
                                       data=DataParallel(zero=zero))
        load_model_shards(mixed, mixed_opt, reader)
        cast.append(all(torch.equal(p, reader.read(f"model/{n}").to(torch.bfloat16))
                        for n, p in mixed.module.named_parameters()))
    return (_load_error(other, other_opt, root / "a" / "step-00000001"),
            _load_error(double, double_opt, root / "a" / "step-00000001"), cast)


def test_loading_checks_shapes_and_dtypes_and_casts_mixed_precision_weights(tmp_path):
    shapes, dtypes, cast = run_on_ranks(_wrong_models, 1, str(tmp_path), timeout=60)[0]
    assert cast == [True, True]
    assert shapes == ("step-00000001 does not match the model: tensor 'model/tok_embeddings.weight' is [64, 32] "
                      "float32 in the checkpoint but [64, 64] float32 is expected"), shapes
    assert dtypes == ("step-00000001 does not match the model: tensor 'model/tok_embeddings.weight' is [64, 32] "
                      "float32 in the checkpoint but [64, 32] float64 is expected"), dtypes


# Optimizer kinds whose state torch places differently: fused and capturable keep Adam's step on the
# parameter's device (in fp32), the others on the host.
OPTIMIZER_KINDS = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True},
                   "capturable": {"capturable": True}}


def _placement(optimizer) -> list[dict[str, tuple]]:
    """Per parameter of the optimizer, in its order: each state tensor's device, dtype and (off meta) values."""
    return [{key: (str(v.device), v.dtype, None if v.is_meta else v.clone()) for key, v in optimizer.state[p].items()}
            for group in optimizer.param_groups for p in group["params"]]


def _optimizer_state_placement(rank, world, root):
    """Save a CPU run stepped by fused AdamW (as the trainer steps), then load it into a fresh model of each
    optimizer kind, on the CPU and on a device that is not the host (meta, standing in for a GPU); beside
    each, torch's own `load_state_dict` of the saved optimizer's state into a twin of the same kind."""
    meshes = {device: build_mesh(MeshShape(), device=device) for device in ("cpu", "meta")}

    def build_on(device, **kinds):
        return parallelize(make_model(), meshes[device], precision="bf16",
                           optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, **kinds))

    model, optimizer = build_on("cpu", fused=True)
    run_steps(model, optimizer, meshes["cpu"], range(2))
    save_checkpoint(Path(root), 2, model_shards(model, optimizer), coordinator=DistCoordinator())
    saved = optimizer.state_dict()["state"]
    results = {}
    for device in meshes:
        for kind, kinds in OPTIMIZER_KINDS.items():
            model, optimizer = build_on(device, **kinds)
            load_model_shards(model, optimizer, CheckpointReader(next(Path(root).glob("step-*"))))
            _, twin = build_on(device, **kinds)
            twin.load_state_dict({"state": saved, "param_groups": twin.state_dict()["param_groups"]})
            results[device, kind] = (_placement(optimizer), _placement(twin))
    return results


@pytest.fixture(scope="module")
def placements(tmp_path_factory):
    return run_on_ranks(_optimizer_state_placement, 1, str(tmp_path_factory.mktemp("fused")), timeout=120)[0]


@pytest.mark.parametrize("kind", list(OPTIMIZER_KINDS))
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_optimizer_state_is_placed_where_torchs_own_load_puts_it(placements, device, kind):
    loaded, torchs = placements[device, kind]
    assert len(loaded) == len(torchs) and all(torchs)
    for i, (mine, expected) in enumerate(zip(loaded, torchs)):
        assert mine.keys() == expected.keys(), i
        for key, (where, dtype, values) in expected.items():
            assert mine[key][:2] == (where, dtype), f"parameter {i} {key}: {mine[key][:2]}, torch: {(where, dtype)}"
            assert values is None or torch.equal(mine[key][2], values), f"parameter {i} {key}"
