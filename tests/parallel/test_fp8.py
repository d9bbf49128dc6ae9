"""FP8 training (`paratrain.parallel.fp8`): the casts and scales against an emulation of the kernels, which layers
convert on models nobody here wrote, the same losses on 1 and 2 ranks under ZeRO-0..3, compile without graph
breaks, and the refusals. `torch._scaled_mm` runs on the CPU (emulated by torch), so all of it runs here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.cli import build_parser, main
from paratrain.commands.options import config_from_args
from paratrain.metrics import read_metrics
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel import fp8
from paratrain.parallel.api import ParallelConfigError
from paratrain.parallel.fp8 import (
    E4M3, E5M2, Fp8Casts, Fp8Error, check_fp8, convert_to_fp8, fp8_linear, scale_of, to_fp8,
)
from paratrain.testing import run_on_ranks
from parallel_cases import launch_once


@pytest.fixture(autouse=True)
def _process_group_left_behind():
    """`paratrain.init_mesh()` in this process starts a process group of one; later tests must not find it."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _dequantized(x: torch.Tensor, dtype, dim=None, power_of_two=False) -> torch.Tensor:
    scale = scale_of(x, dtype, dim, power_of_two)
    return to_fp8(x, scale, dtype).float() / scale


@pytest.fixture
def operands():
    torch.manual_seed(0)
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(256, 128) * 0.05).to(torch.bfloat16).requires_grad_()
    return x, w, torch.randn(64, 256).to(torch.bfloat16)


def test_tensorwise_is_exactly_its_casts_multiplied(operands):
    """Each of the three matmuls equals fp32 matmuls of the dequantized operands: x and w in e4m3 with one scale
    each, the output gradient in e5m2; only the bf16 rounding of the results differs."""
    x, w, g = operands
    y = fp8_linear(x, w, None, "tensorwise")
    y.backward(g)
    xq, wq, gq = _dequantized(x, E4M3), _dequantized(w, E4M3), _dequantized(g, E5M2)
    assert _rel(y, xq @ wq.t()) < 4e-3
    assert _rel(x.grad, gq @ wq) < 4e-3 and _rel(w.grad, gq.t() @ xq) < 4e-3
    exact = F.linear(x.float(), w.float())
    assert 5e-3 < _rel(y, exact) < 0.06  # FP8 is not bf16: a few percent, no more


def test_rowwise_casts_each_operand_along_its_matmuls_reduction(operands):
    x, w, g = operands
    y = fp8_linear(x, w, None, "rowwise")
    y.backward(g)
    assert _rel(y, _dequantized(x, E4M3, 1, True) @ _dequantized(w.t(), E4M3, 0, True)) < 4e-3
    assert _rel(x.grad, _dequantized(g, E4M3, 1, True) @ _dequantized(w, E4M3, 0, True)) < 4e-3
    assert _rel(w.grad, _dequantized(g.t(), E4M3, 1, True) @ _dequantized(x, E4M3, 0, True)) < 4e-3
    scales = scale_of(x, E4M3, 1, power_of_two=True)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two: no mantissa bit changes


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_converted_linear_computes_as_torchaos_float8_linear_bit_for_bit(recipe):
    """torchao's Float8Linear is the field's reference for both recipes: the same layer converted by paratrain and by
    torchao gives the same output, input gradient and weight gradient, to the bit (3-D input, bias, a layer whose
    weight gradient reduces over 2 x 48 tokens), so what FP8 training costs here is the recipe's, not ours."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    layer = nn.Linear(128, 320, dtype=torch.bfloat16)
    ours, theirs = nn.Sequential(nn.Linear(128, 320)), nn.Sequential(nn.Linear(128, 320))
    for copy in (ours, theirs):
        copy[0].to(torch.bfloat16).load_state_dict(layer.state_dict())
    assert convert_to_fp8(ours, recipe) == ["0"]
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name(recipe))
    assert type(theirs[0]).__module__.startswith("torchao")
    x = torch.randn(2, 48, 128, dtype=torch.bfloat16) * 3
    g = torch.randn(2, 48, 320, dtype=torch.bfloat16) * 1e-3
    results = []
    for model in (ours, theirs):
        xx = x.clone().requires_grad_()
        y = model(xx)
        y.backward(g)
        results.append((y.detach(), xx.grad, model[0].weight.grad, model[0].bias.grad))
    for mine, reference in zip(*results):
        assert torch.equal(mine, reference)
    assert _rel(results[0][0], layer(x)) > 1e-3  # and it is FP8: not the bf16 layer


def test_casts_saturate_and_zeros_stay_zeros():
    assert to_fp8(torch.tensor([1e6, -1e6, 3.0]), torch.tensor(1.0), E4M3).float().tolist() == [448.0, -448.0, 3.0]
    zeros = torch.zeros(32, 16, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_linear(zeros, torch.randn(16, 16, dtype=torch.bfloat16), None, "tensorwise")
    assert torch.equal(y, torch.zeros_like(y)) and torch.isfinite(y).all()
    odd = torch.randn(3, 5, 16, dtype=torch.bfloat16)  # 15 tokens: the kernels' tiles do not fit, bf16 instead
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    assert torch.equal(fp8_linear(odd, w, None, "tensorwise"), F.linear(odd, w))


CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)


def test_a_weight_is_cast_once_per_optimizer_step_and_reused_by_its_micro_batches():
    torch.manual_seed(0)
    layer = nn.Linear(32, 64, dtype=torch.bfloat16)
    casts = Fp8Casts()
    convert_to_fp8(nn.Sequential(layer), "tensorwise", casts=casts)
    made = []
    real = fp8.weight_cast
    fp8.weight_cast = lambda *args: made.append(1) or real(*args)
    try:
        x = torch.randn(4, 16, 32, dtype=torch.bfloat16)
        first = [layer(x) for _ in range(3)]  # three micro-batches: one cast
        assert len(made) == 1 and all(torch.equal(first[0], y) for y in first[1:])
        with torch.no_grad():
            layer.weight.mul_(2)  # changed in place (a load): cast again, even within the step
        layer(x)
        casts.new_step()  # the optimizer stepped
        layer(x)
        assert len(made) == 3
    finally:
        fp8.weight_cast = real
    uncached = nn.Linear(32, 64, dtype=torch.bfloat16)
    uncached.load_state_dict(layer.state_dict())
    convert_to_fp8(nn.Sequential(uncached), "tensorwise")
    assert torch.equal(uncached(x), layer(x))  # the same cast either way


def test_the_linears_of_the_blocks_convert_and_the_head_and_embeddings_stay():
    model = Transformer(CFG)
    names = convert_to_fp8(model, "tensorwise")
    assert len(names) == CFG.n_layers * 7 and all(n.startswith("layers.") for n in names)
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in Transformer(CFG).named_parameters()]
    stack = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 20))  # 20 outputs: not a multiple of 16
    assert convert_to_fp8(stack, "rowwise") == ["0"]


def test_a_transformers_model_converts_its_decoder_layers():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    names = convert_to_fp8(model, "tensorwise")
    assert len(names) == 2 * 7 and not any("lm_head" in n for n in names)
    tokens = torch.randint(0, 128, (2, 16))
    model = model.to(torch.bfloat16)
    model(tokens, labels=tokens).loss.backward()  # trains through the FP8 linears


def test_refusals_are_one_line(capsys, tmp_path):
    with pytest.raises(Fp8Error, match="is not a recipe"):
        check_fp8("blockwise", torch.device("cpu"))
    with pytest.raises(ParallelConfigError, match="use precision='bf16'"):  # a layout rule (`rules.fp8_violations`)
        paratrain.parallelize(nn.Linear(4, 4), paratrain.init_mesh(), precision="fp32", fp8="tensorwise")
    for args, message in ((["--precision", "fp32"], "needs --precision bf16 (not fp32)"),
                          (["--precision", "fp16"], "needs --precision bf16 (not fp16)")):
        assert main(["train", "--fp8", "tensorwise", *args, "--steps", "1", "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


TINY = ["--n-layers", "2", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "128",
        "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--sample-tokens", "0", "--eval-every", "0",
        "--no-progress", "--steps", "4", "--precision", "bf16", "--fp8", "tensorwise"]


RECIPES = [("tensorwise", [], 5e-3), ("tensorwise", ["--sequence-parallel"], 5e-3), ("rowwise", [], 2e-2)]


def _tp_name(recipe: str, extra: list[str]) -> str:
    return f"tp2_{recipe}" + ("_sp" if "--sequence-parallel" in extra else "")


# Every two-rank run of the tests below, by name: one launch trains them all, one after the other.
TWO_RANKS = {**{f"zero{zero}": [*TINY, "--zero", str(zero)] for zero in (0, 1, 2, 3)},
             **{_tp_name(recipe, extra): [*TINY[:-1], recipe, "--tp", "2", *extra]
                for recipe, extra, _ in RECIPES},
             "cp2": [*TINY, "--cp", "2"]}
_TWO_RANKS: dict = {}
_ONE_PROCESS: dict = {}


def _train_all(rank, world, root):  # noqa: ARG001
    from paratrain.train import train

    for name, argv in TWO_RANKS.items():
        train(config_from_args(build_parser().parse_args(["train", *argv, "--out", f"{root}/{name}"])))


def _two_ranks(tmp_path_factory, name: str) -> list[dict]:
    """The metrics of `TWO_RANKS[name]` trained on two ranks."""
    root = tmp_path_factory.getbasetemp() / "fp8-two-ranks"
    launch_once(_TWO_RANKS, 2, _train_all, str(root), timeout=600)
    return read_metrics(root / name / "metrics.jsonl")


def _one_process(tmp_path_factory, argv: list[str]) -> list[dict]:
    """The metrics of `argv` trained in this process (once per command: several tests compare against one run)."""
    if tuple(argv) not in _ONE_PROCESS:
        out = tmp_path_factory.mktemp("fp8-one") / "run"
        assert main(["train", *argv, "--out", str(out)]) == 0
        _ONE_PROCESS[tuple(argv)] = read_metrics(out / "metrics.jsonl")
    return _ONE_PROCESS[tuple(argv)]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_ranks_equal_one_fp8_process_under_every_zero_stage(tmp_path_factory, zero):
    """The same micro-batches cast alike (each matmul's scales come from its own operands), so two data ranks
    with a micro-batch each equal one process accumulating both."""
    a = _one_process(tmp_path_factory, [*TINY, "--zero", str(zero)])
    b = _two_ranks(tmp_path_factory, f"zero{zero}")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=5e-3)
    assert a[-1]["loss"] < a[0]["loss"]


@pytest.mark.parametrize("recipe, extra, tol", RECIPES)
def test_tensor_parallel_fp8_equals_one_process(tmp_path_factory, recipe, extra, tol):
    """Under tp2 each shard's matmul is in FP8; tensorwise scales are agreed over the tp group (a max-reduction
    of the amaxes), so every shard casts as the whole tensor would: the losses of one process. Rowwise scales
    its rows along a sharded reduction by the shard's own amax (no communication): close, not equal."""
    a = _one_process(tmp_path_factory, [*TINY[:-1], recipe])
    b = _two_ranks(tmp_path_factory, _tp_name(recipe, extra))
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=tol)


def test_context_parallel_fp8_agrees_its_scales_over_the_sequence(tmp_path_factory):
    """Under cp2 each rank holds half of every sequence's tokens: the tensorwise amaxes are agreed over cp, so each
    rank casts with the whole micro-batch's scale. The ring computes attention in another order than one process
    does, and FP8's coarse grid turns those roundings into larger ones: equal to one FP8 process within 1e-2."""
    a, b = _one_process(tmp_path_factory, TINY), _two_ranks(tmp_path_factory, "cp2")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-2)


def test_fp8_compiles_without_graph_breaks():
    import torch._dynamo

    model = Transformer(CFG).to(torch.bfloat16)
    convert_to_fp8(model, "tensorwise")
    block = model.layers["0"]
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    from paratrain.models.llama import rotary_tables

    cos, sin = rotary_tables(16, CFG.head_dim, CFG.rope_theta, x.device, x.dtype)
    explanation = torch._dynamo.explain(block)(x, cos, sin)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_verify_runs_every_layout_against_one_fp8_process_on_its_micro_batches(capsys):
    assert main(["verify", "--model", "tiny", "--layouts", "dp2;dp2,zero3;pp2", "--precision", "bf16", "--fp8",
                 "tensorwise", "--steps", "2"]) == 0  # judged by the FP8 error model: no --tol
    out = capsys.readouterr().out
    assert "reference: 1 process, bf16 tensorwise micro-batch 4" in out and out.count("PASS") == 3
    assert "bound: FP8 AdamW, whole model" in out
    assert "28 linears compute in FP8 (tensorwise)" in out


def _fp8_losses(cfg: ModelConfig, recipe: str | None = "tensorwise", steps: int = 4, convert=None,
                **options) -> list[float]:
    """`steps` bf16 steps of `cfg` with FP8 linears (`recipe`) through `parallelize` on this one process; `convert`:
    applied to the model (on the meta device) before."""
    import functools

    import paratrain
    from paratrain.train import train_step

    with torch.device("meta"):
        model = Transformer(cfg)
    if convert is not None:
        convert(model)
    model, optimizer = paratrain.parallelize(
        model, paratrain.init_mesh(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), precision="bf16",
        fp8=recipe, init=functools.partial(Transformer(cfg).param_init, seed=0), **options)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=g)
        losses.append(train_step(model, optimizer, [(tokens[:, :-1], tokens[:, 1:])], 1.0).loss)
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_training_with_fp8_equals_training_with_torchaos_float8_linears_loss_for_loss(recipe):
    """The reference model's blocks converted by torchao and trained in bf16 through `parallelize` without `fp8`, and
    `parallelize(fp8=recipe)`: the same losses, to the bit, over six AdamW steps (so the same gradients, the same
    casts of updated weights, the same scales: each divided as torchao divides it)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from paratrain.parallel.blocks import unit_modules

    def theirs(model):
        for _, block in unit_modules(model, "blocks"):
            convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(recipe))

    assert _fp8_losses(CFG, recipe=recipe, steps=6) == _fp8_losses(CFG, recipe=None, steps=6, convert=theirs)


def test_recomputed_and_compiled_blocks_cast_as_their_forward_did():
    """The casts are pure functions of their tensors: full and selective recomputation give the losses of no
    recomputation exactly, and compiled blocks (aot_eager: the same graphs, eager kernels) within bf16 rounding."""
    plain = _fp8_losses(CFG)
    assert _fp8_losses(CFG, activation_checkpointing="full") == plain
    assert _fp8_losses(CFG, activation_checkpointing="selective") == plain
    assert _fp8_losses(CFG, compile="aot_eager") == pytest.approx(plain, rel=1e-2)


def test_zero3_gathers_the_weights_fp8_cast_and_computes_as_one_process():
    """ZeRO-3 gathers a converted linear's weight as its e4m3 cast, the scale agreed from the shards' amaxes after
    each step: the values one process casts from its whole bf16 weight, so the same losses, with recomputation
    (which gathers the cast again) too."""
    import paratrain

    plain = _fp8_losses(CFG)
    assert _fp8_losses(CFG, data=paratrain.DataParallel(zero=3)) == pytest.approx(plain, rel=1e-6)
    for recompute in ("full", "selective"):  # the recompute reads the cast the checkpoint kept a reference to
        assert _fp8_losses(CFG, data=paratrain.DataParallel(zero=3), activation_checkpointing=recompute) == \
            pytest.approx(plain, rel=1e-6)
    assert _fp8_losses(CFG, data=paratrain.DataParallel(zero=3), compile="aot_eager") == pytest.approx(plain, rel=1e-2)


def _gathered_bytes(rank, world, recipe):
    """(bytes all-gathered in one step of four FP8-convertible linears under ZeRO-3 on `world` ranks, loss)."""
    import functools

    import paratrain
    from paratrain.testing import Collectives

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    model, optimizer = paratrain.parallelize(model, paratrain.init_mesh(), optimizer=functools.partial(
        torch.optim.AdamW, lr=1e-2), precision="bf16", fp8=recipe, data=paratrain.DataParallel(zero=3))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
    counted = Collectives()
    with counted:
        loss = model(x).float().pow(2).mean()
        loss.backward()
    optimizer.step()
    after = model(x).float().pow(2).mean().item()  # the next forward gathers the updated weights' casts
    # (on gloo paratrain's all-gather is a broadcast from each rank: the only broadcasts of the step)
    gathered = counted.op_bytes.get("_allgather_base_", 0.0) + counted.op_bytes.get("broadcast_", 0.0)
    return gathered, after


def _gathered_bytes_of_both(rank, world):
    return _gathered_bytes(rank, world, "tensorwise"), _gathered_bytes(rank, world, None)


def test_zero3_fp8_gathers_send_half_the_bytes_of_bf16_gathers():
    fp8_runs, bf16_runs = zip(*run_on_ranks(_gathered_bytes_of_both, 2, timeout=120))
    assert fp8_runs[0][0] > 0 and fp8_runs[0][0] == bf16_runs[0][0] / 2
    assert fp8_runs[0][1] == pytest.approx(bf16_runs[0][1], rel=0.1)  # FP8's numbers, near bf16's


def _sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Signal to quantization noise of `other` against `reference`, in dB."""
    reference, other = reference.float(), other.float()
    return (20 * torch.log10(reference.norm() / (reference - other).norm())).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_keeps_the_signal_to_noise_of_fp8_training(recipe):
    """torchao's bars for an FP8 linear against bf16: a cast's round trip >= 25 dB, the output >= 18 dB, the
    weight gradient >= 17 dB (the input gradient too)."""
    torch.manual_seed(0)
    x = torch.randn(256, 512, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(1024, 512) * 0.02).to(torch.bfloat16).requires_grad_()
    g = torch.randn(256, 1024, dtype=torch.bfloat16)
    along = {} if recipe == "tensorwise" else {"dim": 1, "power_of_two": True}
    assert _sqnr(x, _dequantized(x, E4M3, **along)) >= 25
    y = fp8_linear(x, w, None, recipe)
    y.backward(g)
    fp8_x, fp8_w = x.grad, w.grad
    x.grad = w.grad = None
    reference = F.linear(x, w)
    reference.backward(g)
    assert _sqnr(reference, y) >= 18 and _sqnr(w.grad, fp8_w) >= 17 and _sqnr(x.grad, fp8_x) >= 17


def test_a_weight_gathered_as_its_cast_computes_odd_token_counts_from_the_cast():
    """Under ZeRO-3 a converted weight exists only as its e4m3 cast: a matmul whose tokens do not fill the kernels'
    tiles runs in bf16 on the cast's values, keeps the cast (not a dequantized copy) for backward, and hands the
    weight's gradient to the stand-in autograd sees."""
    from paratrain.parallel.fp8 import weight_cast

    torch.manual_seed(0)
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16, requires_grad=True)  # 15 tokens
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    wq, scale = weight_cast(w)
    stand_in = torch.zeros((), dtype=torch.bfloat16).expand(48, 32).requires_grad_()
    bias = torch.randn(48, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_linear(x, stand_in, bias, "tensorwise", cast=(wq, scale), cast_only=True)
    g = torch.randn_like(y)
    y.backward(g)
    values = (wq.float() / scale).to(torch.bfloat16).requires_grad_()
    x2 = x.detach().requires_grad_()
    reference = F.linear(x2, values) + bias.detach()  # (the bias added after the matmul, as the FP8 path adds it)
    reference.backward(g)
    assert torch.equal(y, reference) and torch.equal(x.grad, x2.grad)
    assert torch.equal(stand_in.grad, values.grad) and torch.equal(bias.grad, g.sum((0, 1)))
