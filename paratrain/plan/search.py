"""The rules and the full estimate of one layout, and the search over layouts for a GPU count.

`layout_violations` lists every rule a layout breaks for a workload (each a `Violation` with a
rule name and a one-line reason); `validate_layout` raises the first; `search` enumerates candidate
layouts, drops those that break a rule or do not fit in memory (keeping why), and ranks the rest
by estimated step time. The rules themselves, and their order, are `paratrain.parallel.rules`,
which `parallelize` and the trainer ask too; this module only says what the planner knows of a
layout (`layout_spec`).
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from dataclasses import dataclass, field

from paratrain.errors import Violation
from paratrain.models.configs import ModelConfig
from paratrain.parallel import rules
from paratrain.parallel.pipeline.schedules import DEFAULT_SCHEDULE, ScheduleName
from paratrain.parallel.rules import ZERO_STAGES, LayoutSpec
from paratrain.plan.collectives import comm_bytes_per_rank
from paratrain.plan.lora import lora_violation
from paratrain.plan.compute import Hardware, StepFlops, StepTime, step_flops, step_time
from paratrain.plan.memory import (
    GB,
    Layout,
    LayoutError,
    MemoryBreakdown,
    Recompute,
    Workload,
    estimate_memory,
)

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8, 16)
# The search tries context parallelism only where each rank keeps at least this many tokens of a
# sequence: Llama 3 405B trained its 131,072-token stage at cp 16, 8192 tokens per rank (Dubey et al. 2024, §3.3.2).
CP_MIN_TOKENS_PER_RANK = 8192


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_spec(workload: Workload, layout: Layout, world_size: int | None = None,
                gpus_per_node: int | None = None) -> LayoutSpec:
    """What the rules read of a planned layout: its degrees and options, the workload's model and batch.

    A workload without a global batch runs one micro-batch per data rank (`Layout.num_microbatches`).
    """
    return LayoutSpec(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, dp_shard=layout.dp_shard,
                      zero=layout.zero, sequence_parallel=layout.sequence_parallel, schedule=layout.schedule,
                      virtual_stages=layout.virtual_stages, world_size=world_size, gpus_per_node=gpus_per_node,
                      model=workload.model, params_only=workload.model is None,
                      global_batch=workload.global_batch or layout.dp * layout.micro_batch,
                      micro_batch=layout.micro_batch, seq_len=workload.seq_len,
                      activation_checkpointing=layout.recompute.value, ep=layout.ep)


def layout_violations(workload: Workload, layout: Layout, world_size: int | None = None,
                      gpus_per_node: int | None = None) -> list[Violation]:
    """Every rule `layout` breaks for `workload` (empty when it can run), LoRA's strategies among them (`plan.lora`).
    Memory is not checked here."""
    broken = rules.layout_violations(layout_spec(workload, layout, world_size, gpus_per_node))
    refused = lora_violation(workload, layout)
    return broken + ([Violation("lora", refused)] if refused else [])


def validate_layout(world_size: int, dp: int, tp: int, pp: int, model_cfg: ModelConfig | None,
                    global_batch: int | None, micro_batch: int, *, zero: int = 0, sequence_parallel: bool = False,
                    seq_len: int | None = None, schedule: str = DEFAULT_SCHEDULE, virtual_stages: int = 1,
                    dp_shard: int = 0) -> None:
    """Raise `LayoutError` (a ValueError) if the layout cannot run `model_cfg` on `world_size` ranks.

    The rules are `paratrain.parallel.rules.layout_violations`: dp × tp × pp = world size; tp
    divides the heads, the kv heads, the ffn width and the vocabulary (Megatron partitioning); pp
    divides the layers; dp × micro-batch divides the global batch; a --dp-shard that divides dp
    (hybrid sharding, ZeRO only), ZeRO-3 with pp, sequence parallelism and the schedule's rules.
    The one-line message names the first broken rule, and for the degrees the nearest valid
    layouts. `model_cfg` None: the rules that need its shape wait.
    """
    for name, value in (("world_size", world_size), ("dp", dp), ("tp", tp), ("pp", pp), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")
    # The arguments are the rules' own fields: nothing to convert.
    rules.check_layout(LayoutSpec(dp=dp, tp=tp, pp=pp, dp_shard=dp_shard, zero=zero,
                                  sequence_parallel=sequence_parallel, schedule=schedule,
                                  virtual_stages=virtual_stages, world_size=world_size, model=model_cfg,
                                  global_batch=global_batch, micro_batch=micro_batch, seq_len=seq_len), LayoutError)


def memory_reason(total: float, limit: float) -> str:
    """Why a layout needing `total` bytes per rank does not fit in `limit`."""
    return f"needs {total / GB:.1f} GB > {limit / GB:g} GB"


@dataclass(frozen=True)
class Estimate:
    """Everything the planner says about one layout."""

    workload: Workload
    layout: Layout
    memory: MemoryBreakdown
    flops: StepFlops
    time: StepTime
    comm_bytes: dict[str, int]
    memory_limit: float | None = None

    @property
    def feasible(self) -> bool:
        return self.memory_limit is None or self.memory.total <= self.memory_limit

    @property
    def reason(self) -> str | None:
        if self.feasible:
            return None
        return memory_reason(self.memory.total, self.memory_limit)

    def mfu(self, hardware: Hardware) -> float:
        """Model FLOPs utilization: model FLOPs / (step time × ranks × peak)."""
        peak = hardware.peak(self.workload.precision) * self.layout.world_size
        return self.flops.model / (self.time.total * peak)

    def to_dict(self, hardware: Hardware) -> dict:
        lay = self.layout
        batch = self.workload.global_batch or lay.dp * lay.micro_batch
        return {
            "dp": lay.dp, "dp_shard": lay.shard_ranks, "cp": lay.cp, "ep": lay.ep, "tp": lay.tp, "pp": lay.pp,
            "zero": lay.zero,
            "micro_batch": lay.micro_batch,
            "num_microbatches": lay.num_microbatches(self.workload.global_batch),
            "virtual_stages": lay.chunks, "sequence_parallel": lay.sequence_parallel,
            "recompute": lay.recompute.value, "schedule": lay.schedule.value, "compile": lay.compile,
            "memory_per_rank": self.memory.as_dict(),
            "step_time_s": self.time.total,
            "breakdown": self.time.as_dict(),
            "comm_bytes_per_rank": dict(self.comm_bytes),
            "flops_per_step": {"model": self.flops.model, "hardware": self.flops.hardware},
            "mfu": self.mfu(hardware),
            "tokens_per_s": batch * self.workload.seq_len / self.time.total,
            "feasible": self.feasible, "reason": self.reason,
        }


def estimate(workload: Workload, layout: Layout, hardware: Hardware, memory_limit: float | None = None,
             memory: MemoryBreakdown | None = None) -> Estimate:
    """Memory, FLOPs, step time and communication of one layout (rules are not checked here).

    `memory`: `estimate_memory`'s answer, from a caller that has it already.
    """
    return Estimate(workload=workload, layout=layout, memory=memory or estimate_memory(workload, layout),
                    flops=step_flops(workload, layout), time=step_time(workload, layout, hardware),
                    comm_bytes=comm_bytes_per_rank(workload, layout), memory_limit=memory_limit)


@dataclass
class SearchResult:
    """Feasible estimates ranked by step time, and the infeasible candidates grouped by rule."""

    ranked: list[Estimate]
    failures: dict[str, list[tuple[Layout, str]]] = field(default_factory=dict)
    searched: int = 0
    num_feasible: int = 0

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    @property
    def num_infeasible(self) -> int:
        return sum(len(items) for items in self.failures.values())

    def failure_summary(self) -> list[dict]:
        """One entry per rule, most frequent first: count, a one-line summary, an example layout.

        Reasons that differ in one number are collapsed ("tp 16/32/64 exceeds 8 GPUs per
        node"); out-of-memory failures are sorted by the memory they need, so the summary
        gives the closest miss and the worst.
        """
        out = []
        for rule, items in sorted(self.failures.items(), key=lambda kv: -len(kv[1])):
            reasons = list(dict.fromkeys(message for _, message in items))
            if rule == "memory" and len(reasons) > 1:
                summary = f"{reasons[0]} (closest) … {reasons[-1]} (worst)"
            else:
                summary = _collapse(reasons)
            out.append({"rule": rule, "count": len(items), "summary": summary, "reasons": reasons[:10],
                        "example": items[0][0].label()})
        return out


def _collapse(reasons: list[str]) -> str:
    """Join reasons; when they differ only in one number, write that number as a/b/c."""
    if len(reasons) == 1:
        return reasons[0]
    parts = [re.split(r"(\d+)", reason) for reason in reasons]  # numbers at the odd indices
    if len({len(p) for p in parts}) != 1:
        return "; ".join(reasons)
    varying = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
    if len(varying) != 1 or varying[0] % 2 == 0:
        return "; ".join(reasons)
    i = varying[0]
    values = sorted({p[i] for p in parts}, key=int)
    return "".join(parts[0][:i]) + "/".join(values) + "".join(parts[0][i + 1:])


@dataclass(frozen=True)
class SearchSpace:
    """Which values each layout field may take (None: every sensible value).

    dp_shard None: with ZeRO, every shard group size that divides dp (hybrid sharding), the whole
    data axis included; a number fixes it (a candidate whose dp it equals is not split).
    cp None: 1, and for a long sequence every degree that leaves each rank at least
    `CP_MIN_TOKENS_PER_RANK` of its tokens (`_context_degrees`); a number fixes it.
    ep None: for a MoE model every expert-parallel degree that divides both dp and the experts
    (1 for a dense model); a number fixes it.
    """

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    zero: tuple[int, ...] = ZERO_STAGES
    micro_batch: tuple[int, ...] = DEFAULT_MICRO_BATCHES
    recompute: tuple[Recompute, ...] = tuple(Recompute)
    sequence_parallel: tuple[bool, ...] = (False, True)
    schedule: ScheduleName = DEFAULT_SCHEDULE
    virtual_stages: int = 1
    dp_shard: int | None = None
    compile: bool = False  # the run's own setting, not searched: every candidate runs compiled or eager
    ep: int | None = None
    offload: str | None = None  # the same: every candidate offloads its optimizer or none does


def _shard_groups(dp: int, zero: int, space: SearchSpace) -> list[int]:
    """The `Layout.dp_shard` values to try: 0 (the whole data axis), and with ZeRO every smaller divisor of dp.

    A fixed --dp-shard is tried as given (the rules refuse it where it cannot run), written 0
    where it is the whole data axis, so the same layout is not enumerated twice.
    """
    if space.dp_shard is not None:
        return [0 if space.dp_shard == dp else space.dp_shard]
    if zero == 0:  # DDP shards nothing: no shard groups to replicate
        return [0]
    return [0] + [d for d in _divisors(dp) if d < dp]


def _context_degrees(ranks: int, seq_len: int, space: SearchSpace) -> list[int]:
    """The cp degrees to try on `ranks` ranks: the fixed one, else 1 and each divisor whose ranks keep at
    least `CP_MIN_TOKENS_PER_RANK` tokens of a sequence (context parallelism answers long sequences)."""
    if space.cp is not None:
        return [space.cp]
    return [c for c in _divisors(ranks) if c == 1 or seq_len // c >= CP_MIN_TOKENS_PER_RANK]


def _expert_degrees(dp: int, experts: int, space: SearchSpace) -> list[int]:
    """The `Layout.ep` values to try: a fixed --ep as given (the rules refuse what cannot run); for a MoE
    model of `experts` experts every divisor of dp that divides them too; 1 for a dense model."""
    if space.ep is not None:
        return [space.ep]
    return [d for d in _divisors(dp) if experts % d == 0] if experts else [1]


def _candidates(world_size: int, space: SearchSpace, seq_len: int = 0, experts: int = 0):
    """Every layout of the space over `world_size` ranks, skipping exact duplicates.

    ZeRO > 0 with one data rank (dp × cp = 1) shards nothing (the same layout as zero 0) and
    sequence parallelism is a tp > 1 option, so those are not enumerated. ZeRO ≥ 1 layouts come
    with every shard group of hybrid sharding (`_shard_groups`), a MoE model's (`experts` > 0) with
    every expert-parallel degree (`_expert_degrees`).
    """
    for tp in [space.tp] if space.tp else _divisors(world_size):
        for pp in [space.pp] if space.pp else _divisors(max(1, world_size // tp)):
            for cp in _context_degrees(max(1, world_size // (tp * pp)), seq_len, space):
                yield from _options(space, space.dp or max(1, world_size // (tp * pp * cp)), tp, pp, cp, experts)


def _options(space: SearchSpace, dp: int, tp: int, pp: int, cp: int, experts: int = 0):
    """The layouts of the space with these degrees: every ZeRO stage, micro-batch, recomputation, SP, shard
    group and expert-parallel degree."""
    v = space.virtual_stages if space.schedule is ScheduleName.INTERLEAVED and pp > 1 else 1
    choices = itertools.product(space.zero, space.micro_batch, space.recompute, space.sequence_parallel)
    for zero, mb, recompute, sp in choices:
        if (zero > 0 and dp * cp == 1 and 0 in space.zero) or (sp and tp == 1 and False in space.sequence_parallel):
            continue
        for shard, ep in itertools.product(_shard_groups(dp, zero, space), _expert_degrees(dp, experts, space)):
            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=shard, micro_batch=mb,
                         sequence_parallel=sp, recompute=recompute, schedule=space.schedule,
                         virtual_stages=v, compile=space.compile, ep=ep, offload=space.offload)


def search(workload: Workload, world_size: int, hardware: Hardware, space: SearchSpace = SearchSpace(),
           top: int | None = None) -> SearchResult:
    """Rank every valid layout of `world_size` ranks that fits in `hardware.memory_bytes` by step time.

    Rules are checked first (cheap, and shared by every micro-batch and ZeRO choice), then
    memory; time is estimated only for layouts that pass both (most of a large model's
    candidates do not fit, and the time model is the expensive part).
    """
    result = SearchResult(ranked=[])
    failures: dict[str, list[tuple[Layout, str]]] = defaultdict(list)
    too_big: list[tuple[float, Layout, str]] = []
    experts = workload.model.n_experts if workload.model is not None else 0
    for layout in _candidates(world_size, space, workload.seq_len, experts):
        result.searched += 1
        broken = layout_violations(workload, layout, world_size, hardware.gpus_per_node)
        if broken:
            failures[broken[0].rule].append((layout, broken[0].message))
            continue
        memory = estimate_memory(workload, layout)
        if memory.total > hardware.memory_bytes:
            too_big.append((memory.total, layout, memory_reason(memory.total, hardware.memory_bytes)))
            continue
        result.ranked.append(estimate(workload, layout, hardware, hardware.memory_bytes, memory))
    result.ranked.sort(key=lambda e: (e.time.total, e.memory.total))
    result.num_feasible = len(result.ranked)
    if top is not None:
        result.ranked = result.ranked[:top]
    too_big.sort(key=lambda item: item[0])
    failures["memory"] = [(layout, reason) for _, layout, reason in too_big]
    result.failures = {rule: items for rule, items in failures.items() if items}
    return result
