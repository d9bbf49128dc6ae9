"""The host's time per pass of an eager step (`paratrain.plan.host`): where it bounds the step and where not.

Pure arithmetic, no processes. The calibration that measures the host's costs is tested in test_calibrate.py.
"""

import dataclasses

import pytest

from paratrain.models import ModelConfig
from paratrain.plan import HARDWARE_PRESETS, Layout, Recompute, Workload, step_time
from paratrain.plan.hardware import Hardware, KernelStack
from paratrain.plan.compute import stage_pass_times
from paratrain.plan.host import (HOST_HEAD_OPS, HOST_OPS_PER_BLOCK, ZERO3_OUTER_UNITS, HostTimes, bound_by_host,
                                  host_times)
from paratrain.plan.ops import EAGER_OPS_PER_BLOCK, PassTimes, Shape

ONE_B = ModelConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=5632,
                    max_seq_len=2048)  # benchmarks/gpu_check.py's SIZES["1b"]
UNMEASURED = dataclasses.replace(HARDWARE_PRESETS["h200"], host_op_s=0.0, host_full_op_s=0.0,
                                 host_selective_op_s=0.0, host_unit_s=0.0)


def _workload(batch: int = 4) -> Workload:
    return Workload.for_model(ONE_B, seq_len=2048, global_batch=batch, precision="bf16", reduce_dtype="fp32")


def _step(hw, compile: bool = False, recompute: str = "none", zero: int = 0, batch: int = 4) -> float:
    layout = Layout(zero=zero, micro_batch=batch, recompute=Recompute(recompute), compile=compile)
    return step_time(_workload(batch), layout, hw).total


def test_a_host_slower_than_the_device_bounds_an_eager_step_and_not_a_compiled_one():
    slow = dataclasses.replace(UNMEASURED, host_op_s=200e-6)
    layout = Layout(micro_batch=4)
    passes = stage_pass_times(_workload(), layout, slow, 0)
    forward, backward = HOST_OPS_PER_BLOCK
    host_f = (16 * forward + 1 + HOST_HEAD_OPS[0]) * 200e-6  # the blocks, the embedding, the head
    host_b = (16 * backward + 1 + HOST_HEAD_OPS[1]) * 200e-6
    assert passes.forward == pytest.approx(host_f) and passes.backward == pytest.approx(host_b)
    assert _step(slow) > 1.5 * _step(UNMEASURED)
    assert _step(slow, compile=True) == _step(UNMEASURED, compile=True)  # a compiled step launches graphs


def test_without_host_costs_or_with_a_fast_host_the_device_sets_every_pass():
    fast = dataclasses.replace(UNMEASURED, host_op_s=1e-6, host_full_op_s=1e-6, host_selective_op_s=1e-6,
                               host_unit_s=1e-5)
    for recompute in ("none", "selective", "full"):
        for zero in (0, 3):
            device = _step(UNMEASURED, recompute=recompute, zero=zero)
            assert _step(fast, recompute=recompute, zero=zero) == device
    unmeasured = Hardware("old profile", 80e9, 1e15, 1e15, 5e14, 3e12, 4e11, 5e10)  # a profile without the fields
    assert (unmeasured.host_op_s, unmeasured.host_full_op_s, unmeasured.host_selective_op_s,
            unmeasured.host_unit_s) == (0.0, 0.0, 0.0, 0.0)


def test_each_pass_takes_the_longer_of_its_device_and_host_time():
    """The host bounds the forward and the backward apart: a host-bound forward costs its excess even when the
    backward leaves the host time to spare."""
    host = HostTimes(PassTimes(1.5, 1.0), PassTimes(0.5, 0.0))
    assert bound_by_host(PassTimes(1.0, 3.0), host, UNMEASURED, KernelStack.EAGER) == PassTimes(2.0, 3.0)
    assert bound_by_host(PassTimes(1.0, 3.0), host, UNMEASURED, KernelStack.FUSED) == PassTimes(1.0, 3.0)


def test_selective_recomputation_and_zero3_hooks_add_host_work_per_forward_operator_and_per_unit():
    hw = dataclasses.replace(UNMEASURED, host_op_s=1.0, host_full_op_s=10.0, host_selective_op_s=100.0,
                             host_unit_s=1000.0)
    x = Shape.of(ONE_B, 1, 2048, 1, False, "bf16", True)
    forward, backward = HOST_OPS_PER_BLOCK
    plain = host_times(hw, x, 2, Recompute.NONE, False, False, False)
    assert plain.base == PassTimes(2 * forward, 2 * backward) and plain.extra == PassTimes(0.0, 0.0)
    full = host_times(hw, x, 2, Recompute.FULL, False, False, False)
    assert full.base == PassTimes(2 * forward, 2 * (backward + forward))  # the forward again
    assert full.extra == PassTimes(2 * forward * 10.0, 2 * forward * 10.0)
    selective = host_times(hw, x, 2, Recompute.SELECTIVE, False, False, False)
    assert selective.base == PassTimes(2 * forward, 2 * (backward + EAGER_OPS_PER_BLOCK[0]))  # element-wise again
    assert selective.extra == PassTimes(2 * forward * 100.0, 2 * forward * 100.0)
    zero3 = host_times(hw, x, 2, Recompute.NONE, True, True, True)
    units = 2 + sum(ZERO3_OUTER_UNITS)
    assert zero3.extra == PassTimes(units * 1000.0, units * 1000.0)


def test_a_cpu_pays_the_hosts_extra_work_in_line():
    """On a CPU the dispatch of each operator is in its kernels' time already (`op_overhead_s`): only what
    recomputation's checkpoint and ZeRO-3's hooks add is added, whatever the device time."""
    cpu = dataclasses.replace(UNMEASURED, host_cores=2, host_op_s=1.0, host_selective_op_s=2.0, host_unit_s=3.0)
    host = host_times(cpu, Shape.of(ONE_B, 1, 16, 1, False, "bf16", True), 1, Recompute.SELECTIVE, True, False,
                      False)
    assert host.total.forward > 5.0 and bound_by_host(PassTimes(5.0, 7.0), host, cpu, KernelStack.EAGER) == \
        PassTimes(5.0, 7.0) + host.extra


def test_small_micro_batches_become_host_bound_first():
    """The host's work per pass does not shrink with the micro-batch; the device's does."""
    hw = dataclasses.replace(UNMEASURED, host_op_s=20e-6, host_selective_op_s=60e-6, host_unit_s=1e-3)
    big = _step(hw, recompute="selective", zero=3, batch=4) / _step(UNMEASURED, recompute="selective", zero=3, batch=4)
    small = _step(hw, recompute="selective", zero=3, batch=1) / _step(UNMEASURED, recompute="selective", zero=3,
                                                                       batch=1)
    assert small > big >= 1.0
