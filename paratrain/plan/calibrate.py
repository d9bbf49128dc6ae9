"""`paratrain plan --calibrate`: measure this machine and write a hardware profile (JSON).

Every measurement runs on `nproc` gloo ranks at once (`paratrain.testing.run_on_ranks`), one
thread per rank, as training runs: what is measured is the throughput one process gets while
its peers work beside it (on a CPU they share caches and memory bandwidth), and of the ranks the
slowest is kept, since a step waits for its slowest rank.

- the three matmuls of a linear layer (forward x·Wᵀ, input gradient dY·W, weight gradient
  dYᵀ·x) for several shapes and dtypes → the efficiency curve of `GemmCurve`, fitted as
  1/throughput = (1/A)·(1 + x_half/x), linear in 1/x (A, the plateau, is stored as the peak);
- the attention kernel (`scaled_dot_product_attention`, causal, forward + backward) →
  `attention_efficiency`, its speed relative to the curve at its matmul shapes;
- the element-wise kernel kinds of an eager stack (a product, a negation, a row sum, SiLU and its
  backward, log-softmax) at sizes of a layer's activations, each cycling through more tensors
  than the caches hold (a training step's activations do not stay in cache) → `elementwise`,
  and an out-of-place add from caches to memory size → `memory_curve`; a chain of tiny products
  run forward and backward → `op_overhead_s`, the host time per operator or autograd node;
- all-reduce, all-gather, reduce-scatter and send/recv at several sizes, each issued between
  matmuls of about a layer's duration as training issues them (the cost is the time a loop of
  matmul + collective takes beyond the matmuls alone: waits for the slower peer and wake-ups
  count, as they do in a step) → α and β per kind, fitted to steps·α + bytes sent/β with
  relative errors; once more with twice as many ranks as `nproc`, in pairs, time-sharing the
  cores → `collectives_shared`;
- the process's CPU time during collectives against their duration → `comm_overlap`, the
  fraction of a collective during which its rank's core is free for compute.

The host's cores are recorded (`host_cores`): the planner gives each rank cores/ranks of a core
when a layout has more ranks than the host has cores.

On a shared machine each phase first waits for the CPUs to be nearly idle and is measured again
(up to `retries` times) when other processes took more than `max_foreign` of the CPUs while it
ran, or when a matmul probe before and after it ran more than `max_drift` away from the machine's
best probe at the start (`paratrain.plan.load`); the profile's source line and the raw
measurements say how much.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

from paratrain.plan.hardware import COLLECTIVE_KINDS, Elementwise, GemmCurve, Hardware, LinkCost
from paratrain.plan.load import Conditions, CpuWindow, machine_speed, matmul_probe, wait_until_quiet
from paratrain.plan.memory import PlanError
from paratrain.plan.ops import FLASH_BACKWARD_MATMULS, Gemm

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
COLLECTIVE_CALLS = 12  # calls per timed loop of matmul + collective


class CalibrationError(PlanError):
    """A calibration measurement could not be made or fitted; the message says which."""


@dataclass(frozen=True)
class CalibrationPlan:
    """What `calibrate` measures.

    gemm_shapes: (m, n, k) per dtype; fp16 has few and small ones (CPUs without fp16 matmul
    units run it orders of magnitude slower). attention_shapes: (batch, heads, seq, head_dim).
    memory_sizes: fp32 elements of the element-wise add. collective_sizes: bytes of the full
    tensor (the all-gather's output, the reduce-scatter's input). min_seconds: each timing sample
    repeats its operation for at least this long; repeats: samples per measurement (median).
    """

    nproc: int = 2
    gemm_shapes: dict[str, tuple[tuple[int, int, int], ...]] = field(default_factory=lambda: {
        "fp32": ((128, 128, 128), (256, 256, 256), (512, 512, 512), (512, 64, 256), (1024, 256, 256),
                 (1024, 768, 256), (2048, 256, 688), (1024, 1024, 1024), (4096, 512, 512)),
        "bf16": ((128, 128, 128), (256, 256, 256), (512, 512, 512), (512, 64, 256), (1024, 256, 256),
                 (1024, 768, 256), (2048, 256, 688), (1024, 1024, 1024)),
        "fp16": ((64, 64, 64), (128, 128, 128), (256, 256, 256)),
    })
    attention_shapes: tuple[tuple[int, int, int, int], ...] = ((4, 8, 128, 32), (2, 8, 256, 64), (1, 16, 512, 64))
    memory_sizes: tuple[int, ...] = (2**14, 2**16, 2**18, 2**20, 2**22, 2**24)
    elementwise_sizes: tuple[int, ...] = (2**16, 2**18, 2**20)
    working_set: int = 48 * 2**20
    collective_sizes: tuple[int, ...] = (2**14, 2**18, 2**20, 2**22, 2**24)
    gap: tuple[int, int, int] = (512, 384, 512)
    min_seconds: float = 0.02
    repeats: int = 5
    timeout: float = 900.0
    quiet_cpu: float = 0.15
    quiet_wait: float = 120.0
    max_foreign: float = 0.10
    max_drift: float = 0.10
    retries: int = 3

    def __post_init__(self):
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 2:
            raise CalibrationError(f"--nproc must be an integer of at least 2 (collectives need peers), "
                                   f"got {self.nproc!r}")

    @classmethod
    def quick(cls, nproc: int = 2) -> CalibrationPlan:
        """A few seconds' worth: enough to fit every constant, too little for accuracy."""
        return cls(nproc=nproc, gemm_shapes={"fp32": ((64, 64, 64), (256, 256, 256), (512, 64, 256)),
                                             "bf16": ((64, 64, 64), (256, 256, 256)), "fp16": ((32, 32, 32),)},
                   attention_shapes=((1, 2, 64, 32),), memory_sizes=(2**12, 2**16, 2**18),
                   elementwise_sizes=(2**12, 2**16), working_set=2**20, collective_sizes=(2**12, 2**16, 2**18),
                   gap=(64, 64, 64), min_seconds=0.002, repeats=2, timeout=120.0, quiet_wait=0.0, retries=0)


# -- timing (runs inside the rank processes) -------------------------------------------------


def _sample(fn, min_seconds: float, repeats: int) -> float:
    """Median seconds per call of `fn`, each sample looping it for at least `min_seconds`."""
    fn()
    start, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - start < min_seconds / 4:
        fn()
        calls += 1
    per_sample = max(1, round(calls * min_seconds / (time.perf_counter() - start)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_sample):
            fn()
        samples.append((time.perf_counter() - start) / per_sample)
    return statistics.median(samples)


def _dtype(name: str):
    import torch

    return getattr(torch, _DTYPES[name])


def measure_gemms(rank: int, world: int, plan: CalibrationPlan) -> dict:
    """{dtype: [(m, n, k, seconds), ...]} on this rank, every rank measuring at once.

    Each shape (m, n, k) is a linear layer's: x [m, k], W [n, k]; its forward x·Wᵀ is (m, n, k),
    the input gradient dY·W (m, k, n), the weight gradient dYᵀ·x (n, k, m), each timed. Operands
    cycle through more layers than the caches hold: in a step, a layer's weights were last
    touched a step ago.
    """
    import torch

    out = {}
    for name, shapes in plan.gemm_shapes.items():
        dtype, rows = _dtype(name), []
        for m, n, k in shapes:
            size = (m * k + n * k + m * n) * torch.empty((), dtype=dtype).element_size()
            pool = [(torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype), torch.randn(m, n, dtype=dtype))
                    for _ in range(max(2, plan.working_set // size))]
            for shape, op in (((m, n, k), lambda x, w, dy: torch.mm(x, w.t())),
                              ((m, k, n), lambda x, w, dy: torch.mm(dy, w)),
                              ((n, k, m), lambda x, w, dy: torch.mm(dy.t(), x))):
                rows.append((*shape, _sample(_cycle(pool, op), plan.min_seconds, plan.repeats)))
        out[name] = rows
    return out


def _cycle(pool: list, op):
    """A callable applying `op` to the next operands of `pool`, round and round."""
    state = {"i": 0}

    def step():
        op(*pool[state["i"] % len(pool)])
        state["i"] += 1

    return step


def measure_attention(rank: int, world: int, plan: CalibrationPlan) -> list:
    """[(batch, heads, seq, head_dim, seconds)]: causal attention forward + backward, fp32."""
    import torch
    import torch.nn.functional as F

    rows = []
    for b, h, s, d in plan.attention_shapes:
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d)

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        rows.append((b, h, s, d, _sample(step, plan.min_seconds, plan.repeats)))
    return rows


def _cycling(n: int, plan: CalibrationPlan, op):
    """`op` over enough (x, y) pairs of n fp32 elements to fill the working set, one pair per call."""
    import torch

    return _cycle([(torch.randn(n), torch.randn(n)) for _ in range(max(2, plan.working_set // (8 * n)))], op)


def measure_memory(rank: int, world: int, plan: CalibrationPlan) -> list:
    """[(bytes touched, seconds)] of `x + y` into a fresh tensor, as autograd allocates its outputs."""
    import torch

    return [(3 * 4 * n, _sample(_cycling(n, plan, torch.add), plan.min_seconds, plan.repeats))
            for n in plan.memory_sizes]


def _elementwise_ops() -> dict:
    import torch
    import torch.nn.functional as F

    width = 256  # rows of a layer's width for the row-wise kernels
    return {Elementwise.BINARY: torch.mul, Elementwise.UNARY: lambda x, y: torch.neg(x),
            Elementwise.REDUCE: lambda x, y: x.view(-1, width).sum(-1), Elementwise.SILU: lambda x, y: F.silu(x),
            Elementwise.SILU_BACKWARD: lambda x, y: torch.ops.aten.silu_backward(y, x),
            Elementwise.SOFTMAX: lambda x, y: torch.log_softmax(x.view(-1, width), -1)}


def measure_elementwise(rank: int, world: int, plan: CalibrationPlan) -> dict:
    """{kind: [(elements, seconds)]} for each eager kind, and "op_overhead": seconds per operator or node."""
    import torch

    out = {kind.value: [(n, _sample(_cycling(n, plan, op), plan.min_seconds, plan.repeats))
                        for n in plan.elementwise_sizes] for kind, op in _elementwise_ops().items()}
    x, chain = torch.randn(16, requires_grad=True), 100

    def forward_backward():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    out["op_overhead"] = _sample(forward_backward, plan.min_seconds, plan.repeats) / (2 * chain)
    return out


def _collective(kind: str, size: int, rank: int, group, group_size: int):
    """A callable issuing one collective of a `size`-byte full tensor (fp32) over `group`, as paratrain.comm does."""
    import torch
    import torch.distributed as dist

    numel = max(group_size, size // 4 // group_size * group_size)
    full, part = torch.randn(numel), torch.randn(numel // group_size)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    state = {"turn": 0}

    def send():  # pairs (2i, 2i + 1), the direction alternating as boundaries go forward then back
        sender = state["turn"] % 2
        state["turn"] += 1
        if rank % 2 == sender:
            dist.isend(full, rank ^ 1).wait()
        else:
            dist.recv(full, rank ^ 1)

    return {"all_reduce": lambda: dist.all_reduce(full, group=group),
            "all_gather": lambda: gather(full, part, group=group),
            "reduce_scatter": lambda: scatter(part, full, group=group), "send": send}[kind], numel * 4


def _pair_group(rank: int, world: int):
    """This rank's group of two, (2i, 2i + 1): every rank creates every pair's group, in order."""
    import torch.distributed as dist

    groups = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
    return groups[rank // 2]


def measure_collectives(rank: int, world: int, plan: CalibrationPlan) -> dict:
    """{kind: [(full bytes, seconds added per call)]}: loops of matmul + collective minus matmul alone.

    Collectives run over pairs of ranks (every layout of the benchmarks communicates in groups of
    two); with more ranks than `plan.nproc` the pairs run at once, time-sharing the cores. The
    cost kept is the mean over the samples, not the median: a step pays the sum of its
    collectives' costs, and on a shared host their distribution has a long tail.
    """
    import torch
    import torch.distributed as dist

    m, n, k = plan.gap
    a, b = torch.randn(m, k), torch.randn(k, n)  # about a layer's compute between two collectives
    group = _pair_group(rank, world)

    def loop(calls: int, collective=None) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
            if collective is not None:
                collective()
        return time.perf_counter() - start

    out: dict[str, list] = {}
    for kind in COLLECTIVE_KINDS:
        rows = []
        for size in plan.collective_sizes:
            op, nbytes = _collective(kind, size, rank, group, 2)
            loop(2, op)  # warm-up: connections, buffers
            added = [(loop(COLLECTIVE_CALLS, op) - loop(COLLECTIVE_CALLS)) / COLLECTIVE_CALLS
                     for _ in range(plan.repeats)]
            rows.append((nbytes, max(0.0, statistics.fmean(added))))
        out[kind] = rows
    return out


def measure_overlap(rank: int, world: int, plan: CalibrationPlan) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) summed over all-reduces of the larger sizes.

    The CPU time counts every thread of the process (the backend's too) and the kernel's copies
    for its sockets: what the collective takes from the core that compute would otherwise use.
    """
    import torch
    import torch.distributed as dist

    wall = cpu = 0.0
    for size in plan.collective_sizes[-3:]:
        tensor = torch.randn(max(1, size // 4))
        dist.all_reduce(tensor)
        for _ in range(plan.repeats):
            dist.barrier()
            start, used = time.perf_counter(), time.process_time()
            dist.all_reduce(tensor)
            wall += time.perf_counter() - start
            cpu += time.process_time() - used
    return wall, cpu


# -- fitting --------------------------------------------------------------------------------


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
    from paratrain.plan.compute import Collective

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


def fit_attention(rows: list, hardware: Hardware) -> float:
    """Median of (time the GEMM curve predicts for the attention matmuls) / (measured time)."""
    ratios = []
    for b, h, s, d, seconds in rows:
        matmuls = [Gemm(s, s, d, b * h), Gemm(s, d, s, b * h)]
        forward = sum(hardware.gemm_seconds(g.m, g.n, g.k, "fp32", g.count) for g in matmuls)
        predicted = 0.5 * forward * (2 + FLASH_BACKWARD_MATMULS) / 2  # causal: half the scores
        ratios.append(predicted / seconds)
    return statistics.median(ratios)


def _slowest_over_ranks(per_rank: list, pick) -> list:
    """Each row with the largest seconds (its last field) over the ranks: a step waits for its slowest rank."""
    rows = pick(per_rank[0])
    return [(*row[:-1], max(pick(r)[i][-1] for r in per_rank)) for i, row in enumerate(rows)]


def machine_info() -> dict:
    """Where and when: platform, processor, cores, load averages, torch version, date."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "node": platform.node(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "cores": cores, "loadavg": list(os.getloadavg()), "torch": torch.__version__}


def _shares(machine: dict, plan: CalibrationPlan) -> str:
    """Each phase's kept attempt: other processes' CPU share and the speed against the baseline probe."""
    parts = []
    for name, attempts in (machine.get("conditions") or {}).items():
        kept = min(attempts, key=lambda a: Conditions(**a).off(plan.max_foreign, plan.max_drift))
        foreign = "n/a" if kept["foreign"] is None else f"{kept['foreign']:.0%}"
        parts.append(f"{name} {foreign}/{kept['speed']:.2f} ({len(attempts)})")
    return ", ".join(parts) or "n/a"


def _physical_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def build_profile(measured: dict, plan: CalibrationPlan, machine: dict, name: str = "cpu") -> Hardware:
    """The profile from the measurements (`calibrate`'s rank results, medians over ranks)."""
    peaks, curves = {}, {}
    for dtype in ("fp32", "bf16", "fp16"):
        rows = measured["gemm"].get(dtype) or measured["gemm"]["fp32"]
        peaks[dtype], curves[dtype] = fit_gemm_curve(rows)
    memory_curve = tuple((float(b), b / s) for b, s in measured["memory"])
    links = {kind: fit_link(kind, 2, rows) for kind, rows in measured["collectives"].items()}
    shared = {kind: fit_link(kind, 2, rows) for kind, rows in measured["collectives_shared"].items()}
    elementwise = {kind: tuple((float(n), n / s) for n, s in rows)
                   for kind, rows in measured["elementwise"].items() if kind != "op_overhead"}
    wall, cpu = measured["overlap"]
    cores = int(machine["cores"])
    base = Hardware(
        name=name, memory_bytes=_physical_memory(), peak_bf16=peaks["bf16"], peak_fp16=peaks["fp16"],
        peak_fp32=peaks["fp32"], hbm_bytes_per_s=memory_curve[-1][1],
        intra_node_bytes_per_s=links["all_reduce"].bytes_per_s, inter_node_bytes_per_s=links["all_reduce"].bytes_per_s,
        gpus_per_node=cores, intra_node_latency_s=links["all_reduce"].latency_s,
        inter_node_latency_s=links["all_reduce"].latency_s, gemm_bf16=curves["bf16"], gemm_fp16=curves["fp16"],
        gemm_fp32=curves["fp32"], memory_efficiency=1.0, memory_curve=memory_curve, elementwise=elementwise,
        op_overhead_s=measured["elementwise"]["op_overhead"], link_efficiency=1.0, collectives=links,
        collectives_shared=shared, comm_overlap=min(1.0, max(0.0, 1.0 - cpu / wall)),
        host_cores=cores,
        source=(f"paratrain plan --calibrate on {machine['node']} ({machine['processor']}, {cores} cores, "
                f"torch {machine['torch']}), {plan.nproc} ranks, {machine['date']}, load average "
                f"{machine['loadavg'][0]:.2f}; per phase other processes' CPU share / speed against the best probe "
                f"(attempts): {_shares(machine, plan)}"))
    return dataclasses.replace(base, attention_efficiency=fit_attention(measured["attention"], base))


# name: (measurement, ranks as a multiple of plan.nproc)
_PHASES = {"gemm": (measure_gemms, 1), "attention": (measure_attention, 1), "memory": (measure_memory, 1),
           "elementwise": (measure_elementwise, 1), "collectives": (measure_collectives, 1),
           "collectives_shared": (measure_collectives, 2), "overlap": (measure_overlap, 1)}


def run_phase(rank: int, world: int, name: str, plan: CalibrationPlan):
    """One phase on this rank: (result, the foreign CPU share on rank 0, this rank's slower probe)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    before = matmul_probe()
    window = CpuWindow().start() if rank == 0 else None
    cpu = time.process_time()
    result = _PHASES[name][0](rank, world, plan)
    own = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(own)  # every rank's CPU seconds, and the end of the window
    foreign = window.stop(own.item()) if window is not None else None
    return result, foreign, min(before, matmul_probe())


def _measure_phase(name: str, plan: CalibrationPlan, baseline: float) -> tuple[list, list]:
    """(per-rank results of the attempt closest to the baseline conditions, every attempt's Conditions)."""
    from paratrain.testing import RankError, run_on_ranks

    attempts = []
    ranks = plan.nproc * _PHASES[name][1]
    for _ in range(1 + plan.retries):
        wait_until_quiet(plan.quiet_cpu, plan.quiet_wait)
        try:
            per_rank = run_on_ranks(run_phase, ranks, name, plan, timeout=plan.timeout)
        except RankError as e:
            raise CalibrationError(f"calibration step {name!r} failed: {str(e).splitlines()[0]}") from None
        speed = sum(r[2] for r in per_rank) / baseline
        attempts.append(([r[0] for r in per_rank], Conditions(per_rank[0][1], speed)))
        if attempts[-1][1].off(plan.max_foreign, plan.max_drift) == 0:
            break
    best = min(attempts, key=lambda a: a[1].off(plan.max_foreign, plan.max_drift))
    return best[0], [dataclasses.asdict(a[1]) for a in attempts]


def calibrate(plan: CalibrationPlan = CalibrationPlan(), progress: bool = True) -> tuple[Hardware, dict]:
    """Measure this machine on `plan.nproc` ranks; return (profile, raw measurements with machine info)."""
    machine = machine_info()
    wait_until_quiet(plan.quiet_cpu, plan.quiet_wait)
    baseline = machine_speed(plan.nproc, plan.timeout)
    machine["probe_flops"] = baseline
    measured: dict = {}
    conditions: dict = {}
    bar = _progress(len(_PHASES), progress)
    for name in _PHASES:
        bar.set_description(f"calibrating: {name}")
        per_rank, conditions[name] = _measure_phase(name, plan, baseline)
        measured[name] = _reduce(name, per_rank)
        bar.update(1)
    bar.close()
    machine["loadavg_end"] = list(os.getloadavg())
    machine["conditions"] = conditions
    return build_profile(measured, plan, machine), {"machine": machine, "measured": measured}


def _reduce(name: str, per_rank: list):
    """The slowest rank's seconds per measurement; for the overlap, the rank whose collectives took most CPU."""
    if name == "overlap":
        return max(per_rank, key=lambda r: r[1] / r[0])
    if name == "elementwise":
        rows = {kind: _slowest_over_ranks(per_rank, lambda r, k=kind: r[k])
                for kind in per_rank[0] if kind != "op_overhead"}
        return {**rows, "op_overhead": max(r["op_overhead"] for r in per_rank)}
    if name in ("gemm", "collectives", "collectives_shared"):
        return {key: _slowest_over_ranks(per_rank, lambda r, k=key: r[k]) for key in per_rank[0]}
    return _slowest_over_ranks(per_rank, lambda r: r)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="phase", leave=False)
