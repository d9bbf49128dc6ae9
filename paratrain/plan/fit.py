"""Fitting `paratrain plan --calibrate`'s measurements into a hardware profile's constants.

Each fit uses relative errors (a measurement's noise grows with its size) and falls back to
the best measured point where the data cannot determine a constant.
"""

from __future__ import annotations

import dataclasses
import statistics

from paratrain.models.configs import ModelConfig
from paratrain.plan.collectives import Collective
from paratrain.plan.hardware import GemmCurve, Hardware, LinkCost
from paratrain.plan.host import host_times
from paratrain.plan.measure import HOST_MODEL, HOST_VARIANTS
from paratrain.plan.memory import PlanError, Recompute
from paratrain.plan.ops import FLASH_BACKWARD_MATMULS, Gemm, Shape, attention_seconds


class CalibrationError(PlanError):
    """A calibration measurement could not be made or fitted; the message says which."""



def fit_gemm_curve(rows: list[tuple[int, int, int, float]]) -> tuple[float, GemmCurve]:
    """(plateau FLOP/s, GemmCurve(1, x_half)) from measured (m, n, k, seconds).

    1/throughput = a + b/x with a = 1/A and b = x_half/A: a line in 1/x, fitted by least squares
    on relative errors. A single shape, or a fit without a positive plateau, keeps the best
    measured throughput as the plateau and x_half = 0.
    """
    points = [(3.0 / (1 / m + 1 / n + 1 / k), s / (2.0 * m * n * k)) for m, n, k, s in rows]
    best = 1.0 / min(y for _, y in points)
    if len({x for x, _ in points}) < 2:
        return best, GemmCurve(1.0, 0.0)
    weights = [1 / y for _, y in points]  # relative errors
    a, b = _weighted_line([1 / x for x, _ in points], [y for _, y in points], weights)
    if a <= 0:
        return best, GemmCurve(1.0, 0.0)
    return 1.0 / a, GemmCurve(1.0, max(0.0, b / a))


def _weighted_line(xs: list[float], ys: list[float], weights: list[float]) -> tuple[float, float]:
    """(intercept, slope) minimizing Σ (w·(y − intercept − slope·x))²."""
    w2 = [w * w for w in weights]
    sw, sx, sy = sum(w2), sum(w * x for w, x in zip(w2, xs)), sum(w * y for w, y in zip(w2, ys))
    sxx = sum(w * x * x for w, x in zip(w2, xs))
    sxy = sum(w * x * y for w, x, y in zip(w2, xs, ys))
    det = sw * sxx - sx * sx
    if det == 0:
        return sy / sw, 0.0
    slope = (sw * sxy - sx * sy) / det
    return (sy - slope * sx) / sw, slope


def fit_link(kind: str, world: int, rows: list[tuple[int, float]]) -> LinkCost:
    """α and β of steps·α + bytes sent/β through measured (full bytes, seconds), relative errors.

    A negative intercept means the latency is below what the sizes resolve: α = 0 and β from
    the largest size. Costs that do not grow with size are refused (no bandwidth to fit).
    """
    samples = [(Collective(kind, size, world), max(seconds, 1e-7)) for size, seconds in rows]
    xs = [c.bytes_sent / c.steps for c, _ in samples]
    ys = [s / c.steps for c, s in samples]
    alpha, inv_beta = _weighted_line(xs, ys, [1 / y for y in ys])
    if inv_beta <= 0:
        c, seconds = max(samples, key=lambda item: item[0].size)
        if seconds <= 0:
            raise CalibrationError(f"{kind}: the measured time does not grow with the size; rerun on a quieter machine")
        return LinkCost(0.0, c.bytes_sent / seconds)
    if alpha < 0:
        c, seconds = max(samples, key=lambda item: item[0].size)
        return LinkCost(0.0, c.bytes_sent / seconds)
    return LinkCost(alpha, 1.0 / inv_beta)


def fit_attention(rows: list, hardware: Hardware, dtype: str = "fp32") -> float:
    """Median of (time the GEMM curve predicts for the attention matmuls in `dtype`) / (measured time)."""
    ratios = []
    for b, h, s, d, seconds in rows:
        matmuls = [Gemm(s, s, d, b * h), Gemm(s, d, s, b * h)]
        forward = sum(hardware.gemm_seconds(g.m, g.n, g.k, dtype, g.count) for g in matmuls)
        predicted = 0.5 * forward * (2 + FLASH_BACKWARD_MATMULS) / 2  # causal: half the scores
        ratios.append(predicted / seconds)
    return statistics.median(ratios)


def fit_flash_attention(rows: list, hardware: Hardware, dtype: str) -> tuple[float, float]:
    """(attention_efficiency, attention_overhead_s) of a flash kernel from measured causal forward + backward.

    The planner prices one pass as matmul time / efficiency + its operands' bytes + the overhead
    (`ops.attention_seconds`), so a call's forward and backward take W/efficiency + M + 2·overhead:
    a line in W, fitted on relative errors. At small sizes the overhead (launches, the host's
    autograd) is most of a call, which a ratio alone would read as a slow kernel. One shape, or a
    fit without a positive slope and intercept, keeps overhead 0 and the median ratio.
    """
    unit = dataclasses.replace(hardware, attention_efficiency=1.0, attention_overhead_s=0.0)
    half = dataclasses.replace(unit, attention_efficiency=2.0)
    work, rest, measured = [], [], []
    for b, h, s, d, seconds in rows:
        x = Shape(tokens=float(b * s), seq_len=s, batch=b, hidden=h * d, q_width=float(h * d),
                  kv_width=float(h * d), ffn=0.0, local_heads=float(h), head_dim=d, vocab=0.0,
                  residual=float(h * d), dtype=dtype, flash=True)

        def call(hw: Hardware) -> float:
            return attention_seconds(hw, x, 2) + attention_seconds(hw, x, FLASH_BACKWARD_MATMULS, backward=True)

        matmuls = 2 * (call(unit) - call(half))  # the only part that scales with 1/efficiency
        work.append(matmuls)
        rest.append(call(unit) - matmuls)
        measured.append(seconds)
    ys = [m - r for m, r in zip(measured, rest)]
    if len(set(work)) >= 2:
        intercept, slope = _weighted_line(work, ys, [1 / m for m in measured])
        if slope > 0 and intercept >= 0:
            return 1.0 / slope, intercept / 2
    return statistics.median(w / max(y, 1e-12) for w, y in zip(work, ys)), 0.0


# The profile field each variant of `measure.HOST_VARIANTS` measures beyond the one without recomputation or ZeRO-3.
_HOST_FIELDS = {"full": "host_full_op_s", "selective": "host_selective_op_s", "zero3": "host_unit_s"}


def fit_host(measured: dict, hardware: Hardware) -> dict[str, float]:
    """The profile's host costs from `measure.measure_host_ops`'s timings, by the planner's own rule
    (`paratrain.plan.host.host_times`, a step of one stage: the embedding, the blocks, the head) inverted.

    Each variant's host seconds (forward + backward) are linear in the costs: `host_op_s` from the variant
    without recomputation or ZeRO-3, then each other cost from its variant's excess over the prediction with
    that cost 0 (a negative excess, noise, gives 0).
    """
    layers = measured["layers"]
    model = ModelConfig(**{**HOST_MODEL, "n_layers": layers})
    x = Shape.of(model, 1, model.max_seq_len, 1, False, "bf16", flash=True)

    def predicted(costs: dict, recompute: Recompute, zero3: bool) -> float:
        times = host_times(dataclasses.replace(hardware, **costs), x, layers, recompute, zero3, True, True).total
        return times.forward + times.backward

    zero = {"host_op_s": 0.0, **{field: 0.0 for field in _HOST_FIELDS.values()}}
    costs = {**zero, "host_op_s": sum(measured["none"]) / predicted({**zero, "host_op_s": 1.0}, Recompute.NONE, False)}
    for variant, field in _HOST_FIELDS.items():
        stage, recompute = HOST_VARIANTS[variant]
        args = (Recompute(recompute), stage == 3)
        unit = predicted({**costs, field: 1.0}, *args) - predicted(costs, *args)
        costs[field] = max(0.0, (sum(measured[variant]) - predicted(costs, *args)) / unit)
    return costs
