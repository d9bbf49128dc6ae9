"""Expert parallelism's data path: each token's assignments to the rank of their expert and back (all-to-all).

The MoE layer (`paratrain.models.moe.MoE`) sorts its (token, expert) assignments by expert and
hands them to `MoE.dispatch`; under expert parallelism that step is `ExpertDispatch`. Expert e of
E lives on ep rank e // (E/ep) (contiguous blocks), so the sorted rows are already grouped by
destination rank. One step, on each of the ep ranks of a group:

1. counts: each rank sends every other the number of its rows for each of that rank's experts
   (an all-to-all of E int64 counts). The counts are read on the host once: the split sizes of
   the next all-to-all are host numbers (the layer's one host sync, as in every dropless
   dispatcher: Megatron-Core's, torchtitan's).
2. dispatch: an all-to-all with variable split sizes sends each block of rows to its expert's
   rank. A rank receives, from each source rank in turn, its rows grouped by local expert; they
   are regrouped by expert (one gather) and the local experts run on contiguous slices.
3. combine: the outputs are put back in the order received and sent home by the all-to-all
   with the split sizes swapped; the MoE layer weights and sums them per token.

Nothing is dropped: every row is sent whatever the imbalance. Backward is the same two
all-to-alls in reverse (`_AllToAll`): the gradient of a dispatched row goes back to its token's
rank, and each expert's gradient sums the contributions of every token of the group routed to it.

Communication per layer and rank, forward (and the same again backward): the bytes of the rows
routed to experts on other ranks, D elements each, sent, then their outputs sent back; plus
(ep − 1)·E/ep int64 counts.
"""

from __future__ import annotations

import torch

from paratrain.comm import Comm
from paratrain.mesh import Axis


class _AllToAll(torch.autograd.Function):
    """Forward: rows to the ranks of `axis` by `input_splits`, `output_splits` received. Backward: the
    gradient's rows back by the swapped splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: Axis, output_splits: list[int], input_splits: list[int]):
        ctx.comm, ctx.axis, ctx.splits = comm, axis, (output_splits, input_splits)
        return _all_to_all(x, comm, axis, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad.contiguous(), ctx.comm, ctx.axis, input_splits, output_splits), None, None, None, None


def _all_to_all(x: torch.Tensor, comm: Comm, axis: Axis, output_splits: list[int], input_splits: list[int]):
    out = x.new_empty(sum(output_splits), *x.shape[1:])
    comm.all_to_all(out, x.contiguous(), output_splits, input_splits, axis)
    return out


class ExpertDispatch:
    """`MoE.dispatch` under expert parallelism: this rank holds experts [first, first + local) of E."""

    def __init__(self, experts, comm: Comm, axis: Axis, num_experts: int):
        self.experts, self.comm, self.axis = experts, comm, axis
        self.ranks = comm.mesh.size(axis)
        self.local = num_experts // self.ranks

    def __call__(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        sent, received = self._exchange_counts(counts_E)
        input_splits = [sum(row) for row in sent]
        output_splits = [sum(row) for row in received]
        x_RD = _AllToAll.apply(x_AD, self.comm, self.axis, output_splits, input_splits)
        order = _by_expert(received).to(x_RD.device, non_blocking=True)
        local_counts = [sum(row[e] for row in received) for e in range(self.local)]
        y_sorted = self.experts(x_RD[order], torch.tensor(local_counts, device=x_RD.device), local_counts)
        y_RD = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
        return _AllToAll.apply(y_RD, self.comm, self.axis, input_splits, output_splits)

    def _exchange_counts(self, counts_E: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
        """(rows this rank sends to each rank, per its local expert; rows each rank sends here, per local expert)."""
        received = torch.empty_like(counts_E)
        self.comm.all_to_all(received, counts_E, [self.local] * self.ranks, [self.local] * self.ranks, self.axis)
        both = torch.stack([counts_E, received]).view(2, self.ranks, self.local).tolist()  # the host sync
        return both[0], both[1]


def _by_expert(received: list[list[int]]) -> torch.Tensor:
    """The received rows (source-major, then local expert) in local-expert-major order: indices into them."""
    starts, offset = [], 0
    for row in received:
        starts.append([])
        for count in row:
            starts[-1].append(offset)
            offset += count
    pieces = [torch.arange(starts[src][e], starts[src][e] + received[src][e])
              for e in range(len(received[0])) for src in range(len(received))]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
