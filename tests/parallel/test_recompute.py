"""Activation recomputation: none, full and selective give the same training; selective keeps what the planner counts.

One launch of 2 ranks (eager blocks; compiled ones are in test_compile.py):

- parity: 4 AdamW steps in fp32 under ZeRO-3 with prefetch (dp 2) and under tensor parallelism (tp 2, whose
  row layers sum their partial outputs in place, which selective recomputation keeps) with none, full and
  selective recomputation: the parameters after the steps within 1e-6 of none's.
- memory: the peak of live tensor bytes over a training step (`TensorMemory`) of an 8-block model, DDP in
  fp32: selective's lies strictly between none's and full's.
- the planner: the bytes one more block leaves alive after the forward under selective recomputation
  (what it keeps for backward, its output counted as the next block's input) equal
  `layer_activation_bytes(..., Recompute.SELECTIVE)` for that block's shape, on one rank and per rank of
  tp 2, with sequence parallelism and without; and without recomputation, `layer_activation_bytes(...,
  Recompute.NONE)` in fp32 and bf16, on one rank and per rank of tp 2 with and without sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
import gc

import pytest
import torch

from paratrain import DataParallel, TensorParallel, init_mesh, parallelize
from paratrain.cli import build_parser
from paratrain.commands.options import config_from_args
from paratrain.config import ConfigError, validate
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel.rules import Checkpointing, Recompute, RecomputeError
from paratrain.peak_memory import TensorMemory, kept_by_forward
from paratrain.plan.activations import layer_activation_bytes
from parallel_cases import TINY, adamw, batches, launch_once, loss_sum

MODES = (0, "full", "selective")
WIDE = ModelConfig(vocab_size=64, dim=64, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32)
ROWS, SEQ = 8, 32  # the memory measurements' batch: activations outweigh the model state


def _meta(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def _parallel(cfg: ModelConfig, mesh, mode, **options):
    model = _meta(cfg)
    return parallelize(model, mesh, optimizer=functools.partial(adamw, lr=1e-2), activation_checkpointing=mode,
                       init=lambda name, shape: model.param_init(name, shape, 0), **options)


def _trained(mesh, mode, **options) -> dict[str, torch.Tensor]:
    model, optimizer = _parallel(TINY, mesh, mode, data=DataParallel(zero=options.pop("zero", 0), prefetch=True),
                                 **options)
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    for x, y in batches(steps=4, batch=4):
        rows = x.shape[0] // dp
        loss_sum(model, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]).div(64).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.full_state_dict()


def _step_peak(mesh, mode) -> int:
    gc.collect()  # the models measured before are gone
    model, optimizer = _parallel(WIDE, mesh, mode)
    x, y = batches(vocab=64, steps=1, batch=ROWS, seq=SEQ)[0]

    def step():
        loss_sum(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    meter = TensorMemory()
    with meter:
        meter.begin(model, optimizer)
        step()
        return meter.end(model, optimizer).peak_bytes


def _kept_after_forward(mesh, n_layers: int, mode="selective", **options) -> int:
    """Bytes a `mode` model's forward leaves alive (what backward will read, and the logits).

    The median of five forwards (`kept_by_forward`): under load a collective's tensor is released by the
    process group's thread a moment late, inside the next window or after this one; what the model keeps is
    what most forwards leave."""
    gc.collect()  # the models built before are gone, not freed inside the window
    cfg = dataclasses.replace(WIDE, n_layers=n_layers)
    model, _ = _parallel(cfg, mesh, mode, **options)
    x, _ = batches(vocab=64, steps=1, batch=ROWS, seq=SEQ)[0]
    return kept_by_forward(model, lambda: model(x))


def _all(rank, world):  # noqa: ARG001
    dp2, tp2 = init_mesh(dp=2), init_mesh(dp=1, tp=2)
    return {
        "peaks": {mode: _step_peak(dp2, mode) for mode in MODES},
        "kept": {n: _kept_after_forward(dp2, n) for n in (2, 3)},
        "kept_tp2": {n: _kept_after_forward(tp2, n, tensor=TensorParallel()) for n in (2, 3)},
        "kept_tp2_sp": {n: _kept_after_forward(tp2, n, tensor=TensorParallel(sequence_parallel=True)) for n in (2, 3)},
        "all": {n: _kept_after_forward(dp2, n, 0) for n in (2, 3)},
        "all_bf16": {n: _kept_after_forward(dp2, n, 0, precision="bf16") for n in (2, 3)},
        "all_tp2": {n: _kept_after_forward(tp2, n, 0, tensor=TensorParallel()) for n in (2, 3)},
        "all_tp2_sp": {n: _kept_after_forward(tp2, n, 0, tensor=TensorParallel(sequence_parallel=True))
                       for n in (2, 3)},
        "zero3_prefetch": {mode: _trained(dp2, mode, zero=3) for mode in MODES},
        "tp2": {mode: _trained(tp2, mode, tensor=TensorParallel()) for mode in MODES},
    }


_RESULTS: dict = {}


def _results() -> list[dict]:
    return launch_once(_RESULTS, 2, _all, timeout=300)


def test_settings_parse_and_name_the_modes():
    assert Checkpointing.parse(0) == Checkpointing.parse("none") == Checkpointing()
    assert Checkpointing.parse(1) == Checkpointing.parse("full") == Checkpointing(Recompute.FULL, 1)
    assert Checkpointing.parse("3") == Checkpointing(Recompute.FULL, 3)
    assert Checkpointing.parse("selective").mode is Recompute.SELECTIVE
    assert Checkpointing.parse("selective").planned is Recompute.SELECTIVE
    assert Checkpointing.parse(2).planned is Recompute.NONE  # every other block: counted as keeping all
    for bad in (-1, "some", 1.5, True):
        with pytest.raises(RecomputeError, match="not one of none, full, selective or k"):
            Checkpointing.parse(bad)


def test_the_command_line_takes_a_mode_or_a_count():
    parse = lambda *argv: config_from_args(build_parser().parse_args(["train", *argv]))  # noqa: E731
    assert parse("--activation-checkpointing", "selective").parallel.activation_checkpointing == "selective"
    assert parse("--activation-checkpointing", "2").parallel.activation_checkpointing == 2
    assert parse("--compile").parallel.compile is True
    with pytest.raises(ConfigError, match="--activation-checkpointing sometimes is not one of"):
        validate(parse("--activation-checkpointing", "sometimes"))


@pytest.mark.parametrize("layout", ["zero3_prefetch", "tp2"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_trains_as_keeping_everything(layout, mode):
    for per_rank in _results():
        kept, recomputed = per_rank[layout][0], per_rank[layout][mode]
        for name, value in kept.items():
            torch.testing.assert_close(recomputed[name], value, rtol=1e-6, atol=1e-6, msg=name)


def test_selective_peak_lies_between_keeping_everything_and_full_recomputation():
    for per_rank in _results():
        peaks = per_rank["peaks"]
        assert peaks["full"] < peaks["selective"] < peaks[0], {k: v / 2**20 for k, v in peaks.items()}


@pytest.mark.parametrize("layout, tp, sp", [("kept", 1, False), ("kept_tp2", 2, False), ("kept_tp2_sp", 2, True)])
def test_the_planner_counts_what_selective_recomputation_keeps(layout, tp, sp):
    """Exactly (no tolerance) without sequence parallelism: the planner's formula counts the tensors the policy
    keeps, element by element. With it, the planner counts one s·b·h partial sum per layer that the measured
    forward does not hold (an over-estimate, as a memory plan may have)."""
    per_layer = layer_activation_bytes(SEQ, ROWS, WIDE.dim, WIDE.n_heads, tp, sp, recompute=Recompute.SELECTIVE,
                                       precision="fp32", kv_heads=WIDE.n_kv_heads, ffn_dim=WIDE.ffn_dim, flash=True)
    for per_rank in _results():
        kept = per_rank[layout]
        measured = kept[3] - kept[2]
        if not sp:
            assert measured == per_layer
        else:  # one partial sum (wo's or w2's, s·b·h) is counted by the planner and not held: never under, at most that
            assert measured <= per_layer <= measured + SEQ * ROWS * WIDE.dim * 4, (measured, per_layer)


@pytest.mark.parametrize("layout, tp, sp, precision", [("all", 1, False, "fp32"), ("all_bf16", 1, False, "bf16"),
                                                       ("all_tp2", 2, False, "fp32"), ("all_tp2_sp", 2, True, "fp32")])
def test_the_planner_counts_what_a_block_keeps_without_recomputation(layout, tp, sp, precision):
    """Exactly: the planner counts a block's kept tensors as paratrain's block runs them (`block_bytes_as_run`:
    the norms' fp32 copies in bf16, the attention kernel's inputs at every query head and its log-sum-exp, the
    gated MLP's four tensors; with SP the gathered input each matmul keeps)."""
    per_layer = layer_activation_bytes(SEQ, ROWS, WIDE.dim, WIDE.n_heads, tp, sp, recompute=Recompute.NONE,
                                       precision=precision, kv_heads=WIDE.n_kv_heads, ffn_dim=WIDE.ffn_dim, flash=True)
    for per_rank in _results():
        kept = per_rank[layout]
        assert kept[3] - kept[2] == per_layer


def test_selective_recomputation_with_zb_h1_is_refused_in_one_line():
    """zb-h1 runs a block's backward twice (input gradients, then weight gradients); torch's selective contexts
    replay a block's saved outputs once, so the pair is refused before step 1 (full recomputation composes)."""
    from paratrain.parallel.rules import LayoutRuleError, LayoutSpec, check_layout

    with pytest.raises(LayoutRuleError, match="selective with --schedule zb-h1 is refused"):
        check_layout(LayoutSpec(dp=1, pp=2, schedule="zb-h1", activation_checkpointing="selective"))
    for schedule, mode in (("zb-h1", "full"), ("1f1b", "selective")):
        check_layout(LayoutSpec(dp=1, pp=2, schedule=schedule, activation_checkpointing=mode))
