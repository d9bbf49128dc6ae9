"""Muon on any layout: every matrix orthogonalized whole, on one rank, exactly as `torch.optim.Muon` does it.

Muon's update of a matrix is not element-wise: after the momentum (element-wise), the
Newton–Schulz iteration (`torch.optim.Muon`: quintic (3.4445, −4.7750, 2.0315), 5 steps, in bf16)
runs on the whole 2-D update. Every layout but DDP hands a rank only a piece of some matrices
(ZeRO-1/2/3: rows over the data axis; tensor parallelism: columns or rows over tp), and DDP
repeats the same work on every rank. So a step here runs in five parts:

1. momentum and the Nesterov update on the pieces each rank holds (element-wise, on the masters: the
   momentum buffer has the master's shape, so checkpoints keep it layout-free as Adam's moments);
2. each whole matrix gathered on its *owner*, one rank among those holding it: the owners are chosen
   once, largest matrix first onto the least loaded rank (Newton–Schulz FLOPs), so a rank's share is
   at most the average plus one matrix;
3. the owner runs torch's own Newton–Schulz iteration on it (`paratrain.compat.muon_orthogonalize`);
4. the result sent back, each rank getting the rows of the pieces it holds;
5. each rank applies torch's update to its pieces: decoupled weight decay, then the orthogonalized
   update times the learning rate `adjust_lr_fn` gives for the whole matrix's shape.

What travels (bf16: the iteration's first act is to round the update to bf16, so sending the rounded
pieces changes nothing), per matrix of M elements held by the ranks of an axis of N ranks:

* DDP (every rank whole): nothing to gather; the owner sends the result to the N−1 others (2M(N−1) bytes).
* ZeRO-1/2/3 (rows over the shard group): the owner receives the N−1 other pieces and sends each its
  rows back: 2·2M(N−1)/N bytes; under hybrid sharding the replicas get their rows from the owner too.
* tensor parallelism: the tp slices take a second hop over tp (to the owner's tp coordinate and back),
  after the data axis's (to the owner's data coordinate) and before its return.
* pipeline parallelism: each stage's matrices among the ranks of that stage (nothing over pp).
* expert parallelism: each expert's [a, b] matrix of a stacked [experts, a, b] tensor is one matrix,
  held whole by the ranks of its block (the `ep_replicate` axis, and every tp rank): ZeRO splits the
  stack by experts, so a matrix is never split; the owner is one of its holders.

Each hop is one `Comm.exchange` per axis (counted per axis in the step's bytes).

Under offload (`paratrain.parallel.data.offload`) the masters, and so the momentum buffers and the AdamW state,
live on the host, and the optimizer steps in the caller's thread after each master's gradient reached its host
buffer (`HostMasters.gradients_to_host`; Muon is not one of the optimizers the overlapped host step runs, since
the exchange is collective). Parts 1 and 5 then run on the host and parts 2–4 on the device: each rank's bf16
update is written into a host staging buffer (pinned on CUDA, one per matrix master: `HostUpdates`) and copied
to the device with `non_blocking`, the exchanges and the Newton–Schulz iteration run there, and each rank's
orthogonalized rows come back into the same staging buffer (queued behind the iteration on the current stream,
after the copy out that read it), waited for once before the host applies them. The rounding to bf16 is the
same on either side, so the update is the one without offload.

The optimizer here is a `torch.optim.Optimizer` whose groups say their algorithm: "muon" groups carry
torch.optim.Muon's hyperparameters under its names, "adamw" groups torch.optim.AdamW's and are stepped
by a stock `torch.optim.AdamW` sharing the same groups and state. `parallelize` builds it for a
`torch.optim.Muon` factory (all masters matrices) or a `MuonRecipe` (Muon for the blocks' matrices,
AdamW for the rest: embeddings, head, norms, biases).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.compat import muon_adjusted_lr, muon_class, muon_orthogonalize
from paratrain.errors import ParatrainError
from paratrain.mesh import Axis
from paratrain.parallel.data.offload import host_tensors
from paratrain.parallel.rules import newton_schulz_flops


class MuonConfigError(ParatrainError, ValueError):
    """Muon asked of what it cannot step, or with an option the installed torch's Muon lacks."""


# -- where the matrices are ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Matrix:
    """One whole matrix Muon orthogonalizes, and where its pieces are."""

    master: int  # index of its master in the model's `masters()`
    expert: int | None  # its row of a stacked [experts, a, b] master on this rank (None: the master is 2-D)
    shape: tuple[int, int]  # the whole matrix (over tp)
    local: tuple[int, int]  # each tp rank's slice (the whole matrix when tp does not split it)
    tp_dim: int | None  # the dim tp splits (None: every tp rank holds it whole)
    axis: Axis  # the ranks holding pieces or copies of the tp-local slice: the data axis, or an expert block's
    rows: tuple[tuple[int, int], ...]  # per rank of `axis`: the rows of the tp-local slice it holds ((0, 0): none)
    owner: tuple[int, int] = (0, 0)  # (index on `axis`, index on tp) of the rank that orthogonalizes it

    @property
    def flops(self) -> int:
        """FLOPs of one Newton–Schulz step on it (what the owners are balanced by)."""
        return newton_schulz_flops(self.shape, 1)


def find_matrices(model, comm: Comm, indices: list[int]) -> list[Matrix]:
    """The matrices of the masters at `indices` (2-D, or stacked experts), their pieces, and their owners.

    Collective over the data axis (and the expert blocks' axis): each rank's rows of every master are
    gathered once, so every rank knows every piece and all choose the same owners."""
    mesh = comm.mesh
    rows = model.master_rows()
    experts = model.expert_info.names if model.expert_info is not None else set()
    tp_split = model.tp_info.sharded if model.tp_info is not None else {}
    axes = {False: mesh.data_axis, True: Axis.EP_REPLICATE}  # an expert block's copies are over its replicas
    gathered = {expert: _gather_rows(comm, axes[expert], rows) for expert in {rows[i][0] in experts for i in indices}}
    families: dict[bool, list[Matrix]] = {False: [], True: []}
    for i in indices:
        name, (lo, hi), local = rows[i]
        expert = name in experts
        held = gathered[expert][:, i].tolist()
        if len(local) == 3:  # stacked experts: ZeRO splits the stack by experts, so each matrix is whole somewhere
            families[expert] += [Matrix(i, e - lo if lo <= e < hi else None, tuple(local[1:]), tuple(local[1:]),
                                        None, axes[expert],
                                        tuple((0, local[1]) if a <= e < b else (0, 0) for a, b in held))
                                 for e in range(local[0])]
            continue
        whole = list(local)
        dim = tp_split.get(name)
        if dim is not None:
            whole[dim] *= mesh.size(Axis.TP)
        families[expert].append(Matrix(i, None, tuple(whole), tuple(local), dim, axes[expert], tuple(map(tuple, held))))
    tp = mesh.size(Axis.TP)
    return [m for family in families.values() for m in _assign_owners(family, tp)]


def _gather_rows(comm: Comm, axis: Axis, rows) -> torch.Tensor:
    """[ranks of `axis`, masters, 2]: the rows [lo, hi) every rank of `axis` holds of each master."""
    own = torch.tensor([list(r) for _, r, _ in rows], dtype=torch.int64, device=comm.mesh.device).reshape(-1, 2)
    n = comm.mesh.size(axis)
    out = torch.empty((n * own.shape[0], 2), dtype=own.dtype, device=own.device)
    comm.all_gather(out, own, axis)
    return out.view(n, -1, 2).cpu()


def _assign_owners(matrices: list[Matrix], tp: int) -> list[Matrix]:
    """Each matrix an owner: largest first onto the least loaded (axis, tp) rank among those that may own it (any
    rank of the axis for a split matrix, which is gathered anyway; for a whole one, a rank holding it)."""
    load: dict[tuple[int, int], int] = {}
    owners: dict[int, tuple[int, int]] = {}
    for k in sorted(range(len(matrices)), key=lambda k: (-matrices[k].flops, k)):
        m = matrices[k]
        whole = [j for j, (a, b) in enumerate(m.rows) if b - a == m.local[0]]
        holders = whole or [j for j, (a, b) in enumerate(m.rows) if b > a]
        owner = min(((j, t) for j in holders for t in range(tp)), key=lambda c: (load.get(c, 0), c))
        load[owner] = load.get(owner, 0) + m.flops
        owners[k] = owner
    return [_with_owner(m, owners[k]) for k, m in enumerate(matrices)]


def _with_owner(m: Matrix, owner: tuple[int, int]) -> Matrix:
    return dataclasses.replace(m, owner=owner)


# -- the step ---------------------------------------------------------------------------------------------

@dataclass
class _Hop:
    """The sends and receives of one exchange over one axis, and what to do with each receive."""

    sends: list = field(default_factory=list)
    receives: list = field(default_factory=list)


class Muon(torch.optim.Optimizer):
    """`torch.optim.Muon` (groups with "algorithm": "muon") and `torch.optim.AdamW` (the others) on a parallel
    model's masters, each matrix orthogonalized whole on one rank (see the module's docstring)."""

    def __init__(self, groups: list[dict], model, comm: Comm):
        super().__init__(groups, {})
        self.model, self.comm = model, comm
        self._index = {id(m): i for i, m in enumerate(model.masters())}
        adamw = [g for g in self.param_groups if g["algorithm"] == "adamw"]
        self._adamw = torch.optim.AdamW(adamw) if adamw else None
        self._link()
        muon = [self._index[id(p)] for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        self.matrices = find_matrices(model, comm, muon)
        self.ns_flops = 0  # Newton–Schulz FLOPs this rank ran, over every step so far
        masters = model.masters()
        # Offloaded: the masters are on the host, the iteration on the device (see the module's docstring).
        self.host = HostUpdates({i: masters[i].shape for i in muon}, comm.mesh.device,
                                model.offload.pinned) if model.offload is not None else None

    def _link(self) -> None:
        """The AdamW groups' stepper shares this optimizer's groups and state (after a load replaced them)."""
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if g["algorithm"] == "adamw"]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.step()
        self._muon_step()
        return loss

    def _muon_step(self) -> None:
        masters = self.model.masters()
        group_of = {self._index[id(p)]: g for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]}
        updates = {}
        for i, group in group_of.items():
            grad = masters[i].grad
            if grad is None:
                continue
            state = self.state[masters[i]]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            updates[i] = update.bfloat16() if self.host is None else self.host.to_device(i, update)
        matrices = [m for m in self.matrices if m.master in updates]
        whole = self._gather(matrices, updates)
        results = {}
        for k, value in whole.items():
            group = group_of[matrices[k].master]
            results[k] = muon_orthogonalize(value, group["ns_coefficients"], group["ns_steps"], group["eps"])
            results[k] = results[k].contiguous()
            self.ns_flops += newton_schulz_flops(value.shape, group["ns_steps"])
        pieces = self._scatter(matrices, results)
        if self.host is not None:
            pieces = self.host.to_host(pieces, matrices)
        for k, piece in pieces.items():
            m = matrices[k]
            group = group_of[m.master]
            param = masters[m.master] if m.expert is None else masters[m.master][m.expert]
            lr = group["lr"]
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(piece, alpha=-muon_adjusted_lr(lr, group["adjust_lr_fn"], torch.Size(m.shape)))

    def _coords(self, m: Matrix) -> tuple[int, int]:
        mesh = self.comm.mesh
        return mesh.coord(m.axis), mesh.coord(Axis.TP)

    def _own_piece(self, m: Matrix, updates) -> torch.Tensor:
        value = updates[m.master]
        return value if m.expert is None else value[m.expert]

    def _gather(self, matrices: list[Matrix], updates) -> dict[int, torch.Tensor]:
        """{index in `matrices`: the whole update} for the matrices this rank owns: first each tp-local slice
        assembled at the owner's coordinate on the data axis (in every tp column that holds a distinct slice),
        then the slices at the owner over tp."""
        hops: dict[Axis, _Hop] = {}
        local: dict[int, torch.Tensor] = {}
        fills = []
        for k, m in enumerate(matrices):
            j, t = self._coords(m)
            jo, to = m.owner
            if m.tp_dim is None and t != to:
                continue  # a copy of what the owner's tp column gathers
            mine = m.rows[j]
            distinct = _sources(m.rows)
            if j != jo:
                if distinct.get(mine) == j and mine != m.rows[jo] and mine[1] > mine[0]:
                    hops.setdefault(m.axis, _Hop()).sends.append((self._own_piece(m, updates), jo))
                continue
            if mine == (0, m.local[0]):
                local[k] = self._own_piece(m, updates)
                continue
            buffer = torch.empty(m.local, dtype=torch.bfloat16, device=self.comm.mesh.device)
            if mine[1] > mine[0]:
                fills.append((buffer[mine[0]:mine[1]], self._own_piece(m, updates)))
            for (a, b), src in distinct.items():
                if (a, b) != mine and b > a:
                    hops.setdefault(m.axis, _Hop()).receives.append((buffer[a:b], src))
            local[k] = buffer
        self._run(hops)
        for dst, src in fills:
            dst.copy_(src)
        whole = {}
        tp_hop = _Hop()
        for k, m in enumerate(matrices):
            j, t = self._coords(m)
            jo, to = m.owner
            if j != jo or k not in local:
                continue
            if m.tp_dim is None:
                whole[k] = local[k]
            elif t != to:
                tp_hop.sends.append((local[k].contiguous(), to))
            else:
                slices = [local[k] if s == to else torch.empty(m.local, dtype=torch.bfloat16, device=local[k].device)
                          for s in range(self.comm.mesh.size(Axis.TP))]
                tp_hop.receives += [(slices[s], s) for s in range(len(slices)) if s != to]
                whole[k] = slices
        self._run({Axis.TP: tp_hop})
        return {k: torch.cat(v, dim=matrices[k].tp_dim) if isinstance(v, list) else v for k, v in whole.items()}

    def _scatter(self, matrices: list[Matrix], results: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{index in `matrices`: this rank's piece of the orthogonalized update}: from the owner over tp (each tp
        coordinate its slice, or the whole), then over the data axis (each rank its rows)."""
        device = self.comm.mesh.device
        tp = self.comm.mesh.size(Axis.TP)
        tp_hop = _Hop()
        local: dict[int, torch.Tensor] = {}
        for k, m in enumerate(matrices):
            j, t = self._coords(m)
            jo, to = m.owner
            if j != jo:
                continue
            if t == to:
                whole = results[k]
                slices = whole.chunk(tp, dim=m.tp_dim) if m.tp_dim is not None else [whole] * tp
                tp_hop.sends += [(slices[s].contiguous(), s) for s in range(tp) if s != to]
                local[k] = slices[to].contiguous() if m.tp_dim is not None else whole
            else:
                local[k] = torch.empty(m.local, dtype=torch.bfloat16, device=device)
                tp_hop.receives.append((local[k], to))
        self._run({Axis.TP: tp_hop})
        hops: dict[Axis, _Hop] = {}
        pieces = {}
        for k, m in enumerate(matrices):
            j, _ = self._coords(m)
            jo, _ = m.owner
            a, b = m.rows[j]
            if j == jo:
                for r, (lo, hi) in enumerate(m.rows):
                    if r != jo and hi > lo:
                        hops.setdefault(m.axis, _Hop()).sends.append((local[k][lo:hi], r))
                if b > a:
                    pieces[k] = local[k][a:b]
            elif b > a:
                pieces[k] = torch.empty((b - a, m.local[1]), dtype=torch.bfloat16, device=device)
                hops.setdefault(m.axis, _Hop()).receives.append((pieces[k], jo))
        self._run(hops)
        return pieces

    def _run(self, hops: dict[Axis, _Hop]) -> None:
        for axis, hop in hops.items():
            if hop.sends or hop.receives:
                self.comm.exchange(hop.sends, hop.receives, axis)


def _sources(rows: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], int]:
    """Each distinct row range held, and the first rank of the axis holding it (the one that sends it)."""
    sources: dict[tuple[int, int], int] = {}
    for j, r in enumerate(rows):
        sources.setdefault(r, j)
    return sources


class HostUpdates:
    """Offload: the bf16 updates' way from the host masters to the device that orthogonalizes them and back, through
    one host staging buffer per matrix master, of the master's shape (pinned where the host masters are)."""

    def __init__(self, shapes: dict[int, torch.Size], device: torch.device, pinned: bool):
        self.device, self.pinned = device, pinned
        self.buffers = dict(zip(shapes, host_tensors(list(shapes.values()), torch.bfloat16, pinned)))

    def to_device(self, i: int, update: torch.Tensor) -> torch.Tensor:
        """The host `update` of master `i` rounded to bf16 into its buffer and copied to the device (queued on the
        current stream: the buffer is written again only after `to_host` waited for that stream)."""
        buffer = self.buffers[i]
        buffer.copy_(update)  # (the same round to nearest even as `.bfloat16()`)
        out = torch.empty(buffer.shape, dtype=buffer.dtype, device=self.device)
        return out.copy_(buffer, non_blocking=self.pinned)

    def to_host(self, pieces: dict[int, torch.Tensor], matrices: list[Matrix]) -> dict[int, torch.Tensor]:
        """The device's orthogonalized `pieces` into the buffers (the rows this rank holds: its master's shape, or
        one expert's matrix of it), queued behind the iteration and waited for once."""
        out = {}
        for k, piece in pieces.items():
            m = matrices[k]
            buffer = self.buffers[m.master] if m.expert is None else self.buffers[m.master][m.expert]
            out[k] = buffer.copy_(piece, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()  # the host reads them next
        return out

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


# -- what builds it ---------------------------------------------------------------------------------------

# The recipe's Muon defaults: torch.optim.Muon's (momentum 0.95, Nesterov, the Newton–Schulz coefficients
# (3.4445, −4.7750, 2.0315) and 5 steps, eps 1e-7, weight decay 0.1, adjust_lr_fn "original": √max(1, A/B)), which
# are Keller Jordan's (kellerjordan.github.io/posts/muon) but for the learning rate: his 0.02 (modded-nanogpt's and
# the Muon repository's default for hidden matrices) where torch leaves 1e-3.
MUON_DEFAULTS = {"lr": 0.02}


@dataclass(frozen=True)
class MuonRecipe:
    """Muon for the matrices of the model's blocks, AdamW for the rest: the split every Muon user runs.

    Muon steps the 2-D weights inside the blocks (`paratrain.parallel.blocks`: the entries of the model's
    ModuleLists, the reference model's `layers`, a Hugging Face model's decoder layers) and, of a stacked MoE
    tensor [experts, a, b], each expert's matrix; AdamW steps the embeddings, the head, the norms and the
    biases (matrices outside the blocks with `adamw["weight_decay"]`, vectors without weight decay, as the
    trainer's AdamW). `muon`: torch.optim.Muon's options (over `MUON_DEFAULTS`); `adamw`: torch.optim.AdamW's.
    """

    muon: dict = field(default_factory=dict)
    adamw: dict = field(default_factory=dict)
    lr_scale: float | None = None  # a schedule's factor from the AdamW learning rate to Muon's (the trainer's)

    def __post_init__(self):
        check_muon_options(self.muon)

    def build(self, model, comm: Comm) -> Muon:
        blocks = [name + "." for name, _ in _blocks(model.module)]
        names = [name for name, _, _ in model.master_rows()]
        masters = model.masters()
        is_matrix = [len(shape) >= 2 and any(n.startswith(b) for b in blocks)
                     for n, (_, _, shape) in zip(names, model.master_rows())]
        muon = {**_torch_muon_defaults(), **MUON_DEFAULTS, **self.muon, "algorithm": "muon"}
        if self.lr_scale is not None:
            muon["lr_scale"] = self.lr_scale
        adamw = {k: v for k, v in self.adamw.items() if k != "weight_decay"}
        decay = self.adamw.get("weight_decay", 0.01)
        rest = [(m, len(s) >= 2) for m, (_, _, s), matrix in zip(masters, model.master_rows(), is_matrix) if not matrix]
        groups = [{"params": [m for m, matrix in zip(masters, is_matrix) if matrix], **muon},
                  {"params": [m for m, two_d in rest if two_d], "weight_decay": decay, "algorithm": "adamw", **adamw},
                  {"params": [m for m, two_d in rest if not two_d], "weight_decay": 0.0, "algorithm": "adamw", **adamw}]
        return Muon([g for g in groups if g["params"]], model, comm)


def _blocks(module: nn.Module):
    from paratrain.parallel.blocks import unit_modules

    return unit_modules(module, "blocks")


def _torch_muon_defaults() -> dict:
    """torch.optim.Muon's constructor defaults, from its signature."""
    return {name: p.default for name, p in inspect.signature(muon_class()).parameters.items()
            if p.default is not inspect.Parameter.empty}


def check_muon_options(options: dict) -> None:
    """One line for a torch without Muon, or an option its Muon lacks."""
    cls = muon_class()
    if cls is None:
        raise MuonConfigError(f"--optimizer muon needs torch.optim.Muon (torch 2.9 or newer); torch {torch.__version__} "
                              "has none: upgrade torch or use --optimizer adamw")
    known = set(inspect.signature(cls).parameters) - {"params"}
    for key in options:
        if key not in known:
            raise MuonConfigError(f"Muon option {key!r}: torch {torch.__version__}'s torch.optim.Muon has no such "
                                  f"option; use one of {', '.join(sorted(known))}")


def build_optimizer(factory, model, comm: Comm) -> torch.optim.Optimizer:
    """The caller's optimizer over the model's masters; a Muon (`torch.optim.Muon` or a `MuonRecipe`) becomes this
    module's `Muon`, which gets each whole matrix (the one extension point by which a whole-matrix optimizer reaches
    a layout: the model's master rows, its tp facts and its expert blocks, never an engine's internals)."""
    if isinstance(factory, MuonRecipe):
        return factory.build(model, comm)
    cls = muon_class()
    try:
        opt = factory(model.masters())
    except ValueError:
        if cls is not None and isinstance(_probe(factory), cls):
            name, shape = next((n, s) for n, _, s in model.master_rows() if len(s) != 2)
            raise MuonConfigError(f"optimizer=torch.optim.Muon over {name} of shape {list(shape)}, which is not a "
                                  "matrix: use paratrain.MuonRecipe (Muon for the blocks' matrices, AdamW for the "
                                  "rest), or --optimizer muon") from None
        raise
    if cls is None or not isinstance(opt, cls):
        return opt
    return Muon([{**group, "algorithm": "muon"} for group in opt.param_groups], model, comm)


def _probe(factory):
    """What `factory` builds over one 2x2 matrix (None if it cannot): tells a Muon factory from another."""
    try:
        return factory([torch.empty(2, 2, device="meta", requires_grad=True)])
    except Exception:  # any failure means it is not a Muon we can recognize; the caller re-raises the original
        return None
