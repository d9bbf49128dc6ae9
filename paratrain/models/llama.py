"""Llama-style decoder in plain PyTorch: RMSNorm, rotary embeddings, GQA attention, SwiGLU.

Parallel strategies act on this model from outside, so it is written to survive them:

- Head counts are read from the weight shapes in `forward`, never from the config, so a
  tensor-parallel plan can slice `wq`/`wk`/`wv`/`w1`/`w3` by output features and `wo`/`w2`
  by input features without changing this file.
- Blocks live in a `ModuleDict` keyed "0".."L-1" (`pipeline_layers`): a pipeline stage deletes the blocks it
  does not own and the remaining parameter names stay those of the full model.
- `tok_embeddings`, `norm` and `output` may be set to `None` by a pipeline stage (the model names
  them in `pipeline_first` and `pipeline_last`: `paratrain.parallel.pipeline.stages.LayeredModel`).
- Construction on the meta device holds no data; `init_weights` draws each parameter from
  its own generator keyed by (seed, name), so values do not depend on device, dtype, or
  which parameters a rank holds.

Shape legend: B batch, S sequence, D dim, H heads (local), K kv heads (local), E head size.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.configs import ModelConfig
from paratrain.models.moe import MoE

INIT_STD = 0.02
# The parameters of a block's experts (`GroupedExperts`): [E, ...], the expert dimension first.
EXPERT_TENSORS = (".experts.w1", ".experts.w2", ".experts.w3")


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale; statistics in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Scale after the cast back, as Hugging Face does, so bf16 runs round the same way.
        return self.weight * normed.to(x.dtype)


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device, dtype, positions: torch.Tensor | None = None,
    scaling: ModelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [S, E] for positions 0..seq_len-1 (or `positions` [S], or [B, S] giving [B, S, E]), in
    the rotate-half layout;
    `scaling`: the config whose rope_scaling (Llama 3.1's) rescales the frequencies.

    Computed in fp32 with the same operations as Hugging Face's Llama, so exported
    checkpoints give identical logits there.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    if scaling is not None and scaling.rope_scaling == "llama3":
        inv_freq = llama3_scaled(inv_freq, scaling)
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    freqs = positions.to(device=device, dtype=torch.float)[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def llama3_scaled(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's rope scaling of the frequencies: wavelengths longer than the original context over
    low_freq_factor are stretched `rope_factor` times, those shorter than it over high_freq_factor kept, and
    the band between interpolated smoothly (as Hugging Face's rope_type "llama3")."""
    original, factor = cfg.rope_original_max_seq_len, cfg.rope_factor
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x_BSHE: torch.Tensor, cos_SE: torch.Tensor, sin_SE: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + E/2) pair of every head by its position's angle."""
    x1, x2 = x_BSHE.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    # [S, E] tables, or [B, S, E] per sequence (documents): either way one angle for every head
    return x_BSHE * cos_SE.unsqueeze(-2) + rotated * sin_SE.unsqueeze(-2)


def document_layout(tokens_BS: torch.Tensor, eos: int,
                    rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, R], attention mask [B, 1, R, S]) of packed documents, each ending with token `eos`, for the
    queries at `rows` [R] of the sequences (None: all S of them).

    A document starts at a sequence's first token and after each `eos` (which belongs to the document it
    ends); positions count from 0 in each, and a query attends to the keys of its own document up to
    itself: what running each document as its own sequence computes. Context parallelism asks for the rows of
    the tokens a rank holds, against every key of the sequence.
    """
    b, s = tokens_BS.shape
    index = torch.arange(s, device=tokens_BS.device)
    ends = tokens_BS == eos
    starts = torch.cat((torch.ones_like(ends[:, :1]), ends[:, :-1]), dim=1)
    positions = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
    document = torch.cumsum(starts, dim=1)
    rows = index if rows is None else rows
    same = document[:, rows, None] == document[:, None, :]
    return positions[:, rows], (same & (rows[:, None] >= index[None, :]))[:, None]


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, q_dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, config.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos_SE: torch.Tensor, sin_SE: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` [B, 1, S, S]: which keys each query may attend to (`document_layout`); None: causal. (Under
        context parallelism [B, 1, 2c, S], this rank's queries against the whole sequence's keys: the ring reads it.)"""
        b, s, _ = x_BSD.shape
        q_BSHE = apply_rotary(self.wq(x_BSD).view(b, s, -1, self.head_dim), cos_SE, sin_SE)
        k_BSKE = apply_rotary(self.wk(x_BSD).view(b, s, -1, self.head_dim), cos_SE, sin_SE)
        v_BSKE = self.wv(x_BSD).view(b, s, -1, self.head_dim)
        q_BHSE, k_BKSE, v_BKSE = (t.transpose(1, 2) for t in (q_BSHE, k_BSKE, v_BSKE))
        # Query head h reads kv head h // (H/K): Hugging Face's layout, and the one that keeps
        # contiguous tensor-parallel slices of q heads aligned with slices of kv heads.
        group = q_BHSE.shape[1] // k_BKSE.shape[1]
        if q_BHSE.is_cuda or group == 1:
            # SDPA's enable_gqa reads each kv head for its group of q heads (the grouping of
            # repeat_interleave on dim 1) in its fused kernels, without materializing K and V repeated.
            out_BHSE = F.scaled_dot_product_attention(q_BHSE, k_BKSE, v_BKSE, attn_mask=mask, is_causal=mask is None,
                                                      enable_gqa=group > 1)
        else:  # the CPU's fused kernel does not take GQA (enable_gqa falls back to the unfused math)
            k_BHSE, v_BHSE = (t.repeat_interleave(group, dim=1) for t in (k_BKSE, v_BKSE))
            out_BHSE = F.scaled_dot_product_attention(q_BHSE, k_BHSE, v_BHSE, attn_mask=mask, is_causal=mask is None)
        return self.wo(out_BHSE.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig, hidden_dim: int | None = None):
        super().__init__()
        hidden_dim = hidden_dim or config.ffn_dim
        self.w1 = nn.Linear(config.dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, config.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))


def moe_feed_forward(config: ModelConfig) -> MoE:
    """The mixture-of-experts feed-forward of a block of `config` (n_experts > 0)."""
    shared = FeedForward(config, config.expert_hidden_dim) if config.shared_expert else None
    return MoE(config.dim, config.n_experts, config.top_k, config.expert_hidden_dim, shared,
               config.aux_loss_coef, config.z_loss_coef)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then feed-forward."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config) if not config.is_moe else moe_feed_forward(config)

    def forward(self, x_BSD: torch.Tensor, cos_SE: torch.Tensor, sin_SE: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), cos_SE, sin_SE, mask)
        return h_BSD + self.feed_forward(self.ffn_norm(h_BSD))


class Transformer(nn.Module):
    """Llama-style decoder: embedding, `n_layers` blocks, final norm, output projection.

    Build on meta and materialize with
    `model.to_empty(device=...)` then `model.init_weights(seed)`.
    """

    # The blocks a pipeline splits, what its first stage keeps before them and its last stage after them.
    pipeline_layers = "layers"
    pipeline_first = ("tok_embeddings",)
    pipeline_last = ("norm", "output")

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim  # read by every forward: an attribute, not the config's derived property
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self._tie_weights()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab] for token ids [B, S].

        A pipeline stage without `tok_embeddings` takes hidden states [B, S, D] instead,
        and one without `output` returns hidden states. `positions` [S]: each token's position
        in its sequence (None: 0..S-1); context parallelism gives a rank's chunks of a sequence. With
        `config.document_eos` the documents packed in each sequence are kept apart (`document_layout`), found in
        the token ids of the whole sequences, `documents` [B, S] where the forward sees part of them (a later
        pipeline stage, which takes hidden states; context parallelism's chunks, at `positions` of them).
        """
        mask = None
        if self.config.document_eos is not None:
            ids = documents if documents is not None else tokens if self.tok_embeddings is not None else None
            if ids is None:
                raise ValueError("document masking needs the token ids: a pipeline stage that takes hidden states "
                                 "takes the micro-batch's token ids as `documents`")
            if positions is not None and documents is None:
                raise ValueError("document masking of a part of each sequence (`positions`) needs the whole "
                                 "sequences' token ids as `documents`: a document may begin in another part")
            positions, mask = document_layout(ids, self.config.document_eos, positions)
        h_BSD = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Recomputed each call (S·E/2 products): a cached buffer would hold garbage after
        # meta construction + to_empty, and wrappers would have one more tensor to broadcast.
        cos_SE, sin_SE = rotary_tables(
            h_BSD.shape[1], self.head_dim, self.config.rope_theta, h_BSD.device, h_BSD.dtype, positions, self.config
        )
        for layer in self.layers.values():
            h_BSD = layer(h_BSD, cos_SE, sin_SE) if mask is None else layer(h_BSD, cos_SE, sin_SE, mask)
        h_BSD = self.norm(h_BSD) if self.norm is not None else h_BSD
        return self.output(h_BSD) if self.output is not None else h_BSD

    @property
    def documents_from_tokens(self) -> bool:
        """Whether a pipeline stage that takes hidden states needs the micro-batch's token ids (`forward`'s
        `documents`): with `config.document_eos`, to keep the packed documents apart."""
        return self.config.document_eos is not None

    def get_output_embeddings(self) -> nn.Linear | None:
        """The output head (Hugging Face's name for the method), whose output is the logits: where a fused loss
        takes the cross-entropy (`paratrain.parallel.loss`). None on a pipeline stage that does not hold it."""
        return self.output

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict:
        """Megatron's split of this model (`paratrain.models.tp_plans`): what `parallelize` applies under tp > 1
        when the caller names no plan (`paratrain.parallel.tensor.plan.PlannedModel`)."""
        from paratrain.models.tp_plans import reference_plan

        return reference_plan(self.config, sequence_parallel)

    def to_empty(self, *, device, recurse: bool = True) -> "Transformer":
        """`nn.Module.to_empty`, keeping the output projection tied to the embedding table."""
        super().to_empty(device=device, recurse=recurse)
        self._tie_weights()
        return self

    def param_init_std(self, name: str) -> float | None:
        """Std of the normal init of parameter `name`; None for norm scales, which start at 1.

        0.02 everywhere, except the projections that write into the residual stream
        (`wo`, `w2`, the experts' `w2`), which get 0.02/sqrt(2·n_layers) so the stream's variance
        does not grow with depth (GPT-2).
        """
        if name.endswith("norm.weight"):
            return None
        if name.endswith((".wo.weight", ".w2.weight", ".experts.w2")):
            return INIT_STD / math.sqrt(2 * self.config.n_layers)
        return INIT_STD

    def param_init(self, name: str, shape, seed: int) -> torch.Tensor:
        """Full fp32 CPU initial value of parameter `name` (named from this model's root).

        A sharded materialization calls this with the global shape and keeps its slice. Each
        expert of a `GroupedExperts` tensor is drawn from its own generator (name + expert index),
        so a rank holding a block of experts can draw only those (`param_init_experts`).
        """
        if name.endswith(EXPERT_TENSORS):
            return self.param_init_experts(name, shape, seed, range(shape[0]))
        return init_parameter(name, shape, seed, std=self.param_init_std(name))

    def param_init_experts(self, name: str, shape, seed: int, experts: range) -> torch.Tensor:
        """Initial values of experts `experts` of the `GroupedExperts` tensor `name` (global `shape`)."""
        std = self.param_init_std(name)
        return torch.stack([init_parameter(f"{name}[{e}]", shape[1:], seed, std=std) for e in experts])

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter this module holds with its deterministic initial value."""
        for name, param in self.named_parameters():
            param.copy_(self.param_init(name, param.shape, seed))

    def num_params(self) -> int:
        """Number of parameters held, each shared tensor counted once."""
        return sum(p.numel() for p in self.parameters())

    def _tie_weights(self) -> None:
        # Called again after to_empty, which replaces the two references separately.
        if self.config.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight


def init_parameter(name: str, shape, seed: int, *, std: float | None) -> torch.Tensor:
    """Full fp32 CPU initial value of parameter `name`: normal(0, std), or ones if std is None.

    The generator is seeded from sha256(f"{seed}:{name}"), not Python's salted `hash`,
    so the value is the same in every process and whatever else is being initialized.
    """
    if std is None:
        return torch.ones(shape, device="cpu")
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=generator)
