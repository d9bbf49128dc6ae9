"""Time and cost of training on a token budget: days, GPU-hours and money for one layout.

With T tokens, a step of B sequences of s tokens taking t seconds on n GPUs:

    steps = T / (B·s),    time = steps · t,    GPU-hours = n · time / 3600,    cost = GPU-hours · price

which is the same as time = T · F / (n · X), with F the model FLOPs per token the planner counts
(6N + 12·L·h·s, `ModelConfig.flops_per_token`) and X the model FLOP/s each GPU achieves in the
estimate (MFU × peak). With full recomputation the hardware FLOPs are about 8N per token, the
8·T·P / (n·X) rule of thumb when X counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.memory import PlanError
from paratrain.plan.search import Estimate

SECONDS_PER_DAY = 86400.0
# A default batch when the user gives none for a token budget: Llama 2's 4M tokens per step
# (Touvron et al. 2023, §2.2, "a global batch-size of 4M tokens").
DEFAULT_BATCH_TOKENS = 4 * 2**20


@dataclass(frozen=True)
class Budget:
    """The time and cost of training `tokens` tokens with one estimate's layout on `gpus` GPUs."""

    tokens: float
    gpus: int
    step_s: float
    tokens_per_step: float
    model_flops_per_token: float
    hardware_flops_per_token: float
    gpu_hour_price: float | None = None
    flops_formula: str = "6N + 12·L·h·s"

    @property
    def steps(self) -> float:
        return self.tokens / self.tokens_per_step

    @property
    def seconds(self) -> float:
        return self.steps * self.step_s

    @property
    def days(self) -> float:
        return self.seconds / SECONDS_PER_DAY

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.seconds / 3600

    @property
    def cost(self) -> float | None:
        return None if self.gpu_hour_price is None else self.gpu_hours * self.gpu_hour_price

    @property
    def achieved_flops_per_gpu(self) -> float:
        """X: model FLOP/s per GPU in the estimate."""
        return self.model_flops_per_token * self.tokens_per_step / (self.step_s * self.gpus)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "gpus": self.gpus, "steps": self.steps, "step_s": self.step_s,
                "days": self.days, "gpu_hours": self.gpu_hours, "gpu_hour_price": self.gpu_hour_price,
                "cost": self.cost, "model_flops_per_token": self.model_flops_per_token,
                "hardware_flops_per_token": self.hardware_flops_per_token,
                "achieved_model_flops_per_gpu": self.achieved_flops_per_gpu}


def budget(est: Estimate, tokens: float, gpu_hour_price: float | None = None) -> Budget:
    """Training time and cost of `tokens` tokens at the estimate's step time."""
    if not tokens > 0:
        raise PlanError(f"--tokens must be positive, got {tokens!r}")
    if gpu_hour_price is not None and not gpu_hour_price >= 0:
        raise PlanError(f"--gpu-hour-price must be a non-negative number, got {gpu_hour_price!r}")
    batch = est.workload.global_batch or est.layout.dp * est.layout.micro_batch
    per_step = float(batch * est.workload.seq_len)
    return Budget(tokens=float(tokens), gpus=est.layout.world_size, step_s=est.time.total, tokens_per_step=per_step,
                  model_flops_per_token=est.flops.model / per_step,
                  hardware_flops_per_token=est.flops.hardware / per_step, gpu_hour_price=gpu_hour_price,
                  flops_formula="6N + 12·L·h·s" if est.workload.model is not None else "6N")


def format_budget(b: Budget) -> str:
    """The answer and how it was computed, one line per quantity."""
    lines = [f"training on {b.tokens:,.0f} tokens ({_short(b.tokens)}):",
             f"  steps      = T / tokens per step = {_short(b.tokens)} / {b.tokens_per_step:,.0f} = {b.steps:,.0f}",
             f"  time       = steps × step time = {b.steps:,.0f} × {b.step_s:.3f} s = {b.days:,.1f} days",
             f"             = T · F / (n · X) with F = {b.model_flops_per_token:.3e} model FLOPs per token "
             f"({b.flops_formula}; {b.hardware_flops_per_token:.3e} with recomputation) and X = "
             f"{b.achieved_flops_per_gpu / 1e12:,.1f} TFLOP/s of model FLOPs per GPU",
             f"  GPU-hours  = n × time = {b.gpus} × {b.seconds / 3600:,.1f} h = {b.gpu_hours:,.0f}"]
    if b.cost is not None:
        lines.append(f"  cost       = GPU-hours × price = {b.gpu_hours:,.0f} × ${b.gpu_hour_price:,.2f} "
                     f"= ${b.cost:,.0f}")
    else:
        lines.append("  cost       = GPU-hours × price (give --gpu-hour-price)")
    return "\n".join(lines)


def _short(value: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"
