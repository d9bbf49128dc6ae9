"""LoRA and QLoRA in one process (`paratrain.parallel.lora`): the converted model computes what the base did, only
the adapters train and hold optimizer state, an NF4 base is decoded for its own matmul only, the trainer's options
and refusals, and a LoRA run resumes from its checkpoint."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from parallel_cases import adamw, batches, loss_sum, make_model
from paratrain import forkserver
from paratrain.cli import main
from paratrain.mesh import Mesh, MeshShape
from paratrain.metrics import read_metrics
from paratrain.parallel.api import DataParallel, ParallelConfigError, parallelize
from paratrain.parallel.lora import (LoRA, LoRAError, LoRALinear, convert_to_lora, decode_fp8, encode_fp8,
                                     target_names)
from paratrain.parallel.nf4 import NF4
from paratrain.train import train_step

BASES = [None, "bf16", "nf4", "fp8"]


def _one_rank_mesh() -> Mesh:
    return Mesh(shape=MeshShape(), rank=0, groups={"pp": None, "dp": None, "tp": None, "world": None})


def _base_as_stored(model: nn.Module, base_dtype: str | None) -> nn.Module:
    """The base model whose target linears hold the weights the LoRA model's base holds (bf16-, NF4- or FP8-rounded)."""
    for name in target_names(model, None):
        linear = model.get_submodule(name)
        with torch.no_grad():
            if base_dtype == "bf16":
                linear.weight.copy_(linear.weight.to(torch.bfloat16).float())
            elif base_dtype == "nf4":
                linear.weight.copy_(NF4.encode(linear.weight).decode())
            elif base_dtype == "fp8":
                linear.weight.copy_(decode_fp8(*encode_fp8(linear.weight, torch.float32), torch.float32))
    return model


@pytest.mark.parametrize("base_dtype", BASES)
def test_at_init_the_lora_model_computes_what_its_base_does(base_dtype):
    x, _ = batches(steps=1)[0]
    want = _base_as_stored(make_model(), base_dtype)(x)
    model, _ = parallelize(make_model(), _one_rank_mesh(), lora=LoRA(4, base_dtype=base_dtype))
    assert len(model.lora_targets) == 3 * 7  # every linear of the 3 blocks, not the head
    assert torch.equal(model(x), want)


@pytest.mark.parametrize("zero", [0, 3])
@pytest.mark.parametrize("base_dtype", BASES)
def test_only_the_adapters_train_and_hold_optimizer_state(base_dtype, zero):
    model, optimizer = parallelize(make_model(), _one_rank_mesh(), optimizer=adamw, data=DataParallel(zero=zero),
                                   lora=LoRA(4, base_dtype=base_dtype, dropout=0.1))
    frozen = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
              if not (n.endswith("lora_A.weight") or n.endswith("lora_B.weight"))}
    adapters = {n: p.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(adapters) == 2 * 21 and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(linears) == 21 and all((m.nf4 is not None) == (base_dtype == "nf4") for m in linears)
    assert all((m.fp8 is not None) == (base_dtype == "fp8") for m in linears)
    assert all(m.weight.dtype == torch.bfloat16 for m in linears) if base_dtype == "bf16" else True
    for x, y in batches(steps=3):
        train_step(model, optimizer, [(x, y)], 1.0)
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert all(torch.equal(now[n], t) for n, t in frozen.items()), "a frozen tensor moved"
    assert all(not torch.equal(now[n], t) for n, t in adapters.items()), "an adapter did not train"
    # AdamW's state: step, exp_avg, exp_avg_sq of each adapter, nothing else
    state = optimizer.state
    assert len(state) == len(adapters) and {p.shape for p in state} == {p.shape for p in adapters.values()}
    assert sum(t.numel() for s in state.values() for k, t in s.items() if k != "step") == \
        2 * sum(p.numel() for p in adapters.values())
    assert sum(m.numel() for m in model.masters()) == sum(p.numel() for p in adapters.values())  # no master of the base


def test_an_nf4_base_keeps_no_decoded_weight_for_backward():
    """The tensors autograd saves between forward and backward: none is a decoded base weight (made again in
    backward), while a plain base's weights are saved as the parameters they are."""
    def saved_base_weights(base_dtype):
        model, _ = parallelize(make_model(), _one_rank_mesh(), lora=LoRA(4, base_dtype=base_dtype))
        x, y = batches(steps=1)[0]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss_sum(model, x, y).backward()
        weights = [m.base_weight() for m in model.modules() if isinstance(m, LoRALinear)]
        return sum(1 for t in saved for w in weights
                   if t.dim() == 2 and (torch.equal(t, w) if t.shape == w.shape else
                                        t.shape == w.T.shape and torch.equal(t, w.T)))

    assert saved_base_weights(None) > 10, "the hook sees the saved weights (of the linears whose input needs a gradient)"
    assert saved_base_weights("nf4") == 0
    assert saved_base_weights("fp8") == 0


def test_an_fp8_base_rounds_each_element_to_e4m3_at_its_rows_scale_and_decodes_slices_as_the_whole():
    """Each element is its row's scale (absmax / 448) times the nearest e4m3 value: within e4m3's half step (2⁻⁴ of
    the value, 2⁻¹⁰ of the scale below e4m3's normals), the row's largest exactly ±448 · scale; a row or column
    slice of the bytes and scales decodes to that slice of the whole, as tensor parallelism splits them."""
    torch.manual_seed(0)
    weight = torch.randn(96, 192) * torch.logspace(-3, 1, 96).unsqueeze(1)
    weight[5] = 0.0  # a row of zeros: scale 1, zeros back
    codes, scale = encode_fp8(weight, torch.float32)
    assert codes.dtype == torch.uint8 and codes.shape == weight.shape and scale.shape == (96, 1)
    decoded = decode_fp8(codes, scale, torch.float32)
    bound = torch.maximum(weight.abs() * 2 ** -4, scale * 2 ** -10)
    assert ((decoded - weight).abs() <= bound).all() and decoded[5].eq(0).all() and scale[5].item() == 1.0
    rows = [r for r in range(96) if r != 5]
    assert torch.equal(decoded[rows].abs().amax(dim=1), (scale[rows] * 448).squeeze(1))
    whole = decode_fp8(codes, scale, torch.bfloat16)
    assert torch.equal(decode_fp8(codes[48:], scale[48:], torch.bfloat16), whole[48:])
    assert torch.equal(decode_fp8(codes[:, 96:], scale, torch.bfloat16), whole[:, 96:])


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputed_blocks_train_the_adapters_as_stored_activations_do(recompute):
    def run(checkpointing):
        model, optimizer = parallelize(make_model(), _one_rank_mesh(), optimizer=adamw, activation_checkpointing=checkpointing,
                                       lora=LoRA(4, base_dtype="nf4", dropout=0.1))
        torch.manual_seed(0)  # the dropout masks: a recomputed block draws its forward's again
        losses = [train_step(model, optimizer, [(x, y)], 1.0) for x, y in batches(steps=3)]
        return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    (want_losses, want), (losses, got) = run(0), run(recompute)
    assert [a.loss for a in losses] == [a.loss for a in want_losses]
    assert want.keys() == got.keys() and all(torch.equal(got[n], want[n]) for n in want)


# Two targets of each block: wq, whose input comes from a frozen norm (no gradient flows into the first block: the
# embedding is frozen), and w2, whose input carries one (from the adapters before it). A block compiles once for each
# (an input with and one without a gradient: two graphs); tracing costs in proportion to the adapted linears.
COMPILED_TARGETS = ("wq", "w2")


@pytest.mark.parametrize("option, base_dtype", [({"compile": "aot_eager"}, "nf4"),  # NF4's autograd function inside
                                                ({"data": DataParallel(offload="optimizer")}, None),
                                                ({"data": DataParallel(offload="optimizer")}, "nf4")],
                         ids=["compile-nf4", "offload", "offload-nf4"])
def test_compiled_blocks_and_the_offloaded_optimizer_train_the_adapters_as_eager_does(option, base_dtype):
    def run(**options):
        model, optimizer = parallelize(make_model(), _one_rank_mesh(), optimizer=adamw,
                                       lora=LoRA(4, base_dtype=base_dtype, targets=COMPILED_TARGETS), **options)
        losses = [train_step(model, optimizer, [(x, y)], 1.0).loss for x, y in batches(steps=3)]
        return losses, {n: t.clone() for n, t in model.full_state_dict().items() if ".lora_" in n}, model

    want_losses, want, _ = run()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload on the CPU says it saves no memory here
        losses, got, model = run(**option)
    assert len(model.masters()) == len(want) == 2 * 3 * len(COMPILED_TARGETS), "masters of the adapters only"
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_adapters_compute_peft_s_formula_with_dropout_on_their_input_only():
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(16, 8))
    base = linear[0].weight.detach().clone()
    convert_to_lora(linear, LoRA(2, alpha=6, dropout=0.5, targets=("0",)))
    module = linear[0]
    with torch.no_grad():
        module.lora_B.weight.normal_()
    x = torch.randn(5, 16)
    delta = module.lora_B.weight @ module.lora_A.weight * 3.0
    module.eval()
    torch.testing.assert_close(linear(x), x @ (base + delta).T + module.bias, rtol=1e-6, atol=1e-6)
    module.train()
    torch.manual_seed(1)
    dropped = torch.nn.functional.dropout(x, 0.5)
    torch.manual_seed(1)
    torch.testing.assert_close(linear(x), x @ base.T + module.bias + dropped @ delta.T, rtol=1e-6, atol=1e-6)


def test_targets_match_module_names_by_pattern():
    model = make_model()
    assert target_names(model, ("wq", "wv")) == [f"layers.{i}.attention.{w}" for i in range(3) for w in ("wq", "wv")]
    assert target_names(model, ("layers.1.*",)) == [n for n in target_names(model, None) if n.startswith("layers.1.")]
    assert "output" not in target_names(model, None) and "output" in target_names(model, ("output",))


@pytest.mark.parametrize("make, match", [
    (lambda: LoRA(0), "rank must be a positive integer, got 0"),
    (lambda: LoRA(-2), "rank must be a positive integer"),
    (lambda: LoRA(4, dropout=1.0), "dropout must be in"),
    (lambda: LoRA(4, base_dtype="int4"), "base_dtype='int4'"),
    (lambda: convert_to_lora(make_model(), LoRA(4, targets=("nothing",))), "'nothing' matches no linear"),
])
def test_bad_lora_options_are_one_line_errors(make, match):
    with pytest.raises(LoRAError, match=match) as error:
        make()
    assert "\n" not in str(error.value)


def test_parallelize_refuses_a_strategy_that_does_not_honour_lora_yet():
    with pytest.raises(ParallelConfigError, match="LoRA with --fp8 is not supported yet"):
        parallelize(make_model(), _one_rank_mesh(), precision="bf16", fp8="tensorwise", lora=LoRA(4))
    with pytest.raises(ParallelConfigError, match="'wz' matches no linear"):
        parallelize(make_model(), _one_rank_mesh(), lora=LoRA(4, targets=("wz",)))


# -- the trainer -------------------------------------------------------------------------------------------

RUN = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64", "--seq-len", "32",
       "--global-batch", "4", "--micro-batch", "2", "--sample-tokens", "0", "--eval-every", "0", "--no-progress",
       "--lora", "4", "--lora-targets", "attention.*,w2", "--lora-dropout", "0.1"]


@pytest.mark.parametrize("argv, message", [
    (["--lora", "0"], "--lora must be a positive integer, got 0"),
    (["--base-dtype", "nf4"], "--base-dtype without --lora RANK"),
    (["--lora-targets", "wq"], "--lora-targets without --lora RANK"),
    (["--lora", "4", "--lora-targets", "wz"], "--lora-targets: the LoRA target 'wz' matches no linear"),
    ([*RUN, "--base-dtype", "nf4", "--tp", "2", "--nproc", "2"],
     "layers.0.attention.wo: its NF4 base splits by input columns over tp=2 only on whole blocks of 64"),
    (["--lora", "4", "--ep", "2", "--nproc", "2"], "LoRA with --ep is not supported yet"),
    (["--lora", "4", "--fp8", "tensorwise", "--precision", "bf16"], "LoRA with --fp8 is not supported yet"),
    (["--lora", "4", "--lora-alpha", "-1"], "--lora-alpha must be positive"),
])
def test_the_trainer_refuses_in_one_line_before_anything_runs(argv, message, capsys, tmp_path):
    had_server = forkserver.running()  # a refused launch (--nproc 2) stops the worker server it started
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists() and forkserver.running() == had_server


@pytest.mark.parametrize("base_dtype", [None, "nf4"])
def test_a_lora_run_resumes_from_its_checkpoint_as_if_never_stopped(base_dtype, tmp_path, capsys):
    extra = ["--base-dtype", base_dtype] if base_dtype else []
    full = tmp_path / "full"
    assert main(["train", *RUN, *extra, "--steps", "4", "--checkpoint-every", "2", "--out", str(full)]) == 0
    assert "LoRA rank 4 on 10 linears" in capsys.readouterr().out  # attention's 4 and w2, in each of 2 blocks
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    assert main(["train", *RUN, *extra, "--steps", "4", "--checkpoint-every", "2", "--load-step", "2",
                 "--out", str(cut)]) == 0
    assert "resumed from" in capsys.readouterr().out
    records = [[float.hex(r["loss"]) for r in read_metrics(run / "metrics.jsonl")] for run in (full, cut)]
    assert len(records[0]) == 4 and records[0] == records[1]
    index = json.loads((full / "checkpoints" / "step-00000002" / "index.json").read_text())
    names = [n for n in json.dumps(index).split('"') if n.startswith("model/")]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), "the checkpoint holds the adapters only"


def test_a_qlora_checkpoint_resumes_under_zero3(tmp_path, capsys):
    """The base's fingerprint is the whole frozen model's under every layout (ZeRO-3 gathers it), and ZeRO-3's
    masters are the adapters alone: a ZeRO-0 run's checkpoint resumes at --zero 3 and its steps go on as before,
    the dropout's masks too (the layout changed: rank 0's RNG states restored)."""
    nf4 = ["--base-dtype", "nf4"]  # (RUN's --lora-dropout 0.1)
    full = tmp_path / "full"
    assert main(["train", *RUN, *nf4, "--steps", "4", "--checkpoint-every", "2", "--out", str(full)]) == 0
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    capsys.readouterr()
    torch.manual_seed(11)  # the generator elsewhere than where the run left it: the checkpoint's must come back
    assert main(["train", *RUN, *nf4, "--zero", "3", "--steps", "4", "--checkpoint-every", "2", "--load-step", "2",
                 "--out", str(cut)]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "rank 0's RNG states restored on every rank (the layout changed)" in out
    records = [[r["loss"] for r in read_metrics(run / "metrics.jsonl")] for run in (full, cut)]
    assert len(records[0]) == 4 and records[1] == records[0]


def test_resuming_adapters_over_another_base_is_refused(tmp_path, capsys):
    """Another --seed initializes another base (the adapters' checkpoint does not hold it)."""
    run = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "2", "--checkpoint-every", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    code = main(["train", *RUN, "--steps", "2", "--seed", "7", "--resume", str(run / "checkpoints" / "step-00000002"),
                 "--out", str(tmp_path / "other")])
    err = capsys.readouterr().err
    assert code == 2 and "trained on another base model" in err and err.count("\n") == 1, err
