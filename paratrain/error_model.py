"""How far a layout's run may be from one process's, and why: the error model that `paratrain verify` judges a
layout by and that the parity tests assert.

A layout runs the same algorithm as one process, but its sums run in another order (over ranks, buckets,
micro-batches, ring steps, shards), and a CPU's kernels round by their vector width: PyTorch dispatches on the
processor (`ATEN_CPU_CAPABILITY`: default, avx2, avx512), so the same code gives other roundings on another
machine. What a parity test may compare is therefore what those roundings cannot push across, written here
once, with the reason; `tests/other_machines.sh` runs the parity tests under every capability this machine
offers and reports each bound's measured worst against it (PARATRAIN_ERROR_REPORT). Every bound is at least
10x the worst measured on AVX-512, AVX2 and the default path, and below what a wrong gradient gives
(tests/parallel/test_parity_faults.py injects one per strategy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7
FP64_EPS = torch.finfo(torch.float64).eps  # 2.2e-16


@dataclass(frozen=True)
class ErrorModel:
    """How far a layout's losses and parameters may be from one process's, and why."""

    name: str
    loss_rtol: float  # |loss − loss_ref| / |loss_ref|, each step
    param_rtol: float  # ‖θ − θ_ref‖ / ‖θ_ref‖ after the last step, per parameter tensor or over the model
    why: str
    scope: str = "tensor"  # "tensor": the worst parameter tensor; "model": all parameters as one vector
    per_step: bool = False  # both bounds are per optimizer step, times the steps compared
    stray: int = 0  # scope "model": this many elements, the farthest apart, set aside before the comparison

    def bounds(self, steps: int) -> tuple[float, float]:
        """(loss bound, parameter bound) for a run of `steps` optimizer steps."""
        scale = steps if self.per_step else 1
        return self.loss_rtol * scale, self.param_rtol * scale


# The same algorithm in fp64: the only difference is summation order, n·ε64 relative for a sum of n terms
# (n ≤ 10⁴ here: 2e-12), carried through 20 optimizer steps.
FP64_PARITY = ErrorModel("fp64", 1e-10, 1e-10, "summation order only, in fp64: n·ε64 ≤ 2e-12 per sum")

# fp32 with AdamW, bounds per optimizer step: each step's sums round differently in another order, and Adam
# carries what it moved into every later step, so the two runs drift apart about linearly over these short runs.
# Losses: a token-loss sum of n ≤ 10³ terms rounds by ≤ √n·ε32 ≈ 4e-6 typically; measured worst 1.1e-7 after 3
# steps and 1.7e-6 after 20 (ZeRO-3, tied, dp4, AVX2): 1e-6 per step. Parameters, per tensor and never element by
# element: Adam divides each gradient by its own running magnitude, so an element whose gradient is at rounding
# level steps by about lr whichever way the rounding goes (element-wise differences after 3 steps reach 1.1e-5 on
# AVX-512 and 2.4e-6 on AVX2: they measure the vector width, not the layout). Over a tensor those few elements add
# to the many whose gradients are well above rounding, whose steps differ by lr·O(√n·ε32); the worst tensor
# measured is 1.1e-5 after 3 steps (context parallel), 4.2e-5 after 4 (compiled against eager, ZeRO-3 with
# selective recomputation) and 1.6e-4 after 20 (ZeRO-3, tied, dp4, AVX2): 1.5e-4 per step. A gradient counted
# twice moves its worst tensor by 15-120% of its norm (tests/parallel/test_parity_faults.py).
FP32_ADAMW = ErrorModel("fp32 AdamW", 1e-6, 1.5e-4, "reduction order under fp32 rounding, amplified by Adam's "
                                                  "per-element normalization; compared per tensor", per_step=True)

# fp32 AdamW on a model with parameters whose gradient is zero in exact arithmetic (GPT-2's key biases: softmax
# does not change when every score of a query moves by the same amount): Adam normalizes pure rounding noise
# there, so such a tensor follows the processor's rounding (3.1e-4 of its norm after 5 steps on the default path)
# and only the model as a whole, as `paratrain verify` judges a layout, has a bound rounding cannot cross:
# measured 4.7e-6 after 5 steps (AVX-512), 2e-5 per step.
FP32_ADAMW_MODEL = replace(FP32_ADAMW, name="fp32 AdamW, whole model", param_rtol=2e-5, scope="model",
                           why="Adam steps on rounding where a gradient is exactly zero; compared over the whole model")

# The same, with the elements that rounding alone decides set aside: an element whose exact gradient is no larger than
# fp32's rounding of it is stepped by Adam by up to lr whichever way it rounds (Adam's eps, 1e-8, is below that
# rounding), and that one element moves a model of norm ‖θ‖ by up to lr/‖θ‖ a step: 7e-4 for the transformers models
# of tests/hf_families.py at lr 1e-2, more than any whole-model bound that still tells layouts apart. Measured on
# Phi-3 (2 steps, AVX2): one embedding element's exact gradient is 1.4e-8 after clipping (fp64) where fp32 gives
# 3.5e-8 on one process, 3.3e-8 on one process over split batches and 2.5e-8 under tp2 + sp; after Adam that element
# sits 1.6e-3, 1.5e-3 and 1.0e-3 from the fp64 run's, so tp2 + sp is 5.5e-4 from one process there: 4.1e-5 of the
# model whole, 6.8e-7 without it (one fp32 process is itself 1.2e-4 from the fp64 run, the layout 7.6e-5; the layout
# in fp64 equals one process to 2e-15). Phi-3's other layouts show such elements too: cp2 2.1e-5 whole and 4.7e-7
# without them, dp2 ZeRO-3 5.2e-6 and 5.7e-8; on the default path tp2 + sp is 8.8e-6 whole, 4.5e-7 without its
# farthest element (an embedding one again). Every transformers case of tests/parallel/test_hf_layouts.py with two
# elements set aside: worst 5.5e-6 on AVX2 and 5.4e-6 on the default path (Gemma 2 tp2 + sp; 7.4e-6 whole, the same
# case FP32_ADAMW_MODEL judges), 7x under the 2e-5 per step kept. Two elements, never more, are set aside: a wrong
# gradient moves thousands (tests/parallel/test_parity_faults.py fails every injected fault under this model).
FP32_ADAMW_MODEL_STRAY = replace(FP32_ADAMW_MODEL, name="fp32 AdamW, whole model, two stray elements", stray=2,
                                 why="Adam steps on rounding where a gradient is zero or below its rounding; the two "
                                     "elements farthest apart set aside, the rest compared over the whole model")

# A chaotic fp32 run (lr 1e-2, tiny vocabulary, 20 AdamW steps) against the fp64 run of the same model: one fp32
# process itself drifts from it by up to 1e-4 in loss and 1e-3 in parameters by step 20, and any reordering of
# the sums by as much again; measured worst 1.9e-4 in loss (tp2 + sp, default path). So 2e-3 and 5e-2: the fp64
# parity tests hold such layouts to 1e-10; this bound says only that fp32 stays as close as fp32 can.
FP32_CHAOTIC = ErrorModel("fp32 against fp64, chaotic run", 2e-3, 5e-2, "fp32 rounding grows through a chaotic run")



# -- mixed precision, as `paratrain verify` judges a layout: the whole model, per optimizer step -----------------
#
# The layout and its one-process reference compute in the same precision, so what differs is still only where the
# sums are split and in what order; but each partial sum a layout keeps apart (a tensor-parallel rank's share of a
# matmul, a pipeline stage's boundary, a ZeRO-3 gather's cast) is rounded to the compute dtype before it is added:
# a relative error of the dtype's unit roundoff u (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4; an FP8 matmul's e4m3
# operands 2^-4 = 6.3e-2, scaled per tensor or per row) where fp32's is 6e-8. Adam turns the gradients' rounding
# into steps of about the learning rate whichever way it goes wherever a gradient is small against it, so the
# parameters drift apart about linearly over the steps compared. Measured on `paratrain verify`'s default run
# (the tiny model, lr 3e-3, global batch 8 of 64 tokens, 3 steps), the worst of dp2 ZeRO-3, tp2 + sp and pp2 1F1B:
# bf16 loss 1.2e-4 and model 5.3e-3 (both tp2 + sp), so 4e-5 and 1.8e-3 per step (a small transformers Llama's
# dp2 ZeRO-3: 4.3e-5 and 2.4e-3). Each bound below is 10x the
# worst measured per step; a gradient counted twice or negated on one rank moves the model by far more
# (tests/parallel/test_parity_faults.py checks every injected fault against the bf16 bound).
BF16_ADAMW = ErrorModel("bf16 AdamW, whole model", 4e-4, 1.8e-2,
                        "partial sums rounded to bf16 (u = 3.9e-3) where one process adds them first, amplified by "
                        "Adam's per-element normalization; compared over the whole model", scope="model",
                        per_step=True)

# fp16 rounds 8x finer than bf16 (u = 4.9e-4), under a loss scale that a layout and its reference keep alike.
# Measured the same way: loss 1.5e-4 and model 1.4e-3 (both tp2 + sp), so 5e-5 and 4.5e-4 per step; the model
# drifts 4x less than bf16's, the loss no less (the fp32 loss of logits whose inputs rounded differently).
FP16_ADAMW = ErrorModel("fp16 AdamW, whole model", 5e-4, 4.5e-3,
                        "partial sums rounded to fp16 (u = 4.9e-4) where one process adds them first, amplified by "
                        "Adam's per-element normalization; compared over the whole model", scope="model",
                        per_step=True)

# FP8 linears (with bf16 elsewhere): each matmul's operands are e4m3 (u = 6.3e-2) under scales taken from their own
# amax, which the reference shares (it runs the layout's micro-batches; tensor parallelism agrees one scale over
# the group), so a layout changes the rounding of the bf16 parts and, through them, which values an FP8 cast
# rounds up or down. Measured with tensorwise FP8 after 3 steps: the tiny model's dp2 ZeRO-3 loss 0 and model
# 2.0e-3, pp2 1F1B 0 and 0 (its tp2 + sp is refused: a 344-row shard is no multiple of FP8's 16); a small
# transformers Llama's dp2 ZeRO-3 loss 8.4e-5 and model 2.3e-3 (rowwise 6.0e-5 and 2.2e-3), and a larger one's
# model 8e-3, the worst, 2.7e-3 per step.
FP8_ADAMW = ErrorModel("FP8 AdamW, whole model", 1e-3, 3e-2,
                       "FP8 operands (e4m3, u = 6.3e-2) that a layout's bf16 rounding pushes to the neighbouring "
                       "value, amplified by Adam's per-element normalization; compared over the whole model",
                       scope="model", per_step=True)


# Muon (`torch.optim.Muon`, in one process as on every layout) rounds each matrix's update to bf16 before its
# Newton–Schulz iteration: a gradient that another reduction order moves by its last fp32 bit flips some of those
# roundings by one bf16 step, and the iteration spreads each flip over its matrix, so a correct layout's updates
# differ from one process's by up to bf16's unit roundoff u = 2^-8 of themselves, in any precision. Measured on
# `paratrain verify`'s default run in fp32 (dp2 with ZeRO-0/1/3, 3 steps): parameters 5.5e-4 and losses 1.4e-5, so
# 1.8e-3 and 5e-5 per step (10x the worst per step); a rank negating its gradients moves the parameters by 3e-2 to
# 4e-2 and the losses by 0.2 to 0.3 in those 3 steps. In 16-bit or with FP8 a layout is judged by the looser of
# this and its precision's bound, each component.
MUON = ErrorModel("fp32 Muon, whole model", 5e-5, 1.8e-3,
                  "Newton–Schulz's bf16 input, whose roundings another reduction order flips (u = 3.9e-3), spread "
                  "over each matrix; compared over the whole model", scope="model", per_step=True)


def default_bound(precision: str, fp8: str = "", optimizer: str = "adamw") -> ErrorModel:
    """The error model a layout in `precision` (fp32, bf16, fp16) with FP8 linears (`fp8`: '', 'tensorwise',
    'rowwise') and `optimizer` (adamw, muon) is judged by against its one-process reference, over the whole model
    as `paratrain verify` does."""
    model = FP8_ADAMW if fp8 else {"bf16": BF16_ADAMW, "fp16": FP16_ADAMW}.get(precision, FP32_ADAMW_MODEL)
    if optimizer != "muon":
        return model
    if model is FP32_ADAMW_MODEL:
        return MUON
    return replace(model, name=f"{model.name.split(',')[0]} with Muon, whole model",
                   loss_rtol=max(model.loss_rtol, MUON.loss_rtol), param_rtol=max(model.param_rtol, MUON.param_rtol),
                   why=f"{model.why}; Muon: {MUON.why.split(';')[0]}")
