"""`paratrain plan --calibrate`'s measurements: what runs inside each rank process.

Every function here times one kind of operation on the rank's device (`CalibrationPlan.device`:
the CPU, or this rank's GPU) and returns plain numbers. On a GPU each timing waits for the
device before reading the clock (`device_sync`): kernels run after the host queued them, so a
clock read without the wait would time the launches.
"""

from __future__ import annotations

import os
import statistics
import time

from paratrain.plan.hardware import COLLECTIVE_KINDS, Elementwise

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
COLLECTIVE_CALLS = 12  # calls per timed loop of matmul + collective


def _device(plan):
    """This rank's device: its GPU (LOCAL_RANK) on CUDA, else the CPU."""
    import torch

    if plan.device != "cuda":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _no_sync() -> None:
    """A CPU's operations are done when they return: nothing to wait for."""


def device_sync(device: str):
    """What waits for `device`'s queued work: a GPU runs kernels after the host has moved on."""
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return _no_sync


def _sample(fn, min_seconds: float, repeats: int, sync=_no_sync) -> float:
    """Median seconds per call of `fn`, each sample looping it for at least `min_seconds`.

    `sync` waits for the device (`device_sync`) before each clock reading, so that a sample times
    the kernels its calls queued, not the host's launches.
    """
    fn()
    sync()
    start, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - start < min_seconds / 4:
        fn()
        sync()
        calls += 1
    per_sample = max(1, round(calls * min_seconds / (time.perf_counter() - start)))
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(per_sample):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / per_sample)
    return statistics.median(samples)


def _dtype(name: str):
    import torch

    return getattr(torch, _DTYPES[name])


def measure_gemms(rank: int, world: int, plan) -> dict:
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
            pool = [tuple(torch.randn(*shape, dtype=dtype, device=_device(plan)) for shape in ((m, k), (n, k), (m, n)))
                    for _ in range(max(2, plan.working_set // size))]
            for shape, op in (((m, n, k), lambda x, w, dy: torch.mm(x, w.t())),
                              ((m, k, n), lambda x, w, dy: torch.mm(dy, w)),
                              ((n, k, m), lambda x, w, dy: torch.mm(dy.t(), x))):
                seconds = _sample(_cycle(pool, op), plan.min_seconds, plan.repeats, device_sync(plan.device))
                rows.append((*shape, seconds))
        out[name] = rows
    return out


def _cycle(pool: list, op):
    """A callable applying `op` to the next operands of `pool`, round and round."""
    state = {"i": 0}

    def step():
        op(*pool[state["i"] % len(pool)])
        state["i"] += 1

    return step


def measure_attention(rank: int, world: int, plan) -> list:
    """[(batch, heads, seq, head_dim, seconds)]: causal attention forward + backward in `plan.attention_dtype`."""
    import torch
    import torch.nn.functional as F

    rows = []
    for b, h, s, d in plan.attention_shapes:
        dtype, device = _dtype(plan.attention_dtype), _device(plan)
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, dtype=dtype, device=device)

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        rows.append((b, h, s, d, _sample(step, plan.min_seconds, plan.repeats, device_sync(plan.device))))
    return rows


def _cycling(n: int, plan, op):
    """`op` over enough (x, y) pairs of n fp32 elements to fill the working set, one pair per call."""
    import torch

    device = _device(plan)
    return _cycle([(torch.randn(n, device=device), torch.randn(n, device=device))
                   for _ in range(max(2, plan.working_set // (8 * n)))], op)


def measure_memory(rank: int, world: int, plan) -> list:
    """[(bytes touched, seconds)] of `x + y` into a fresh tensor, as autograd allocates its outputs."""
    import torch

    return [(3 * 4 * n, _sample(_cycling(n, plan, torch.add), plan.min_seconds, plan.repeats, device_sync(plan.device)))
            for n in plan.memory_sizes]


def _elementwise_ops() -> dict:
    import torch
    import torch.nn.functional as F

    width = 256  # rows of a layer's width for the row-wise kernels
    return {Elementwise.BINARY: torch.mul, Elementwise.UNARY: lambda x, y: torch.neg(x),
            Elementwise.REDUCE: lambda x, y: x.view(-1, width).sum(-1), Elementwise.SILU: lambda x, y: F.silu(x),
            Elementwise.SILU_BACKWARD: lambda x, y: torch.ops.aten.silu_backward(y, x),
            Elementwise.SOFTMAX: lambda x, y: torch.log_softmax(x.view(-1, width), -1)}


def measure_elementwise(rank: int, world: int, plan) -> dict:
    """{kind: [(elements, seconds)]} for each eager kind, and "op_overhead": seconds per operator or node."""
    import torch

    sync = device_sync(plan.device)
    out = {kind.value: [(n, _sample(_cycling(n, plan, op), plan.min_seconds, plan.repeats, sync))
                        for n in plan.elementwise_sizes] for kind, op in _elementwise_ops().items()}
    x, chain = torch.randn(16, device=_device(plan), requires_grad=True), 100

    def forward_backward():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    if plan.device == "cuda":
        out["op_overhead"] = _kernel_gap(x.detach(), chain, plan)
    else:
        out["op_overhead"] = _sample(forward_backward, plan.min_seconds, plan.repeats, sync) / (2 * chain)
    return out


def _kernel_gap(x, chain: int, plan) -> float:
    """Seconds per kernel of a chain of `chain` tiny dependent kernels on the GPU, replayed from a CUDA graph.

    A training step's kernels are large enough that the host queues them ahead of the device, so an
    eager step pays the device's gap between kernels per operator; a host-timed chain of tiny ops
    would time the launches instead (14.5 µs per op on an H200, against the ~1 µs the device pays).
    """
    import torch

    def run():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    side = torch.cuda.Stream()  # graph capture wants its warm-up off the default stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return _sample(graph.replay, plan.min_seconds, plan.repeats, device_sync("cuda")) / chain


# A reference model small enough that its kernels take less than their launches (the device keeps up with the
# host), with the blocks of a Llama: what the host does per operator is what it does for a large one.
HOST_MODEL = dict(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
# name: (ZeRO stage, recomputation): the planner's host costs are fitted from the differences (`fit.fit_host`)
HOST_VARIANTS = {"none": (0, "none"), "full": (0, "full"), "selective": (0, "selective"), "zero3": (3, "none")}


def measure_host_ops(rank: int, world: int, plan) -> dict:
    """{variant: (forward seconds, backward seconds)} of the host's work for paratrain's reference model
    (`HOST_MODEL`, bf16) in eager mode, each variant of `HOST_VARIANTS` through `parallelize` on a mesh of this
    rank alone (no collective: ZeRO-3's hooks gather by copies); "layers": its blocks.

    The clock is read without waiting for the device (`_host_step`): on a GPU the kernels of this model take
    less than their launches, so the time is the host's issuing them; on a CPU host and kernels are one. The
    variants take turns, sample by sample, so that a busy moment of the machine falls on all of them alike
    (the costs are fitted from their differences); each keeps its median.
    """
    import torch

    from paratrain.mesh import Mesh, MeshShape
    from paratrain.models.configs import ModelConfig
    from paratrain.models.llama import Transformer
    from paratrain.parallel.api import DataParallel, parallelize

    device, cfg = _device(plan), ModelConfig(**HOST_MODEL)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len + 1), device=device)
    models = {}
    for name, (zero, recompute) in HOST_VARIANTS.items():
        with torch.device("meta"):
            model = Transformer(cfg)
        models[name], _ = parallelize(model, Mesh(shape=MeshShape(), rank=0, groups={}, device=device),
                                      data=DataParallel(zero=zero), activation_checkpointing=recompute,
                                      precision="bf16")
    sync, samples = device_sync(plan.device), {name: [] for name in models}
    for turn in range(2 + max(5, 3 * plan.repeats)):  # two warm-ups: the allocator, the first policy calls
        for name, model in models.items():
            seconds = _host_step(model, tokens[:, :-1], tokens[:, 1:], sync)
            if turn >= 2:
                samples[name].append(seconds)
    medians = {name: (statistics.median(f for f, _ in rows), statistics.median(b for _, b in rows))
               for name, rows in samples.items()}
    return {"layers": cfg.n_layers, **medians}


def _host_step(model, x, y, sync) -> tuple[float, float]:
    """Host seconds of `model`'s forward with the loss, and of its backward: the device is waited for before
    the step, never inside it (a CUDA backward returns once its kernels are queued)."""
    import torch.nn.functional as F

    sync()
    start = time.perf_counter()
    loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    middle = time.perf_counter()
    loss.backward()
    return middle - start, time.perf_counter() - middle


def _collective(kind: str, size: int, rank: int, group, group_size: int, device: str = "cpu"):
    """A callable issuing one collective of a `size`-byte full tensor (fp32) over `group`, as paratrain.comm does."""
    import torch
    import torch.distributed as dist

    numel = max(group_size, size // 4 // group_size * group_size)
    full, part = torch.randn(numel, device=device), torch.randn(numel // group_size, device=device)
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


def _pair_group(rank: int, world: int, device: str = "cpu"):
    """This rank's group of two, (2i, 2i + 1): every rank creates every pair's group, in order (NCCL on GPUs)."""
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else None
    groups = [dist.new_group([r, r + 1], backend=backend) for r in range(0, world - 1, 2)]
    return groups[rank // 2]


def measure_collectives(rank: int, world: int, plan) -> dict:
    """{kind: [(full bytes, seconds added per call)]}: loops of matmul + collective minus matmul alone.

    Collectives run over pairs of ranks (every layout of the benchmarks communicates in groups of
    two); with more ranks than `plan.nproc` the pairs run at once, time-sharing the cores. The
    cost kept is the mean over the samples, not the median: a step pays the sum of its
    collectives' costs, and on a shared host their distribution has a long tail.
    """
    import torch
    import torch.distributed as dist

    m, n, k = plan.gap
    device, sync = _device(plan), device_sync(plan.device)
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)  # about a layer's compute
    group = _pair_group(rank, world, plan.device)

    def loop(calls: int, collective=None) -> float:
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
            if collective is not None:
                collective()
        sync()
        return time.perf_counter() - start

    out: dict[str, list] = {}
    for kind in COLLECTIVE_KINDS:
        rows = []
        for size in plan.collective_sizes:
            op, nbytes = _collective(kind, size, rank, group, 2, device)
            loop(2, op)  # warm-up: connections, buffers
            added = [(loop(COLLECTIVE_CALLS, op) - loop(COLLECTIVE_CALLS)) / COLLECTIVE_CALLS
                     for _ in range(plan.repeats)]
            rows.append((nbytes, max(0.0, statistics.fmean(added))))
        out[kind] = rows
    return out


def measure_overlap(rank: int, world: int, plan) -> tuple[float, float]:
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


HOST_STEP_BYTES = 28  # fused AdamW per parameter: the gradient read, the master and the two moments read and written


def measure_host(rank: int, world: int, plan) -> dict:
    """The offloaded step's pieces on this rank (`paratrain.parallel.data.offload`): torch's fused CPU AdamW over
    `plan.host_params` fp32 parameters with this rank's share of the host's cores, every rank stepping at once
    ("adamw": bytes/s of its memory traffic); on a GPU also its pinned copies of `plan.copy_bytes` each way
    ("d2h", "h2d": bytes/s)."""
    import torch

    device = _device(plan)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    params = [torch.nn.Parameter(torch.randn(plan.host_params // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, cores // world))
    try:
        seconds = _sample(optimizer.step, plan.min_seconds, plan.repeats)
    finally:
        torch.set_num_threads(before)
    out = {"adamw": HOST_STEP_BYTES * sum(p.numel() for p in params) / seconds}
    if device.type == "cuda":
        n = plan.copy_bytes // 4
        on_device, host = torch.empty(n, device=device), torch.empty(n, device="cpu", pin_memory=True)
        sync = device_sync("cuda")
        out["d2h"] = 4 * n / _sample(lambda: host.copy_(on_device, non_blocking=True), plan.min_seconds, plan.repeats, sync)
        out["h2d"] = 4 * n / _sample(lambda: on_device.copy_(host, non_blocking=True), plan.min_seconds, plan.repeats, sync)
    return out
