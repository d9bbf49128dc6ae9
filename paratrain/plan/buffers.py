"""Communication buffers of a layout per rank: ZeRO-3's gathered units and gradients in flight, ZeRO-1/2's
buckets beyond the gradients themselves (`paratrain.plan.memory` adds them to a stage's memory). The
functions take that module's `Workload` and `Layout` (not imported here: it imports this one)."""

from __future__ import annotations

from paratrain.plan import moe
from paratrain.plan.lora import zero3_units
from paratrain.plan.model_states import block_param_count

ZERO3_PREFETCH_UNITS = 2  # units gathered at once (computing + prefetched), and gradients in flight


def comm_buffer_parts(workload, layout, stage_params: float) -> tuple[float, float]:
    """Transient communication buffers.

    ZeRO-3 (one unit per block, plus the root's remaining parameters: embedding, head, final
    norm, as paratrain.parallel.data.units wraps them): `ZERO3_PREFETCH_UNITS` units gathered
    in the parameter dtype (the one computing, the one prefetched) and as many unit gradients
    awaiting their reduce-scatter, in the gradient dtype; the largest unit, ÷tp. ZeRO-2: two
    buckets, one being filled and the one before it in flight meanwhile (paratrain.parallel.data.ddp,
    on CUDA; on the CPU each lands at once). DDP and ZeRO-1: their
    buckets are the gradients (counted there); ZeRO-1 adds one bucket's all-gather of updated
    parameters. Under LoRA (`paratrain.plan.lora`) the units gather at their stored bytes and only the adapters'
    gradients travel (`stage_params`: the adapters). Nothing when only the parameter count is known. Hybrid sharding keeps one
    reduced shard more (1/dp_shard of a unit's gradients, or of a ZeRO-2 bucket) while it is
    summed over the replicas and the next one is reduced; ZeRO-1 sums its shard in place in
    the bucket. Gathered units and buckets are whole tensors whatever the shard group.

    Returned as (gathered parameters, gradient buffers): the first is alive while backward begins (the
    units it computes with), the second only as gradients are made and reduced (`MemoryBreakdown.total`).
    Two ZeRO-2 buckets are never more than the stage's gradients (one bucket when it holds them all).
    """
    model, lay = workload.model, layout
    if model is None or lay.data_ranks == 1:
        return 0.0, 0.0
    replicating = 1 / lay.shard_ranks if lay.dp_replicate > 1 else 0.0  # a shard on its way between replicas
    if lay.zero == 3 and workload.lora:  # the units at their stored bytes, the adapters' gradients alone
        gathered, grads = zero3_units(workload, lay.tp)
        return ZERO3_PREFETCH_UNITS * gathered, ZERO3_PREFETCH_UNITS * grads + grads * replicating
    if lay.zero == 3:
        block = block_param_count(model)
        routed = moe.routed_params_per_layer(model)
        block_unit = (block - routed) / lay.tp + routed / lay.ep  # experts whole on a tp rank, E/ep of them
        unit = max(block_unit, (model.num_params() - model.n_layers * block) / lay.tp)
        return (ZERO3_PREFETCH_UNITS * unit * workload.param_bytes,
                ZERO3_PREFETCH_UNITS * unit * workload.grad_bytes + unit * workload.grad_bytes * replicating)
    grads = stage_params * workload.grad_bytes
    bucket = min(lay.bucket_mb * 2**20, grads)
    return 0.0, {0: 0.0, 1: bucket * workload.param_bytes / workload.grad_bytes,
                 2: min(2 * bucket, grads) + bucket * replicating}[lay.zero]
