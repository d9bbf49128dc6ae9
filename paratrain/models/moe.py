"""Mixture of experts: a top-k routed feed-forward layer of E SwiGLU experts (Mixtral, Switch, DeepSeek-MoE).

Each token's router logits go through a softmax (fp32) and its top-k experts are chosen, their
probabilities renormalized to sum to 1 over the k; the token's output is the weighted sum of those
k experts' outputs (plus an always-on shared expert, if any). No token is dropped: there is no
capacity factor, so the result does not depend on how the tokens of a batch are spread.

The experts run batched per expert: the (token, expert) assignments are sorted by expert, so each
expert reads one contiguous slice of rows, computed by one grouped GEMM where torch has it
(`paratrain.compat.grouped_mm`) or a loop over the experts' slices otherwise. Expert parallelism
replaces only the step between the sort and the combine (`MoE.dispatch`): it sends each slice to
the rank holding its expert and brings the results back (`paratrain.parallel.expert`).

The load-balancing loss (Switch, Fedus et al. 2021; DeepSeek's normalization) is E·Σ_e f_e·P_e,
f_e the fraction of the k·S assignments of a sequence routed to expert e, P_e the mean router
probability of e over the sequence: 1 when the load is uniform (Hugging Face's Mixtral loss is k
times this). It is computed per sequence and averaged over sequences, so it is a sum of
per-sequence terms: any split of the batch by rows (data ranks, micro-batches, pipeline stages)
adds up to the one-process value. The router z-loss (Zoph et al. 2022) is the mean over tokens of
logsumexp(logits)². Both enter the backward through an autograd function attached to the layer's
output (DeepSeek's AddAuxiliaryLoss), so `loss_fn(model(x), y).backward()` includes them without
a second loss term.

Shape legend: B batch, S sequence, D dim, T tokens (B·S), E experts, K top-k, F expert hidden size,
A assignments (T·K).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain import compat


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked in three tensors: expert e computes w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x)).

    Under expert parallelism a rank holds a contiguous block of E/ep experts under the same
    names (w1 [E/ep, F, D]), so the expert dimension is an ordinary shardable dimension of
    these tensors and checkpoints stay layout-free.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x_AD: torch.Tensor, counts_E: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """Rows of `x_AD` sorted by expert, `counts_E` of them for each of this module's experts, in order
        (`counts`: the same on the host, when the caller has them)."""
        offsets = counts_E.cumsum(0).to(torch.int32)
        # No rows (an expert-parallel rank no token was routed to): the loop, whose empty matmuls still give
        # every expert a (zero) gradient, as one process holding all experts gives them.
        h1 = compat.grouped_mm(x_AD, self.w1.transpose(-2, -1), offsets) if x_AD.shape[0] else None
        if h1 is None:
            return self._loop(x_AD, counts if counts is not None else counts_E.tolist())
        h3 = compat.grouped_mm(x_AD, self.w3.transpose(-2, -1), offsets)
        return compat.grouped_mm(F.silu(h1) * h3, self.w2.transpose(-2, -1), offsets)

    def _loop(self, x_AD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One expert at a time on its contiguous slice."""
        outputs = []
        for e, x in enumerate(x_AD.split(counts)):
            outputs.append(F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e]))
        return torch.cat(outputs) if outputs else x_AD.new_zeros(0, x_AD.shape[-1])


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: the output unchanged. Backward: the output's gradient passes through and the
    auxiliary loss gets gradient 1, as if it had been added to the final loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_out, torch.ones(shape, dtype=dtype, device=device)


class MoE(nn.Module):
    """Top-k routed experts replacing the dense feed-forward of a block.

    Submodules: `router` (Linear dim → E, no bias), `experts` (`GroupedExperts`), `shared` (a dense
    SwiGLU, or None). After each forward, for metrics: `last_aux_loss` (detached fp32 scalar: the
    aux and z terms, coefficients applied, mean over this forward's sequences) and
    `last_tokens_per_expert` (int64 [E]: the assignments of this forward's tokens to each expert);
    over the forwards since `reset_step_load()` (a step's micro-batches): `step_tokens_per_expert`
    (their sum) and `step_aux_loss` (the mean over their sequences). A forward that activation
    checkpointing runs again inside backward routes identically (same inputs, same weights) and is
    not counted again: a step's load is that of its tokens, once each.

    `aux_rows`: the number of sequences the auxiliary terms are averaged over (None: this forward's).
    A step made of several forwards (micro-batches, data ranks) sets it to the whole batch's rows,
    so the terms of its forwards sum to the mean over the batch, as the token loss does.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, hidden_dim: int, shared: nn.Module | None,
                 aux_loss_coef: float, z_loss_coef: float):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim)
        self.shared = shared
        self.aux_rows: int | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.reset_step_load()

    def reset_step_load(self) -> None:
        """Start a step's load from nothing (`paratrain.parallel.model.ParallelModel.train_step` calls it)."""
        self.step_tokens_per_expert: torch.Tensor | None = None
        self._step_aux_sum: torch.Tensor | None = None
        self._step_rows = 0

    @property
    def step_aux_loss(self) -> torch.Tensor | None:
        """The auxiliary terms (coefficients applied) averaged over the sequences of the step's forwards."""
        return None if self._step_aux_sum is None else self._step_aux_sum / self._step_rows

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(-1, d)
        logits_TE = self.router(x_TD).float()
        weights_TK, experts_TK = route(logits_TE, self.top_k)
        counts_E = torch.bincount(experts_TK.flatten(), minlength=self.num_experts)
        # Sort the assignments by expert (stable: tokens keep their order inside an expert's slice).
        order_A = experts_TK.flatten().argsort(stable=True)
        token_A = order_A // self.top_k
        y_AD = self.dispatch(x_TD[token_A], counts_E)
        y_AD = y_AD * weights_TK.flatten()[order_A, None].to(y_AD.dtype)
        out_TD = torch.zeros_like(x_TD).index_add_(0, token_A, y_AD)
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        recomputed = compat.in_backward()  # activation checkpointing's second run of this forward
        if not recomputed:
            self.last_tokens_per_expert = counts_E.detach()
            self.step_tokens_per_expert = _add(self.step_tokens_per_expert, self.last_tokens_per_expert)
        return self._attach_aux(out_TD.view(b, s, d), logits_TE.view(b, s, -1), experts_TK.view(b, s, -1), recomputed)

    def dispatch(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for assignments sorted by expert; expert parallelism replaces this step."""
        return self.experts(x_AD, counts_E)

    def _attach_aux(self, out_BSD, logits_BSE, experts_BSK, recomputed: bool) -> torch.Tensor:
        per_sequence_B = self.aux_loss_coef * load_balancing_loss(logits_BSE, experts_BSK)
        if self.z_loss_coef:
            per_sequence_B = per_sequence_B + self.z_loss_coef * z_loss(logits_BSE)
        if not recomputed:
            self.last_aux_loss = per_sequence_B.detach().mean()
            self._step_aux_sum = _add(self._step_aux_sum, per_sequence_B.detach().sum())
            self._step_rows += out_BSD.shape[0]
        if not torch.is_grad_enabled() or not (self.aux_loss_coef or self.z_loss_coef):
            return out_BSD
        aux = per_sequence_B.sum() / (self.aux_rows or out_BSD.shape[0])
        return _AttachAuxLoss.apply(out_BSD, aux)


def _add(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """A running sum that starts at the first value (no kernel for a zero start)."""
    return value.clone() if total is None else total + value


def route(logits_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights: softmax (fp32) probabilities renormalized over the k."""
    probs_TE = logits_TE.float().softmax(-1)
    weights_TK, experts_TK = probs_TE.topk(top_k, dim=-1)
    return weights_TK / weights_TK.sum(-1, keepdim=True), experts_TK


def load_balancing_loss(logits_BSE: torch.Tensor, experts_BSK: torch.Tensor) -> torch.Tensor:
    """Per sequence [B]: E·Σ_e f_e·P_e, f_e the fraction of the sequence's assignments to expert e (no
    gradient), P_e the sequence's mean softmax probability of e."""
    num_experts = logits_BSE.shape[-1]
    probs_BE = logits_BSE.float().softmax(-1).mean(1)
    one_hot = F.one_hot(experts_BSK.flatten(1), num_experts).float()  # [B, S·K, E]
    fraction_BE = one_hot.mean(1)
    return num_experts * (fraction_BE * probs_BE).sum(-1)


def z_loss(logits_BSE: torch.Tensor) -> torch.Tensor:
    """Per sequence [B]: the mean over its tokens of logsumexp(router logits)²."""
    return logits_BSE.float().logsumexp(-1).square().mean(-1)
