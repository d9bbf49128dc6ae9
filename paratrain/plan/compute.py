"""FLOPs, communication volume and step time of a layout, under a simple cost model.

FLOPs (PaLM, Chowdhery et al. 2022, app. B; `ModelConfig.flops_per_token`): a training
step costs 6·N·T + 12·L·h·s·T for N matmul parameters and T tokens. Model FLOPs count that
only; hardware FLOPs add what recomputation runs again: full recompute the forward of every
block (2·N_blocks + 4·L·h·s per token), selective the attention core's forward (4·L·h·s).

Communication is counted as paratrain's comm layer counts it (`paratrain.comm`): bytes one
rank sends under a bandwidth-optimal ring, an all-reduce of S bytes over n ranks 2·S·(n−1)/n,
an all-gather or reduce-scatter (S the full tensor) S·(n−1)/n, a point-to-point send S.

Time is α-β (Hockney; ring collectives as in Thakur et al. 2005): a collective of n ranks
takes (steps × α) + bytes sent / β, with 2(n−1) steps for an all-reduce, n−1 for an
all-gather or reduce-scatter, 1 for a send. β is the intra-node bandwidth when the group fits
in one node (ranks are laid out pp × dp × tp, tp innermost), the inter-node one otherwise.
Compute runs at peak × efficiency (default 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratrain.plan.memory import (
    ADAM_MOMENT_BYTES,
    MASTER_BYTES,
    Layout,
    PlanError,
    Recompute,
    Workload,
    block_param_count,
    layers_on_stage,
    stage_param_count,
)
from paratrain.parallel.schedules import ScheduleName


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the links between them.

    Fields:
        name: preset name or "custom".
        memory_bytes: device memory (GB = 10⁹ bytes).
        peak_bf16, peak_fp16, peak_fp32: dense peak FLOP/s (fp32 means TF32 tensor cores).
        hbm_bytes_per_s: memory bandwidth (the optimizer step is memory-bound).
        intra_node_bytes_per_s: per-GPU, one-direction bandwidth inside a node (NVLink).
        inter_node_bytes_per_s: per-GPU, one-direction bandwidth between nodes (InfiniBand).
        gpus_per_node: GPUs sharing the intra-node links.
        intra_node_latency_s, inter_node_latency_s: α of one ring step.
        efficiency: achievable fraction of peak for the model's matmuls.
    """

    name: str
    memory_bytes: float
    peak_bf16: float
    peak_fp16: float
    peak_fp32: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int = 8
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    efficiency: float = 0.5

    def __post_init__(self):
        for name in ("memory_bytes", "peak_bf16", "peak_fp16", "peak_fp32", "hbm_bytes_per_s",
                     "intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise PlanError(f"hardware {name}={getattr(self, name)!r} must be positive")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise PlanError(f"--gpus-per-node must be a positive integer, got {self.gpus_per_node!r}")
        if not 0 < self.efficiency <= 1:
            raise PlanError(f"--efficiency {self.efficiency!r} must be in (0, 1]")

    def peak(self, precision: str) -> float:
        return {"bf16": self.peak_bf16, "fp16": self.peak_fp16, "fp32": self.peak_fp32}[precision]


# Vendor datasheets, dense (no sparsity). NVLink: A100 600 GB/s, H100/H200 900 GB/s total,
# half each way. InfiniBand: one HDR 200 Gb/s (A100) or NDR 400 Gb/s (H100/H200) NIC per GPU.
HARDWARE_PRESETS: dict[str, Hardware] = {
    "a100-40gb": Hardware("a100-40gb", 40e9, 312e12, 312e12, 156e12, 1.555e12, 300e9, 25e9),
    "a100-80gb": Hardware("a100-80gb", 80e9, 312e12, 312e12, 156e12, 2.039e12, 300e9, 25e9),
    "h100-80gb": Hardware("h100-80gb", 80e9, 989e12, 989e12, 495e12, 3.35e12, 450e9, 50e9),
    "h200": Hardware("h200", 141e9, 989e12, 989e12, 495e12, 4.8e12, 450e9, 50e9),
}


def get_hardware(name: str, **overrides) -> Hardware:
    """A preset, with any field replaced (None values are ignored)."""
    if name not in HARDWARE_PRESETS:
        raise PlanError(f"unknown hardware {name!r}; choose one of: {', '.join(HARDWARE_PRESETS)}")
    changes = {key: value for key, value in overrides.items() if value is not None}
    return replace(HARDWARE_PRESETS[name], **changes) if changes else HARDWARE_PRESETS[name]


# -- communication --------------------------------------------------------------------------

_RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}
_RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


@dataclass(frozen=True)
class Collective:
    """`count` calls of one collective over `ranks` ranks; `size` is the full tensor's bytes."""

    kind: str  # all_reduce, all_gather, reduce_scatter or send
    size: float
    ranks: int
    count: float = 1.0

    @property
    def bytes_sent(self) -> float:
        """Bytes one rank sends, as paratrain.comm counts them."""
        if self.kind == "send":
            return self.size * self.count
        return ring_bytes(self.kind, self.size, self.ranks) * self.count

    def seconds(self, bandwidth: float, latency: float) -> float:
        if self.ranks == 1 or self.count == 0:
            return 0.0
        steps = 1 if self.kind == "send" else _RING_STEPS[self.kind] * (self.ranks - 1)
        return self.count * steps * latency + self.bytes_sent / bandwidth


def ring_bytes(kind: str, size: float, ranks: int) -> float:
    """Bytes one rank sends in a ring: all-reduce 2·S·(n−1)/n, all-gather/reduce-scatter S·(n−1)/n."""
    if ranks == 1:
        return 0.0
    return _RING_FACTOR[kind] * size * (ranks - 1) / ranks


def axis_is_intra_node(layout: Layout, axis: str, gpus_per_node: int) -> bool:
    """Whether every group of `axis` sits inside one node (layout pp × dp × tp, tp innermost)."""
    span = {"tp": layout.tp, "dp": layout.tp * layout.dp, "pp": layout.world_size}[axis]
    return span <= gpus_per_node and gpus_per_node % span == 0


def _link(hardware: Hardware, layout: Layout, axis: str) -> tuple[float, float]:
    if axis_is_intra_node(layout, axis, hardware.gpus_per_node):
        return hardware.intra_node_bytes_per_s, hardware.intra_node_latency_s
    return hardware.inter_node_bytes_per_s, hardware.inter_node_latency_s


def stage_psi(workload: Workload, layout: Layout, stage: int) -> float:
    """Parameters one rank of `stage` holds before ZeRO sharding (Ψ of the ZeRO formulas)."""
    if workload.model is None:
        return workload.num_params / (layout.tp * layout.pp)
    return float(stage_param_count(workload.model, layout.tp, layout.pp, stage))


def dp_collectives(workload: Workload, layout: Layout, stage: int) -> tuple[list[Collective], list[Collective]]:
    """Data-parallel collectives of one step: (overlapping backward/compute, after the optimizer step).

    DDP: one all-reduce of the gradients (2Ψ(N−1)/N in the gradient dtype). ZeRO-1/2: a
    reduce-scatter of the gradients during backward and an all-gather of the updated
    parameters after the step (Ψ(N−1)/N each), as paratrain.parallel.data does. DDP and ZeRO-1
    accumulate gradients locally over micro-batches and communicate once per step; ZeRO-2 keeps
    no full gradient, so it reduce-scatters after every micro-batch's backward. ZeRO-3: for every
    micro-batch an all-gather of the parameters before forward and again before backward and
    a reduce-scatter of the gradients: 3Ψ(N−1)/N per micro-batch.
    """
    n, psi = layout.dp, stage_psi(workload, layout, stage)
    grads, params = psi * workload.grad_bytes, psi * workload.param_bytes
    if n == 1:
        return [], []
    if layout.zero == 0:
        return [Collective("all_reduce", grads, n)], []
    m = layout.num_microbatches(workload.global_batch)
    if layout.zero in (1, 2):
        reductions = m if layout.zero == 2 else 1
        return [Collective("reduce_scatter", grads, n, reductions)], [Collective("all_gather", params, n)]
    return [Collective("all_gather", params, n, 2 * m), Collective("reduce_scatter", grads, n, m)], []


def tp_collectives(workload: Workload, layout: Layout, stage: int) -> list[Collective]:
    """Tensor-parallel collectives of one micro-batch on `stage` (Shoeybi et al. 2019).

    Each layer: 2 all-reduces of b·s·h in forward (after attention and after the MLP) and 2 in
    backward (their conjugates before them); with sequence parallelism each all-reduce becomes
    an all-gather + a reduce-scatter of the same full tensor (the same bytes). Full
    recomputation runs the forward's 2 again. The vocab-parallel embedding adds one all-reduce
    in forward (a reduce-scatter with SP) on the first stage; the head adds one all-reduce of
    its input gradient in backward (all-gather forward + reduce-scatter backward with SP) on
    the last. The cross-entropy's all-reduces of b·s scalars are left out (≪ b·s·h).
    """
    model, t = workload.model, layout.tp
    if model is None or t == 1:
        return []
    size = float(layout.micro_batch * workload.seq_len * model.dim * workload.param_bytes)
    per_layer = 4 + (2 if layout.recompute is Recompute.FULL else 0)
    layers = layers_on_stage(model.n_layers, layout.pp, stage) * per_layer
    sp = layout.sequence_parallel
    out = ([Collective("all_gather", size, t, layers), Collective("reduce_scatter", size, t, layers)] if sp
           else [Collective("all_reduce", size, t, layers)])
    if stage == 0:
        out.append(Collective("reduce_scatter" if sp else "all_reduce", size, t))
    if stage == layout.pp - 1:
        out += ([Collective("all_gather", size, t), Collective("reduce_scatter", size, t)] if sp
                else [Collective("all_reduce", size, t)])
    if sp and layout.pp > 1:  # a stage boundary carries the whole sequence: gathered forward, its grad backward
        out.append(Collective("all_gather", size, t, _boundary_sends(layout, stage)))
    if layout.pp > 1:  # each boundary tensor received as t slices, all-gathered (as many as it sends)
        out.append(Collective("all_gather", size, t, _boundary_sends(layout, stage)))
    return out


def _boundary_sends(layout: Layout, stage: int) -> int:
    """Stage boundaries pipeline rank `stage` sends across per micro-batch (activations forward + grads back)."""
    p, v = layout.pp, layout.chunks
    chunks = [c * p + stage for c in range(v)]
    return sum(g < v * p - 1 for g in chunks) + sum(g > 0 for g in chunks)


def pp_sends(workload: Workload, layout: Layout, stage: int) -> list[Collective]:
    """Point-to-point sends of one micro-batch by pipeline rank `stage` (Narayanan et al. 2021).

    Each of the rank's v chunks sends its output activation (b·s·h, the whole sequence also under
    SP: paratrain gathers it over tp at the boundary) forward unless it is the model's last
    chunk, and its input gradient backward unless it is the first. Under tensor parallelism each
    tp rank sends 1/t of it, and the receiving stage all-gathers it over tp (`tp_collectives`).
    """
    model, p = workload.model, layout.pp
    if model is None or p == 1:
        return []
    size = float(layout.micro_batch * workload.seq_len * model.dim * workload.param_bytes) / layout.tp
    return [Collective("send", size, 2, _boundary_sends(layout, stage))]


def comm_bytes_per_rank(workload: Workload, layout: Layout) -> dict[str, int]:
    """Bytes one rank sends per step on each axis (the busiest rank of that axis)."""
    m = layout.num_microbatches(workload.global_batch)
    out = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    for stage in range(layout.pp):
        during, after = dp_collectives(workload, layout, stage)
        out["dp"] = max(out["dp"], sum(c.bytes_sent for c in during + after))
        out["tp"] = max(out["tp"], m * sum(c.bytes_sent for c in tp_collectives(workload, layout, stage)))
        out["pp"] = max(out["pp"], m * sum(c.bytes_sent for c in pp_sends(workload, layout, stage)))
    return {axis: int(round(value)) for axis, value in out.items()}


# -- FLOPs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step over all ranks: model (6NT + attention) and hardware (+ recompute)."""

    model: float
    hardware: float


def _recompute_flops_per_token(workload: Workload, recompute: Recompute, layers: int) -> float:
    """Forward FLOPs recomputation repeats, per token, over `layers` blocks."""
    model, s = workload.model, workload.seq_len
    if model is None or recompute is Recompute.NONE:
        return 0.0
    attention_forward = 4.0 * layers * model.dim * s
    if recompute is Recompute.SELECTIVE:
        return attention_forward
    return 2.0 * layers * block_param_count(model) + attention_forward


def step_flops(workload: Workload, layout: Layout) -> StepFlops:
    """Model and hardware FLOPs of one step (tokens = global batch × seq)."""
    batch = workload.global_batch or layout.dp * layout.micro_batch
    tokens = batch * workload.seq_len
    if workload.model is None:
        model_flops = 6.0 * workload.num_params * tokens
    else:
        model_flops = float(workload.model.flops_per_token(workload.seq_len)) * tokens
    n_layers = workload.model.n_layers if workload.model is not None else 0
    extra = _recompute_flops_per_token(workload, layout.recompute, n_layers) * tokens
    return StepFlops(model=model_flops, hardware=model_flops + extra)


def stage_flops_per_microbatch(workload: Workload, layout: Layout, stage: int) -> tuple[float, float]:
    """(forward, backward incl. recomputation) FLOPs of one micro-batch on one rank of `stage`.

    Per token, a block costs 6·P_block + 12·h·s (forward a third, backward two thirds); the
    last stage adds the final norm and the head, 6·(V·h + h); the embedding lookup is free.
    Split evenly over tp.
    """
    model, lay = workload.model, layout
    tokens = lay.micro_batch * workload.seq_len
    if model is None:
        total = 6.0 * workload.num_params / (lay.tp * lay.pp) * tokens
        return total / 3, 2 * total / 3
    layers = layers_on_stage(model.n_layers, lay.pp, stage)
    per_token = layers * (6.0 * block_param_count(model) + 12.0 * model.dim * workload.seq_len)
    if stage == lay.pp - 1:
        per_token += 6.0 * (model.vocab_size * model.dim + model.dim)
    recompute = _recompute_flops_per_token(workload, lay.recompute, layers)
    forward, backward = per_token / 3, 2 * per_token / 3 + recompute
    return forward * tokens / lay.tp, backward * tokens / lay.tp


# -- step time ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the slowest rank, by cause; they add up to `total`.

    compute: m micro-batches of forward + backward (with recomputation) on the slowest stage.
    tp_comm, pp_comm: exposed (on the critical path) tensor-parallel and point-to-point time.
    bubble: pipeline fill and drain, (p − 1)/v per-micro-batch stage times.
    dp_comm: data-parallel time not hidden behind compute (`dp_comm_total` is all of it).
    optimizer: the (memory-bound) optimizer step.
    """

    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    dp_comm_total: float

    @property
    def exposed_comm(self) -> float:
        return self.tp_comm + self.pp_comm + self.dp_comm

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm + self.bubble + self.dp_comm + self.optimizer

    def as_dict(self) -> dict[str, float]:
        keys = ("compute", "exposed_comm", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer",
                "dp_comm_total", "total")
        return {f"{key}_s": getattr(self, key) for key in keys}


def _seconds(collectives: list[Collective], link: tuple[float, float]) -> float:
    return sum(c.seconds(*link) for c in collectives)


def _dp_exposed(workload: Workload, layout: Layout, hardware: Hardware, stage: int,
                backward_mb: float, compute_all: float) -> tuple[float, float]:
    """(exposed, total) data-parallel seconds of `stage`.

    DDP/ZeRO-1/2 reduce the gradients while the last micro-batch's backward runs (earlier
    micro-batches only accumulate): exposed = max(0, comm − that backward); the ZeRO-1/2
    all-gather of updated parameters follows the optimizer step, fully exposed. ZeRO-3's
    gathers and reduce-scatters run under all of the step's compute (prefetching).
    """
    link = _link(hardware, layout, "dp")
    during, after = dp_collectives(workload, layout, stage)
    overlapped, trailing = _seconds(during, link), _seconds(after, link)
    window = compute_all if layout.zero == 3 else backward_mb
    return max(0.0, overlapped - window) + trailing, overlapped + trailing


def _optimizer_seconds(workload: Workload, layout: Layout, hardware: Hardware, stage: int) -> float:
    """Adam reads and writes its state, reads the gradient shard, writes the parameters: bytes / HBM."""
    psi = stage_psi(workload, layout, stage) / (layout.dp if layout.zero >= 1 else 1)
    state = ADAM_MOMENT_BYTES + (MASTER_BYTES if workload.mixed else 0)
    return psi * (2 * state + workload.grad_bytes + workload.param_bytes) / hardware.hbm_bytes_per_s


def step_time(workload: Workload, layout: Layout, hardware: Hardware) -> StepTime:
    """Step time of `layout` under the cost model (slowest pipeline stage, see `StepTime`).

    Per micro-batch, a stage takes compute + its tensor-parallel collectives (exposed:
    they sit between dependent matmuls) + its sends. The pipeline runs m of those on the
    slowest stage plus a bubble of (p − 1)/v of them, i.e. a bubble fraction
    (p − 1)/(m + p − 1) for GPipe and 1F1B, divided by v interleaved (Narayanan et al. 2021).
    ZB-H1 fills two thirds of 1F1B's bubble (forward, input-gradient and weight-gradient passes
    of equal cost; Qi et al. 2023), and paratrain's runtime computes its weight gradients by a
    second backward through the stage, costed here as half a backward more.
    """
    lay = layout
    m = lay.num_microbatches(workload.global_batch)
    flop_rate = hardware.peak(workload.precision) * hardware.efficiency
    tp_link, pp_link = _link(hardware, lay, "tp"), _link(hardware, lay, "pp")
    per_stage = []
    for stage in range(lay.pp):
        forward, backward = stage_flops_per_microbatch(workload, lay, stage)
        if lay.schedule is ScheduleName.ZB_H1 and lay.pp > 1:
            backward *= 1.5
        compute = (forward + backward) / flop_rate
        tp = _seconds(tp_collectives(workload, lay, stage), tp_link)
        pp = _seconds(pp_sends(workload, lay, stage), pp_link)
        dp_exposed, dp_total = _dp_exposed(workload, lay, hardware, stage, backward / flop_rate, m * compute)
        per_stage.append((compute + tp + pp, compute, tp, pp, dp_exposed, dp_total,
                          _optimizer_seconds(workload, lay, hardware, stage)))
    slowest = max(per_stage)
    _, compute, tp, pp = slowest[:4]
    return StepTime(
        compute=m * compute, tp_comm=m * tp, pp_comm=m * pp,
        bubble=(lay.pp - 1) / lay.chunks * slowest[0] / (3 if lay.schedule is ScheduleName.ZB_H1 else 1),
        dp_comm=max(s[4] for s in per_stage), optimizer=max(s[6] for s in per_stage),
        dp_comm_total=max(s[5] for s in per_stage),
    )
