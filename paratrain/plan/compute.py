"""FLOPs and step time of a layout.

FLOPs (PaLM, Chowdhery et al. 2022, app. B; `ModelConfig.flops_per_token`): a training
step costs 6·N·T + 12·L·h·s·T for N matmul parameters and T tokens. Model FLOPs count that
only; hardware FLOPs add what recomputation runs again: full recompute the forward of every
block (2·N_blocks + 4·L·h·s per token), selective the attention core's forward (4·L·h·s).

Communication (which collectives, their bytes and α-β time) is `paratrain.plan.collectives`;
here, how they meet the compute: what overlaps, what is exposed.

Compute is the sum of each operation's time (`paratrain.plan.ops`): matmuls at the size-
dependent efficiency of `Hardware.gemm`, the rest memory-bound; an eager pass takes at least
the host's time to issue it (`paratrain.plan.host`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from paratrain.plan.collectives import (
    Collective,
    collective_seconds,
    dp_collectives,
    ep_collectives,
    pp_sends,
    ring_sends,
    stage_psi,
    sync_collectives,
    tied_table_collectives,
    tp_collectives,
)
from paratrain.plan.hardware import (
    HARDWARE_PRESETS,
    GemmCurve,
    Hardware,
    KernelStack,
    LinkCost,
    get_hardware,
)
from paratrain.plan.memory import (
    PlanError,
    Layout,
    Recompute,
    Workload,
    pipeline_traits,
    stage_expert_params,
)
from paratrain.plan.muon import MUON_HOST_BYTES, NS_STEPS, UPDATE_BYTES, block_matrices, stage_muon_params
from paratrain.plan.model_states import ADAM_MOMENT_BYTES, MASTER_BYTES, block_param_count, layers_on_stage
from paratrain.plan import lora, moe
from paratrain.plan.host import bound_by_host, host_times
from paratrain.plan.ops import PassTimes, Shape, attention_seconds, block_times, embedding_times, head_times

__all__ = ["HARDWARE_PRESETS", "GemmCurve", "Hardware", "LinkCost", "StepFlops", "StepTime", "get_hardware",
           "step_flops", "step_time"]

# B + W of a split backward (zero-bubble) over one whole backward of a stage: each matmul's two
# products are split between them, the graph is walked twice (benchmarks/bench_split_backward.py).
SPLIT_BACKWARD_COST = 1.08


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
    active_block = block_param_count(model) - moe.inactive_params(model) // model.n_layers  # k of E experts
    return 2.0 * layers * active_block + attention_forward


def step_flops(workload: Workload, layout: Layout) -> StepFlops:
    """Model and hardware FLOPs of one step (tokens = global batch × seq)."""
    batch = workload.global_batch or layout.dp * layout.micro_batch
    tokens = batch * workload.seq_len
    if workload.model is None:
        model_flops = 6.0 * workload.num_params * tokens
    elif workload.lora:
        model_flops = lora.flops_per_token(workload) * tokens
    else:
        model_flops = float(workload.model.flops_per_token(workload.seq_len)) * tokens
    n_layers = workload.model.n_layers if workload.model is not None else 0
    extra = _recompute_flops_per_token(workload, layout.recompute, n_layers) * tokens
    if workload.model is not None and workload.loss_chunk:  # the fused loss's backward recomputes the logits
        extra += 2.0 * workload.model.dim * workload.model.vocab_size * tokens
    return StepFlops(model=model_flops, hardware=model_flops + extra)


# -- step time ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the slowest rank, by cause; they add up to `total`.

    compute: m micro-batches of forward + backward (with recomputation) on the slowest stage.
    tp_comm, pp_comm: exposed (on the critical path) tensor-parallel and point-to-point time.
    cp_comm: the ring attention's K/V traffic not hidden behind its blocks' compute (`_ring_exposed`).
    bubble: pipeline fill and drain, (p − 1)/v per-micro-batch stage times.
    dp_comm: data-parallel time not hidden behind compute (`dp_comm_total` is all of it).
    optimizer: the (memory-bound) optimizer step, with gradient clipping, and the other passes over
        the parameters (`per_microbatch_bytes_per_param`).
    sync: the step's small agreement collectives (flags, loss, the global gradient norm), and under pp the sum of a
        tied head's two table gradients (`tied_table_collectives`).
    dp_comm_by_axis: `dp_comm` split over the data axes (`Layout.data_axes`, and with ep > 1 the
        experts' replica axis), summing to it: what `paratrain report` sets beside the runtime's
        exposed time per axis.
    ep_comm: a MoE model's expert-parallel all-to-alls (`paratrain.plan.moe`): exposed, each sits
        between the router and the experts or the experts and the combine.
    """

    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    dp_comm_total: float
    sync: float = 0.0
    dp_comm_by_axis: Mapping[str, float] = field(default_factory=dict)
    cp_comm: float = 0.0
    ep_comm: float = 0.0

    @property
    def exposed_comm(self) -> float:
        return self.tp_comm + self.pp_comm + self.cp_comm + self.dp_comm + self.sync + self.ep_comm

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.optimizer

    def as_dict(self) -> dict[str, float]:
        """Seconds per part; a hybrid-sharded layout adds its data axes' parts (dp_shard_comm_s, ...)."""
        keys = ("compute", "exposed_comm", "tp_comm", "pp_comm", "cp_comm", "dp_comm", "bubble", "optimizer", "sync",
                "dp_comm_total", "total")
        out = {f"{key}_s": getattr(self, key) for key in keys}
        if self.ep_comm:
            out["ep_comm_s"] = self.ep_comm
        out.update({f"{axis}_comm_s": seconds for axis, seconds in self.dp_comm_by_axis.items()})
        return out


def _block(workload: Workload, layout: Layout, hardware: Hardware) -> tuple[Shape, PassTimes] | None:
    """One micro-batch's shape on a rank and one block's pass times: the same on every stage (None: no model)."""
    if workload.model is None:
        return None
    x = Shape.of(workload.model, layout.micro_batch, workload.seq_len, layout.tp, layout.sequence_parallel,
                 workload.precision, workload.flash_attention, kernel_stack(layout), layout.cp, layout.ep,
                 workload.moe_imbalance, workload.fp8, workload.fp8_min_features)
    if workload.lora:
        x = dataclasses.replace(x, lora=workload.lora, nf4=workload.base_dtype == "nf4")
    if workload.fp8 and not hardware.peak_fp8:
        raise PlanError(f"--fp8 {workload.fp8}: hardware {hardware.name!r} has no FP8 matmuls (peak_fp8 0: an A100, a "
                        f"CPU, a profile that did not measure them); plan it on h100-80gb or h200")
    return x, block_times(hardware, x, layout.recompute)


def stage_pass_times(workload: Workload, layout: Layout, hardware: Hardware, stage: int,
                     block: tuple[Shape, PassTimes] | None = None) -> PassTimes:
    """Forward and backward (with recomputation) of one micro-batch on one rank of `stage`.

    Each pass of an eager step takes at least its host's time (`paratrain.plan.host`). With only a
    parameter count, 6·N·T/(tp·pp) FLOPs at the plateau of the matmul curve. A CPU
    profile with more ranks than cores gives each rank cores/ranks of a core. `block`: `_block`'s
    answer, from a caller that times every stage (the search times thousands of layouts).
    """
    model, lay = workload.model, layout
    if model is None:
        tokens = lay.micro_batch * workload.seq_len
        flops = 6.0 * workload.num_params / (lay.tp * lay.pp) * tokens
        rate = hardware.peak(workload.precision) * hardware.gemm(workload.precision).peak_efficiency
        times = PassTimes(flops / 3 / rate, 2 * flops / 3 / rate)
    else:
        x, one_block = block or _block(workload, lay, hardware)
        layers, first, last = layers_on_stage(model.n_layers, lay.pp, stage), stage == 0, stage == lay.pp - 1
        times = one_block.scaled(layers)
        if first:
            times += embedding_times(hardware, x)
        if last:
            times += head_times(hardware, x, vocab_parallel=lay.tp > 1, fused=workload.loss_chunk > 0)
        host = host_times(hardware, x, layers, lay.recompute, lay.zero == 3, first, last)
        times = bound_by_host(times, host, hardware, x.kernels)
    m = lay.num_microbatches(workload.global_batch)
    if pipeline_traits(lay.schedule, lay.pp, m, lay.chunks).split_backward:
        # B and W split one backward's products between them; walking the graph twice costs a little more
        times = PassTimes(times.forward, times.backward * SPLIT_BACKWARD_COST)
    return times.scaled(1 / hardware.compute_share(lay.world_size))


def kernel_stack(layout: Layout) -> KernelStack:
    """The run's element-wise kernels: fused by `torch.compile` (`Layout.compile`), else one per operator."""
    return KernelStack.FUSED if layout.compile else KernelStack.EAGER


def optimizer_bytes_per_param(workload: Workload) -> float:
    """Bytes paratrain's step moves per parameter shard element after the backward (the trainer's fused AdamW).

    Clipping reads the gradient for the global norm (the non-finite check rides on it) and scales
    it in place; the fused Adam reads the gradient and reads and writes the fp32 master (mixed
    precision) and the two moments; mixed precision then refreshes the 16-bit compute copy from
    the master (read, write); the gradients are zeroed for the next step.
    """
    grad = MASTER_BYTES if workload.mixed else workload.grad_bytes  # the fp32 gradient the optimizer reads
    clip = 3 * grad  # the norm's read, the scaling's read and write
    adam = grad + 2 * (ADAM_MOMENT_BYTES + MASTER_BYTES)  # the parameter itself is the master in fp32
    copy = MASTER_BYTES + workload.param_bytes if workload.mixed else 0
    return clip + adam + copy + grad  # the last: zeroing


def per_microbatch_bytes_per_param(workload: Workload, layout: Layout, m: int) -> float:
    """Bytes per parameter element that the step's micro-batches move outside their kernels' activations.

    Accumulating the gradient over m micro-batches reads the sum and the new gradient and writes
    the sum, m − 1 times; ZeRO-3 copies each unit's shard into its gathered buffer before forward
    and before backward and its gradient out of one, every micro-batch (with one rank too: the
    collective's input and output are distinct buffers).
    """
    grad = workload.grad_bytes
    accumulate = (m - 1) * 3 * grad if layout.zero < 2 else 0.0  # ZeRO-2/3 reduce every micro-batch
    gathers = m * (2 * 2 * workload.param_bytes + 2 * grad) if layout.zero == 3 else 0.0
    return accumulate + gathers


def _optimizer_seconds(workload: Workload, layout: Layout, hardware: Hardware, stage: int, m: int,
                       forward: float = 0.0) -> float:
    """The step's memory-bound passes over the parameters: the optimizer on this rank's shard (offloaded: its
    copies and the host's step, `offload_seconds`), and the micro-batches' gradient accumulation and ZeRO-3
    copies over the stage's parameters."""
    shards = layout.shard_ranks if layout.zero >= 1 else 1  # each rank steps its own shard
    expert_shards = moe.expert_shard_ranks(layout.shard_ranks, layout.ep) if layout.zero >= 1 else 1
    psi = stage_psi(workload, layout, stage)
    tensor = 4.0 * (block_param_count(workload.model) / 7 if workload.model is not None else psi)
    tensor /= layout.tp * shards
    experts = stage_expert_params(workload, layout, stage)
    elements = (psi - experts) / shards + experts / expert_shards
    local = psi * per_microbatch_bytes_per_param(workload, layout, m)
    seconds = hardware.memory_seconds(local, 3 * tensor)
    if layout.offload:  # on the device: the norm's read and the zeroing of the gradients
        seconds += hardware.memory_seconds(elements * 2 * workload.grad_bytes, 3 * tensor)
        # Groups: the stage's blocks and the units beside them (embedding; final norm and head). The next forward
        # waits unit by unit without pipeline parallelism; a pipeline stage waits for all of it (`host_step.py`);
        # on a CPU profile the host step and the forward share the cores: nothing overlaps. Muon steps all of it
        # at once in the caller's thread (`paratrain.parallel.muon`): one group, no overlap.
        layers = layers_on_stage(workload.model.n_layers, layout.pp, stage) if workload.model is not None else 1
        muon = stage_muon_params(workload, layout, stage, experts)
        muon = (muon - experts) / shards + experts / expert_shards if muon else 0.0
        overlaps = layout.pp == 1 and hardware.host_cores is None and not muon
        seconds += offload_seconds(hardware, elements, min(layout.world_size, hardware.gpus_per_node),
                                   1 if muon else layers + 3, forward if overlaps else 0.0,
                                   0 if layout.offload == "params" else 2, muon)
    if layout.offload == "params":  # each gather, forward and backward, copies the fp32 shard from the host; the
        seconds += hardware.copy_seconds((2 * m + 1) * MASTER_BYTES * elements)  # gradients go at backward's end
    else:
        seconds += hardware.memory_seconds(elements * optimizer_bytes_per_param(workload), 3 * tensor)
    seconds += newton_schulz_seconds(workload, layout, hardware, stage)
    return seconds / hardware.compute_share(layout.world_size)


def newton_schulz_seconds(workload: Workload, layout: Layout, hardware: Hardware, stage: int) -> float:
    """Muon's Newton–Schulz iterations on one rank of `stage` (0 with AdamW): the stage's matrices' bf16 matmuls
    (`paratrain.plan.muon`), spread over the data × tp ranks that share them; each expert's matrix over the ranks
    of its block."""
    if workload.optimizer != "muon":
        return 0.0
    model = workload.model
    layers = layers_on_stage(model.n_layers, layout.pp, stage)
    seconds = 0.0
    for rows, cols, count in block_matrices(model):
        m, n = sorted((rows, cols))
        one = NS_STEPS * (hardware.gemm_seconds(m, m, n, "bf16") + hardware.gemm_seconds(m, m, m, "bf16")
                          + hardware.gemm_seconds(m, n, m, "bf16"))
        seconds += layers * count * one
    return seconds / (layout.data_ranks * layout.tp)


def offload_seconds(hardware: Hardware, elements: float, ranks_per_node: int, groups: int = 1,
                    forward: float = 0.0, copies: int = 2, muon: float = 0.0) -> float:
    """Exposed seconds of the offloaded step of `elements` master elements on one rank
    (`paratrain.parallel.data.host_step`): `copies` fp32 copies over the host link (the gradients out and the
    values back; none where the masters live on the host, offload="params") and the host's fused AdamW (28 bytes each: the gradient read, the master
    and the two moments read and written).

    The three run as a pipeline over `groups` groups of the masters (the model's units): each group's copy out,
    its step, its copy back, the next group's beside them, so the slowest stage's whole time plus the other
    stages' share of one group. The next forward waits for each unit's group where the unit begins: of the
    `forward` seconds of its first micro-batch, all but the first unit's run beside the host step, which then
    shows only where it outlasts them, and at least one group's pass through the pipeline (`forward` 0: no
    overlap, a layout whose forward waits for the whole step).

    `muon` of the elements are Muon's (`paratrain.parallel.muon`): their host step is the momentum and the
    update's application (`MUON_HOST_BYTES` each, not AdamW's 28), and their bf16 update crosses the host link
    both ways for the device's Newton–Schulz iteration (priced by `newton_schulz_seconds`)."""
    host = MASTER_BYTES + 2 * (ADAM_MOMENT_BYTES + MASTER_BYTES)
    copy = hardware.copy_seconds(MASTER_BYTES * elements)
    stages = [hardware.host_seconds(host * (elements - muon) + MUON_HOST_BYTES * muon, ranks_per_node)]
    stages += [copy] * copies + ([hardware.copy_seconds(UPDATE_BYTES * muon)] * 2 if muon else [])
    pipelined = max(stages) + (sum(stages) - max(stages)) / groups
    if not forward:
        return pipelined
    return max(pipelined - forward * (groups - 1) / groups, sum(stages) / groups)


def _dp_exposed(workload: Workload, layout: Layout, hardware: Hardware, stage: int,
                backward_mb: float, compute_all: float) -> tuple[dict[str, float], float]:
    """(exposed seconds per data axis, total seconds) of `stage`.

    DDP/ZeRO-1/2 reduce the gradients bucket by bucket while the last micro-batch's backward
    runs (earlier micro-batches only accumulate); the last bucket fills at the end of that
    backward, so its collective cannot hide. ZeRO-1/2's all-gather of updated parameters
    follows the optimizer step, fully exposed. ZeRO-3's gathers and reduce-scatters run under
    all of the step's compute (prefetching), except the first unit's gather and the last
    unit's reduce-scatter. Only `comm_overlap` of the overlappable time is hidden. Hybrid
    sharding's all-reduces between replicas hide the same way, but for the last one, which
    follows the last reduce-scatter. Each axis is timed over the links its groups span
    (`collective_seconds`), and the axes hide side by side: their collectives run on
    different links at once.
    """
    window = compute_all if layout.zero == 3 else backward_mb
    exposed, total = {}, 0.0
    for axis, collectives in dp_collectives(workload, layout, stage).items():
        overlapped = collective_seconds(hardware, layout, axis, list(collectives.overlapped))
        serial = collective_seconds(hardware, layout, axis, list(collectives.after))
        one = [Collective(c.kind, c.size, c.ranks) for c in collectives.overlapped]  # a bucket, or a unit
        unhideable = collective_seconds(hardware, layout, axis, one[:1] if layout.zero != 3 else one)
        hidden = hardware.comm_overlap * min(max(0.0, overlapped - unhideable), window)
        exposed[axis] = overlapped - hidden + serial
        total += overlapped + serial
    return exposed, total


def _hidden_steps(hardware: Hardware, layout: Layout, sends: list[Collective], compute: float, steps: int) -> float:
    """Exposed seconds of `steps` ring steps that each send `sends` while computing `compute` seconds:
    per step, the send's time less the part of it that `comm_overlap` hides behind the compute."""
    if steps == 0:
        return 0.0
    comm = collective_seconds(hardware, layout, "cp", [Collective(c.kind, c.size, c.ranks) for c in sends])
    return steps * (comm - hardware.comm_overlap * min(comm, compute))


def _ring_exposed(workload: Workload, layout: Layout, hardware: Hardware,
                  block: tuple[Shape, PassTimes] | None) -> float:
    """Exposed seconds of one layer's ring attention traffic per micro-batch on one rank (0 without cp).

    The ring has cp steps; at each the rank computes its queries against one K/V block (1/cp of
    its attention core's time, forward or backward) while the next block travels (`RingSends`).
    A step's transfer hides behind its block's compute as the data-parallel collectives do
    (`comm_overlap` of the overlappable time): exposed = comm − overlap·min(comm, compute) per
    step. Forward: cp − 1 steps carry a K/V block. Backward: cp − 1 steps carry a K/V block and
    the dK/dV sum of the step before; the last sum (back to the block's owner) waits alone.
    Full recomputation runs the forward's ring again in backward.
    """
    ring = ring_sends(workload, layout)
    if ring is None or block is None:
        return 0.0
    x = block[0]
    scale = 1 / hardware.compute_share(layout.world_size)
    forward_block = attention_seconds(hardware, x, 2) * scale / layout.cp
    backward_block = attention_seconds(hardware, x, 4, backward=True) * scale / layout.cp
    kv, dkv = ring.forward[0], ring.backward[1]
    forward = _hidden_steps(hardware, layout, [kv], forward_block, layout.cp - 1)
    backward = (_hidden_steps(hardware, layout, [kv, dkv], backward_block, layout.cp - 1)
                + _hidden_steps(hardware, layout, [dkv], 0.0, 1))
    return forward * (2 if layout.recompute is Recompute.FULL else 1) + backward


@dataclass(frozen=True)
class _Stage:
    per_mb: float
    compute: float
    tp: float
    pp: float
    dp_exposed: dict[str, float]
    dp_total: float
    optimizer: float
    cp: float = 0.0
    ep: float = 0.0


def _stage(workload: Workload, layout: Layout, hardware: Hardware, stage: int, m: int,
           block: tuple[Shape, PassTimes] | None) -> _Stage:
    passes = stage_pass_times(workload, layout, hardware, stage, block)
    compute = passes.forward + passes.backward
    tp = collective_seconds(hardware, layout, "tp", tp_collectives(workload, layout, stage))
    pp = collective_seconds(hardware, layout, "pp", pp_sends(workload, layout, stage))
    cp = 0.0
    if layout.cp > 1:
        cp = _ring_exposed(workload, layout, hardware, block) * layers_on_stage(workload.model.n_layers, layout.pp,
                                                                                 stage)
    ep = collective_seconds(hardware, layout, "ep", ep_collectives(workload, layout, stage))
    dp_exposed, dp_total = _dp_exposed(workload, layout, hardware, stage, passes.backward, m * compute)
    return _Stage(compute + tp + pp + cp + ep, compute, tp, pp, dp_exposed, dp_total,
                  _optimizer_seconds(workload, layout, hardware, stage, m, passes.forward), cp, ep)


def step_time(workload: Workload, layout: Layout, hardware: Hardware) -> StepTime:
    """Step time of `layout` under the cost model (slowest pipeline stage, see `StepTime`).

    Per micro-batch, a stage takes compute + its tensor-parallel collectives (exposed:
    they sit between dependent matmuls) + its sends + its ring attention's exposed K/V traffic
    under context parallelism (`_ring_exposed`). The pipeline runs m of those on the
    slowest stage plus the schedule's bubble of them (`pipeline_traits`): p − 1 for GPipe and 1F1B,
    a bubble fraction (p − 1)/(m + p − 1), divided by v interleaved (Narayanan et al. 2021); ZB-H1
    fills two thirds of 1F1B's (m ≥ p; forward, input-gradient and weight-gradient passes of equal
    cost; Qi et al. 2023). A split backward costs `SPLIT_BACKWARD_COST` backwards.
    """
    lay = layout
    m = lay.num_microbatches(workload.global_batch)
    block = _block(workload, lay, hardware)
    stages = [_stage(workload, lay, hardware, stage, m, block) for stage in range(lay.pp)]
    slowest = max(stages, key=lambda s: s.per_mb)
    data = max(stages, key=lambda s: sum(s.dp_exposed.values()))  # the stage whose data-parallel time shows most
    axes = (*lay.data_axes, moe.EXPERT_DATA_AXIS) if moe.EXPERT_DATA_AXIS in data.dp_exposed else lay.data_axes
    dp_by_axis = {axis: data.dp_exposed.get(axis, 0.0) for axis in axes}
    sync = sum(collective_seconds(hardware, lay, axis, c)
               for calls in (sync_collectives(lay), tied_table_collectives(workload, lay)) for axis, c in calls.items())
    return StepTime(
        compute=m * slowest.compute, tp_comm=m * slowest.tp, pp_comm=m * slowest.pp, cp_comm=m * slowest.cp,
        bubble=pipeline_traits(lay.schedule, lay.pp, m, lay.chunks).bubble * slowest.per_mb,
        dp_comm=sum(dp_by_axis.values()), optimizer=max(s.optimizer for s in stages),
        dp_comm_total=max(s.dp_total for s in stages), sync=sync, dp_comm_by_axis=dp_by_axis,
        ep_comm=m * slowest.ep,
    )
