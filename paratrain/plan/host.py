"""The host's time per pass of an eager step, and how it bounds the step.

In eager mode the host runs, for every operator, Python (the modules around it), the dispatcher,
autograd's bookkeeping and the kernel's launch. On a GPU it queues kernels ahead of the device, so a
pass takes the longer of the two: the device's kernels (`paratrain.plan.ops`) or the host's work
(here). On a CPU the host is the device: each operator's dispatch is already priced with its kernel
(`Hardware.op_overhead_s`, paid in line), and what the host does beyond it adds.

Per block and micro-batch on one rank, with F and B the block's host operations forward and backward
(`HOST_OPS_PER_BLOCK`: the element-wise operators of `ops.EAGER_OPS_PER_BLOCK`, the linears'
products and the attention call), E its element-wise operators forward, h = `host_op_s`:

    none       forward F·h                   backward B·h
    full       forward F·(h + c_f)           backward B·h + F·(h + c_f)    the forward again in the recompute
    selective  forward F·(h + c_s)           backward B·h + E·h + F·c_s    the element-wise operators again;
                                                                           the matmuls' and attention's outputs
                                                                           come from the forward's cache
    ZeRO-3     + u per unit in each pass (its gather, install and free in forward; the gather again and the
               reduce-scatter's bookkeeping in backward)

c_f = `host_full_op_s`: non-reentrant checkpoint's saved-tensor hooks and the recompute's setup, per
forward operator; c_s = `host_selective_op_s`: those and selective checkpointing's dispatch mode, which
sees every operator (views included) in Python, in the forward and again in the recompute
(`paratrain.parallel.recompute`); u = `host_unit_s`. The first stage adds the embedding, the last the
final norm, the output projection and the loss (`HOST_HEAD_OPS`); under ZeRO-3 these are units of their
own (`ZERO3_OUTER_UNITS`). A compiled step launches a few graphs per block, not an operator's kernels
one by one: no bound is applied to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.hardware import Hardware, KernelStack
from paratrain.plan.memory import Recompute
from paratrain.plan.ops import EAGER_HEAD_OPS, EAGER_OPS_PER_BLOCK, PassTimes, Shape

BLOCK_LINEARS = 7  # wq, wk, wv, wo, w1, w3, w2
# Forward: the element-wise operators, one product per linear, the attention call; backward: the element-wise
# autograd nodes, two products per linear, the attention's backward.
HOST_OPS_PER_BLOCK = (EAGER_OPS_PER_BLOCK[0] + BLOCK_LINEARS + 1, EAGER_OPS_PER_BLOCK[1] + 2 * BLOCK_LINEARS + 1)
HOST_HEAD_OPS = (EAGER_HEAD_OPS[0] + 1, EAGER_HEAD_OPS[1] + 2)  # with the output projection's products
HOST_EMBEDDING_OPS = (1, 1)  # the lookup; its backward's scatter-add
# paratrain's ZeRO-3 units beside the blocks (`paratrain.parallel.blocks.unit_modules`): the embedding on the
# first stage; the final norm and the output projection on the last.
ZERO3_OUTER_UNITS = (1, 2)


@dataclass(frozen=True)
class HostTimes:
    """One micro-batch's host seconds on one rank: `base`, the operators' own (dispatch, autograd, launch);
    `extra`, what recomputation's checkpoint and ZeRO-3's hooks add to them."""

    base: PassTimes
    extra: PassTimes

    @property
    def total(self) -> PassTimes:
        return self.base + self.extra


def host_times(hw: Hardware, x: Shape, layers: int, recompute: Recompute, zero3: bool, first: bool,
               last: bool) -> HostTimes:
    """The host's work for `layers` blocks (and the embedding on the `first` stage, the head on the `last`)."""
    forward, backward = HOST_OPS_PER_BLOCK
    ops_f = layers * forward + first * HOST_EMBEDDING_OPS[0] + last * HOST_HEAD_OPS[0]
    ops_b = layers * backward + first * HOST_EMBEDDING_OPS[1] + last * HOST_HEAD_OPS[1]
    checkpoint = 0.0
    if recompute is Recompute.FULL:
        ops_b += layers * forward
        checkpoint = layers * forward * hw.host_full_op_s
    elif recompute is Recompute.SELECTIVE and x.flash:  # paratrain's policy (Megatron's runs fused kernels)
        ops_b += layers * EAGER_OPS_PER_BLOCK[0]
        checkpoint = layers * forward * hw.host_selective_op_s
    units = layers + first * ZERO3_OUTER_UNITS[0] + last * ZERO3_OUTER_UNITS[1] if zero3 else 0
    hooks = units * hw.host_unit_s
    return HostTimes(PassTimes(ops_f * hw.host_op_s, ops_b * hw.host_op_s),
                     PassTimes(checkpoint + hooks, checkpoint + hooks))


def bound_by_host(device: PassTimes, host: HostTimes, hw: Hardware, kernels: KernelStack) -> PassTimes:
    """A pass's time given its device time and its host's (module docstring): a GPU's, the longer of the two
    per pass; a CPU's (`Hardware.host_cores` set), the kernels and the host's work beyond their dispatch."""
    if kernels is KernelStack.FUSED:
        return device
    if hw.host_cores is not None:
        return device + host.extra
    total = host.total
    return PassTimes(max(device.forward, total.forward), max(device.backward, total.backward))
