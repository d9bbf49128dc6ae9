"""Communication of a layout: which collectives each step runs, the bytes they send and their time.

Communication is counted as paratrain's comm layer counts it (`paratrain.comm`): bytes one
rank sends under a bandwidth-optimal ring, an all-reduce of S bytes over n ranks 2·S·(n−1)/n,
an all-gather or reduce-scatter (S the full tensor) S·(n−1)/n, a point-to-point send S, per
mesh axis as the runtime names them: dp, tp, pp, cp, and dp_cp in place of dp under context
parallelism or dp_shard and dp_replicate under hybrid sharding (`Layout.data_axes`).

Time is α-β (Hockney; ring collectives as in Thakur et al. 2005): a collective of n ranks
takes (steps × α) + bytes sent / β, with 2(n−1) steps for an all-reduce, n−1 for an
all-gather or reduce-scatter, 1 for a send. β is the intra-node bandwidth when the group fits
in one node (ranks are laid out pp × dp × cp × tp, tp innermost; see `axis_span`), the inter-node
one otherwise, times the achieved fraction; a calibrated profile gives measured (α, β) per
kind instead. How the collectives meet the compute (what overlaps) is `paratrain.plan.compute`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.plan.hardware import Hardware
from paratrain.plan import lora, moe
from paratrain.plan.memory import (
    Layout,
    PipelineBoundary,
    Recompute,
    Workload,
    stage_dense_params,
    stage_expert_params,
    stage_fp8_weights,
)
from paratrain.plan.model_states import layers_on_stage
from paratrain.plan.muon import muon_sent_bytes, stage_muon_params
from paratrain.plan.ring import ring_kv_block_bytes

# An all-to-all of S bytes (a rank's whole buffer, its own 1/n included) sends S·(n−1)/n in n−1 pairwise steps.
_RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
_RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
LOSS_BYTES = 4  # fp32 scalars: the vocab-parallel cross-entropy's row maxima and sums, norms, flags


@dataclass(frozen=True)
class Collective:
    """`count` calls of one collective over `ranks` ranks; `size` is the full tensor's bytes."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all or send
    size: float
    ranks: int
    count: float = 1.0

    @property
    def bytes_sent(self) -> float:
        """Bytes one rank sends, as paratrain.comm counts them."""
        if self.kind == "send":
            return self.size * self.count
        return ring_bytes(self.kind, self.size, self.ranks) * self.count

    @property
    def steps(self) -> int:
        """Ring steps of one call: the latency terms it pays."""
        return 1 if self.kind == "send" else _RING_STEPS[self.kind] * (self.ranks - 1)

    def seconds(self, bandwidth: float, latency: float) -> float:
        """Ring time; an all-reduce takes the double binary tree instead when that is faster.

        NCCL switches to trees for latency-bound all-reduces (2·⌈log₂ n⌉ steps, each rank sending
        about 2·S; Sanders et al. 2009), which makes a small all-reduce over thousands of ranks cost
        microseconds, not the milliseconds of a 2(n − 1)-step ring.
        """
        if self.ranks == 1 or self.count == 0:
            return 0.0
        ring = self.count * self.steps * latency + self.bytes_sent / bandwidth
        if self.kind != "all_reduce":
            return ring
        tree = self.count * (2 * math.ceil(math.log2(self.ranks)) * latency + 2 * self.size / bandwidth)
        return min(ring, tree)


def ring_bytes(kind: str, size: float, ranks: int) -> float:
    """Bytes one rank sends in a ring: all-reduce 2·S·(n−1)/n, all-gather/reduce-scatter S·(n−1)/n; an
    all-to-all of a rank's S bytes S·(n−1)/n."""
    if ranks == 1:
        return 0.0
    return _RING_FACTOR[kind] * size * (ranks - 1) / ranks


def axis_span(layout: Layout, axis: str) -> int:
    """Consecutive ranks one group of `axis` reaches across (layout pp × dp × cp × tp, tp innermost).

    A tp group is tp neighbours; a cp group strides tp over cp × tp ranks; a dp group (and the
    dp × cp group that reduces gradients under context parallelism) spans the dp × cp × tp block.
    The data axis of hybrid sharding splits as dp = dp_replicate × dp_shard with dp_shard inner
    (`paratrain.mesh.MeshShape.groups`): a shard group spans dp_shard × tp ranks, a replica
    group strides dp_shard × tp over the whole dp × tp block. The expert axis splits it the same
    way: an ep group spans ep × tp ranks, an expert's replica group strides over the dp × tp block.
    """
    block = layout.tp * layout.data_ranks
    return {"tp": layout.tp, "cp": layout.tp * layout.cp, "dp": block, "dp_cp": block,
            "dp_shard": layout.tp * layout.shard_ranks, "dp_replicate": block, "pp": layout.world_size,
            "world": layout.world_size, "ep": layout.tp * layout.cp * layout.ep, moe.EXPERT_DATA_AXIS: block}[axis]


def axis_is_intra_node(layout: Layout, axis: str, gpus_per_node: int) -> bool:
    """Whether every group of `axis` sits inside one node: its span fits in one and tiles the nodes."""
    span = axis_span(layout, axis)
    return span <= gpus_per_node and gpus_per_node % span == 0


def collective_seconds(hardware: Hardware, layout: Layout, axis: str, collectives: list[Collective]) -> float:
    """Time of `collectives` over `axis`: a calibrated (α, β) per kind inside a node, else the links.

    On a CPU profile whose cores the layout's ranks time-share, the costs measured that way.
    """
    intra = axis_is_intra_node(layout, axis, hardware.gpus_per_node) or hardware.host_cores is not None
    shared = hardware.compute_share(layout.world_size) < 1 and hardware.collectives_shared
    costs = hardware.collectives_shared if shared else hardware.collectives
    total = 0.0
    for c in collectives:
        measured = costs.get(c.kind) if intra else None
        if measured is not None:
            total += c.seconds(measured.bytes_per_s, measured.latency_s)
        elif intra:
            total += c.seconds(hardware.intra_node_bytes_per_s * hardware.link_efficiency,
                               hardware.intra_node_latency_s)
        else:
            total += c.seconds(hardware.inter_node_bytes_per_s * hardware.link_efficiency,
                               hardware.inter_node_latency_s)
    return total


def stage_psi(workload: Workload, layout: Layout, stage: int) -> float:
    """Parameters one rank of `stage` holds before ZeRO sharding (Ψ of the ZeRO formulas), E/ep experts per layer;
    under LoRA those that train: the adapters (`paratrain.plan.lora`)."""
    if workload.lora:
        return lora.stage_adapters(workload, layout, stage)
    return stage_dense_params(workload, layout, stage) + stage_expert_params(workload, layout, stage)


def _fp8_gathered_params(workload: Workload, layout: Layout, stage: int) -> float:
    """Parameters ZeRO-3 gathers as their 1-byte FP8 casts on a rank of `stage`: tensorwise FP8 linears' weights
    outside tensor parallelism (`paratrain.parallel.fp8.gathers_fp8`)."""
    return stage_fp8_weights(workload, layout, stage) if layout.tp == 1 else 0.0


def _zero3_units(workload: Workload, layout: Layout, stage: int) -> int:
    """ZeRO-3 gathers one unit per block plus the root's rest (embedding, head, final norm)."""
    if workload.model is None:
        return 1
    return layers_on_stage(workload.model.n_layers, layout.pp, stage) + 1


@dataclass(frozen=True)
class AxisCollectives:
    """One mesh axis's data-parallel collectives of a step on one rank, by how they meet the compute.

    overlapped: launched asynchronously while backward (ZeRO-3: forward too) computes; compute
        hides them but for the last call (`_dp_exposed`).
    after: after the optimizer step (ZeRO-1/2's all-gather of the updated parameters), exposed.
    """

    overlapped: tuple[Collective, ...] = ()
    after: tuple[Collective, ...] = ()

    @property
    def calls(self) -> tuple[Collective, ...]:
        return self.overlapped + self.after


def dp_collectives(workload: Workload, layout: Layout, stage: int) -> dict[str, AxisCollectives]:
    """Data-parallel collectives of one step on one rank of `stage`, per mesh axis (`Layout.data_axes`).

    N is the ranks ZeRO shards over (`Layout.shard_ranks`: dp × cp, or the shard group).
    DDP: one all-reduce of the gradients (2Ψ(N−1)/N in the gradient dtype), bucket by bucket.
    ZeRO-1/2: a reduce-scatter of the gradients during backward and an all-gather of the updated
    parameters after the step (Ψ(N−1)/N each), as paratrain.parallel.data.ddp does, counted per bucket (the
    runtime gathers a parameter whose rows split evenly by a collective of its own: the same bytes). DDP
    and ZeRO-1 accumulate gradients locally over micro-batches and communicate once per step;
    ZeRO-2 keeps no full gradient, so it reduce-scatters after every micro-batch. ZeRO-3: for
    every micro-batch an all-gather of each unit's parameters before forward and again before
    backward and a reduce-scatter of its gradients: 3Ψ(N−1)/N per micro-batch, but the embedding
    and the head units gather once (`_zero3_tables`): 3Ψ − 2·V·h untied, 3Ψ + V·h with a tied table.

    Hybrid sharding (R = dp / N replicas of each shard group): those reduce-scatters and
    all-gathers run within the shard group (axis dp_shard), and every reduce-scatter of S bytes
    is followed by an all-reduce of its S/N shard over the R replicas (axis dp_replicate),
    2·(S/N)·(R−1)/R per reduction: the replicas' sum of the gradient that ZeRO over all dp
    ranks would have reduced in one collective. The engines launch it as the reduce-scatter
    lands and wait for it at the next one, so it overlaps compute as the reduce-scatters do.

    A MoE model's routed experts (E/ep per layer on a rank) are reduced the same way but over
    their replica group of dp/ep ranks (`paratrain.plan.moe.expert_shard_ranks`), on the axis
    `paratrain.plan.moe.EXPERT_DATA_AXIS`; the dense parameters over the data axes as above.
    """
    if layout.data_ranks == 1:
        return {}
    experts = stage_expert_params(workload, layout, stage) if layout.ep > 1 else 0.0  # ep = 1: every data rank's
    dense, reduce = _sharded_collectives(workload, layout, stage, stage_psi(workload, layout, stage) - experts,
                                         layout.shard_ranks, _zero3_tables(workload, layout, stage))
    out = {layout.data_axes[0]: _with_muon(dense, workload, layout, stage, experts)}
    if layout.dp_replicate > 1:
        replicas = Collective("all_reduce", reduce.size / layout.shard_ranks, layout.dp_replicate, reduce.count)
        out["dp_replicate"] = AxisCollectives(overlapped=(replicas,))
    replicas = moe.expert_shard_ranks(layout.shard_ranks, layout.ep)
    if experts and replicas > 1:
        out[moe.EXPERT_DATA_AXIS] = _sharded_collectives(workload, layout, stage, experts, replicas)[0]
    return out


def _with_muon(dense: AxisCollectives, workload: Workload, layout: Layout, stage: int,
               experts: float) -> AxisCollectives:
    """The data axis's collectives plus, with Muon, its exchange of the dense matrices' pieces after the backward
    (`paratrain.plan.muon.muon_sent_bytes`: sends, exposed before the optimizer's update)."""
    if workload.optimizer != "muon":
        return dense
    elements = stage_muon_params(workload, layout, stage, stage_expert_params(workload, layout, stage)) - experts
    sent = muon_sent_bytes(elements, layout.data_ranks, layout.zero)
    return AxisCollectives(dense.overlapped, dense.after + (Collective("send", sent, layout.data_ranks),))


def _zero3_tables(workload: Workload, layout: Layout, stage: int) -> tuple[float, float, int]:
    """(held, table, units): the elements of the embedding table and the output head one rank of `stage` holds (a
    tied table once), one table's (V·h/tp), and how many ZeRO-3 units hold them (`paratrain.parallel.data.units`:
    the embedding and the head are units of their own, a tied table in both). Each such unit is gathered once per
    micro-batch, not twice: the embedding's backward reads only the indices, and the head, the forward's last
    unit, stays gathered into its backward (`paratrain.parallel.data.zero3`); a tied table is gathered and reduced
    by each of its two units, as an untied model's two tables are."""
    model = workload.model
    if model is None or layout.zero != 3:
        return 0.0, 0.0, 0
    table = -(-(model.vocab_size * model.dim) // layout.tp)
    first, last = stage == 0, stage == layout.pp - 1
    held = table * (int(first) + int(last and (not model.tie_embeddings or layout.pp > 1)))
    return float(held), float(table), int(first) + int(last)


def _sharded_collectives(workload: Workload, layout: Layout, stage: int, psi: float,
                         n: int, tables: tuple[float, float, int] = (0.0, 0.0, 0),
                         ) -> tuple[AxisCollectives, Collective]:
    """The collectives of Ψ = `psi` parameters reduced (and ZeRO-sharded) over `n` ranks, and the reduction itself;
    `tables` (`_zero3_tables`): ZeRO-3's embedding and head units, whose backward gathers nothing."""
    grads, params = psi * workload.grad_bytes, psi * workload.param_bytes
    m = layout.num_microbatches(workload.global_batch)
    if layout.zero == 3:
        units = _zero3_units(workload, layout, stage)
        held, table, table_units = tables  # each unit of a table gathers and reduces it once; the rest gather twice
        gathered = 2 * (psi - held) + table * table_units  # elements, per micro-batch
        reduced = psi - held + table * table_units
        gathered_bytes = (gathered * workload.param_bytes
                          - 2 * _fp8_gathered_params(workload, layout, stage) * (workload.param_bytes - 1))
        if workload.lora:  # the frozen base gathered at its stored bytes; only the adapters reduced
            gathered_bytes, reduced = lora.zero3_gathered_bytes(workload, layout, stage), psi
        reduce = Collective("reduce_scatter", reduced * workload.grad_bytes / units, n, m * units)
        all_gather = Collective("all_gather", gathered_bytes / (2 * units), n, 2 * m * units)
        return AxisCollectives(overlapped=(all_gather, reduce)), reduce
    buckets = max(1, math.ceil(grads / (layout.bucket_mb * 2**20)))
    if layout.zero == 0:
        reduce = Collective("all_reduce", grads / buckets, n, buckets)
        return AxisCollectives(overlapped=(reduce,)), reduce
    reduce = Collective("reduce_scatter", grads / buckets, n, buckets * (m if layout.zero == 2 else 1))
    return AxisCollectives(overlapped=(reduce,), after=(Collective("all_gather", params / buckets, n, buckets),)), reduce


def _activation_bytes(workload: Workload, layout: Layout) -> float:
    """b·s·h of one micro-batch on one rank: its s/cp tokens under context parallelism."""
    return float(layout.micro_batch * (workload.seq_len // layout.cp) * workload.model.dim * workload.param_bytes)


def tp_collectives(workload: Workload, layout: Layout, stage: int) -> list[Collective]:
    """Tensor-parallel collectives of one micro-batch on `stage` (Shoeybi et al. 2019).

    Each layer: 2 all-reduces of b·s·h in forward (after attention and after the MLP) and 2 in
    backward (their conjugates before them); with sequence parallelism each all-reduce becomes
    an all-gather + a reduce-scatter of the same full tensor (the same bytes). Full
    recomputation runs the forward's 2 again. The vocab-parallel embedding adds one all-reduce
    in forward (a reduce-scatter with SP) on the first stage; the head adds one all-reduce of
    its input gradient in backward (all-gather forward + reduce-scatter backward with SP) on
    the last, and the vocab-parallel cross-entropy two all-reduces of fp32 row statistics (the
    maxima, b·s; the sums of exponentials and target logits, 2·b·s). Pipeline boundaries add
    the all-gathers of `boundary_gathers`.
    """
    model, t = workload.model, layout.tp
    if model is None or t == 1:
        return []
    size = _activation_bytes(workload, layout)
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
        rows = layout.micro_batch * (workload.seq_len // layout.cp) * LOSS_BYTES
        out += [Collective("all_reduce", rows, t), Collective("all_reduce", 2 * rows, t)]
    gathers = boundary_gathers(layout, stage)
    if gathers:
        out.append(Collective("all_gather", size, t, gathers))
    return out


def boundary_crossings(layout: Layout, stage: int) -> int:
    """Stage boundaries pipeline rank `stage` sends across per micro-batch (activations forward + grads back).

    Each of the rank's v chunks sends its output forward unless it is the model's last chunk and
    its input gradient backward unless it is the first; it receives as many as it sends.
    """
    p, v = layout.pp, layout.chunks
    chunks = [c * p + stage for c in range(v)]
    return sum(g < v * p - 1 for g in chunks) + sum(g > 0 for g in chunks)


def boundary_gathers(layout: Layout, stage: int) -> int:
    """All-gathers over tp of a full b·s·h that stage boundaries cost rank `stage` per micro-batch.

    Per boundary crossing (`boundary_crossings`): SCATTER_GATHER one (the receiver gathers the t
    slices) plus, under sequence parallelism, the gather of the sequence shards into the whole
    boundary tensor; FULL only the latter. See `PipelineBoundary`.
    """
    if layout.pp == 1 or layout.tp == 1:
        return 0
    per_crossing = int(layout.boundary is PipelineBoundary.SCATTER_GATHER) + int(layout.sequence_parallel)
    return per_crossing * boundary_crossings(layout, stage)


def pp_sends(workload: Workload, layout: Layout, stage: int) -> list[Collective]:
    """Point-to-point sends of one micro-batch by pipeline rank `stage` (Narayanan et al. 2021).

    One send per boundary crossing (`boundary_crossings`) of b·s·h per rank with FULL boundaries,
    b·s·h/t with SCATTER_GATHER (each tp rank its slice).
    """
    model, p = workload.model, layout.pp
    if model is None or p == 1:
        return []
    size = _activation_bytes(workload, layout)
    if layout.boundary is PipelineBoundary.SCATTER_GATHER:
        size /= layout.tp
    return [Collective("send", size, 2, boundary_crossings(layout, stage))]


@dataclass(frozen=True)
class RingSends:
    """The K/V traffic of one layer's ring attention on one rank, per micro-batch (`paratrain.parallel.context.ring`).

    forward: cp − 1 sends of one K/V block (`ring_kv_block_bytes`), each posted before the block
        before it is computed on and waited for after it.
    backward: cp − 1 sends of a K/V block and cp sends of the fp32 dK/dV sums that follow the
        blocks; the j-th sum leaves after step j's block and is waited for after step j + 1's,
        so the last one (it returns the owner's gradient) has no compute left to hide behind.
    """

    kv_block: float  # bytes of one K/V block
    dkv_block: float  # bytes of one fp32 dK/dV block
    cp: int

    @property
    def forward(self) -> list[Collective]:
        return [Collective("send", self.kv_block, self.cp, self.cp - 1)]

    @property
    def backward(self) -> list[Collective]:
        return [Collective("send", self.kv_block, self.cp, self.cp - 1),
                Collective("send", self.dkv_block, self.cp, self.cp)]

    @property
    def bytes_sent(self) -> float:
        return sum(c.bytes_sent for c in self.forward + self.backward)


def ring_sends(workload: Workload, layout: Layout) -> RingSends | None:
    """One layer's ring traffic per micro-batch (None without context parallelism or a model shape)."""
    if layout.cp == 1 or workload.model is None:
        return None
    shape = (workload.model, layout.micro_batch, workload.seq_len // layout.cp, layout.tp)
    return RingSends(ring_kv_block_bytes(*shape, workload.param_bytes), ring_kv_block_bytes(*shape, 4), layout.cp)


def cp_sends(workload: Workload, layout: Layout, stage: int) -> list[Collective]:
    """The cp axis's sends of one micro-batch on `stage`: every layer's ring, forward and backward (full
    recomputation runs each layer's forward again in backward, its ring's forward sends included)."""
    ring = ring_sends(workload, layout)
    if ring is None:
        return []
    layers = layers_on_stage(workload.model.n_layers, layout.pp, stage)
    passes = ring.forward * (2 if layout.recompute is Recompute.FULL else 1) + ring.backward
    return [Collective(c.kind, c.size, c.ranks, c.count * layers) for c in passes]
def ep_collectives(workload: Workload, layout: Layout, stage: int) -> list[Collective]:
    """Expert-parallel all-to-alls of one micro-batch on `stage` (`paratrain.plan.moe`).

    Per MoE layer: dispatch and combine forward and their transposes backward, each of a rank's
    k·c·T routed copies of h activations, T = b·s tokens (c the assumed imbalance, for the
    busiest rank); full recomputation runs the forward's two again. None without ep.
    """
    model = workload.model
    if layout.ep == 1 or not moe.is_moe(model):
        return []
    tokens = layout.micro_batch * workload.seq_len
    size = moe.routed_tokens(tokens, model, workload.moe_imbalance) * model.dim * workload.param_bytes
    per_layer = moe.ALL_TO_ALLS_PER_LAYER + (2 if layout.recompute is Recompute.FULL else 0)
    return [Collective("all_to_all", size, layout.ep, per_layer * layers_on_stage(model.n_layers, layout.pp, stage))]


def sync_collectives(layout: Layout) -> dict[str, list[Collective]]:
    """The step's small agreement collectives, per axis, as paratrain's step runs them.

    One all-reduce over every rank (`ParallelModel.agree`): per rank its non-finite flags, stop
    request, loss (a pipeline's from its last stage) and share of the global squared gradient
    norm (whatever the layout shards), and per stage how many ranks reached each parameter.
    """
    return {"world": [Collective("all_reduce", 64.0, layout.world_size)]}


def tied_table_collectives(workload: Workload, layout: Layout) -> dict[str, list[Collective]]:
    """The step's all-reduce over pp of a tied head's table gradient (empty without one, or without pipelines).

    The first and the last stage each hold a copy of the table; after the data-parallel reduction their master
    gradients are summed over pp (`paratrain.parallel.pipeline.runner.PipelineRunner.sum_shared_gradients`): V·h/tp
    fp32 values per rank (the table split by vocabulary under tp), ZeRO's rows of them under ZeRO-1/2. Once per
    step, on the critical path between the last backward and the step.
    """
    model = workload.model
    if model is None or layout.pp == 1 or not getattr(model, "tie_embeddings", False):
        return {}
    rows = -(-model.vocab_size // layout.tp)
    if layout.zero:
        rows = -(-rows // layout.shard_ranks)
    return {"pp": [Collective("all_reduce", 4.0 * rows * model.dim, layout.pp)]}


def comm_bytes_per_rank(workload: Workload, layout: Layout) -> dict[str, int]:
    """Bytes one rank sends per step on each axis (the busiest rank of that axis).

    The data axes are `Layout.data_axes`: dp, dp_cp under context parallelism, or dp_shard and
    dp_replicate under hybrid sharding; cp (the ring's K/V traffic) appears when cp > 1; with
    ep > 1, ep (the all-to-alls) and the experts' replica group's axis too.
    """
    m = layout.num_microbatches(workload.global_batch)
    out = {axis: 0.0 for axis in (*layout.data_axes, "tp", "pp", *(("cp",) if layout.cp > 1 else ()))}
    if layout.ep > 1:
        out.update({"ep": 0.0, moe.EXPERT_DATA_AXIS: 0.0})
    for stage in range(layout.pp):
        if layout.ep > 1:
            out["ep"] = max(out["ep"], m * sum(c.bytes_sent for c in ep_collectives(workload, layout, stage)))
        for axis, collectives in dp_collectives(workload, layout, stage).items():
            out[axis] = max(out[axis], sum(c.bytes_sent for c in collectives.calls))
        out["tp"] = max(out["tp"], m * sum(c.bytes_sent for c in tp_collectives(workload, layout, stage)))
        out["pp"] = max(out["pp"], m * sum(c.bytes_sent for c in pp_sends(workload, layout, stage)))
        if layout.cp > 1:
            out["cp"] = max(out["cp"], m * sum(c.bytes_sent for c in cp_sends(workload, layout, stage)))
    for axis, collectives in tied_table_collectives(workload, layout).items():  # (on the end stages: the busiest)
        out[axis] += sum(c.bytes_sent for c in collectives)
    return {axis: int(round(value)) for axis, value in out.items()}
