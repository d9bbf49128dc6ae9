"""Model shapes: the `ModelConfig` dataclass, its analytic counts, and the named configs with their training
recipes (`Recipe`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paratrain.errors import ParatrainError


class ModelConfigError(ParatrainError, ValueError):
    """A model configuration field has an invalid value, or a model name is unknown."""


_POSITIVE_INTS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")


class ExpertShape:
    """What every model description the planner reads derives from its n_experts, expert_ffn_dim and ffn_dim
    (`ModelConfig`, and a transformers model's `paratrain.models.hf.HFModelConfig`)."""

    @property
    def is_moe(self) -> bool:
        """Whether the blocks' feed-forward is a mixture of experts."""
        return self.n_experts > 0

    @property
    def expert_hidden_dim(self) -> int:
        """Hidden width of one expert: expert_ffn_dim, or ffn_dim when that is 0."""
        return self.expert_ffn_dim or self.ffn_dim


@dataclass(frozen=True)
class ModelConfig(ExpertShape):
    """Shape of a Llama-style decoder.

    Fields:
        vocab_size: number of token ids; rows of the embedding table and of the output projection.
        dim: width of the residual stream (hidden size).
        n_layers: number of transformer blocks.
        n_heads: number of query heads; `dim // n_heads` is the head size.
        n_kv_heads: number of key/value heads (grouped-query attention); divides `n_heads`.
        ffn_dim: hidden width of the SwiGLU feed-forward network.
        max_seq_len: longest sequence the model is meant for; `generate` crops its context to it.
        norm_eps: epsilon added to the mean square in RMSNorm.
        rope_theta: base of the rotary embedding frequencies.
        rope_scaling: "none", or "llama3": Llama 3.1's frequency scaling for long contexts (Hugging Face's
            rope_type "llama3"): wavelengths above original_max/low_freq_factor are stretched by `rope_factor`,
            those below original_max/high_freq_factor kept, the band between interpolated.
        rope_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_max_seq_len: its parameters
            (Llama 3.1's: 8, 1, 4, 8192).
        tie_embeddings: the output projection reuses the embedding table (one parameter).
        n_experts: experts of each block's mixture-of-experts feed-forward (`paratrain.models.moe`); 0: the
            dense SwiGLU feed-forward.
        top_k: experts each token is routed to (at most n_experts).
        expert_ffn_dim: hidden width of each expert (and of the shared expert); 0: ffn_dim.
        shared_expert: one always-on SwiGLU expert added to the routed output of each block.
        aux_loss_coef: coefficient of the load-balancing loss E·Σ_e f_e·P_e (Switch; 1 when balanced).
        z_loss_coef: coefficient of the router z-loss, the mean of logsumexp(router logits)².
        document_eos: None, or the token id that ends each document of a packed sequence: attention then
            stays within documents and positions restart at each (`--document-mask`; not an architecture
            change: the weights are those of a model without it).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    tie_embeddings: bool = False
    n_experts: int = 0
    top_k: int = 2
    expert_ffn_dim: int = 0
    shared_expert: bool = False
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    document_eos: int | None = None

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name}={value!r} is invalid; use a positive integer")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ModelConfigError(f"{name}={value!r} is invalid; use a positive number")
        if not isinstance(self.tie_embeddings, bool):
            raise ModelConfigError(f"tie_embeddings={self.tie_embeddings!r} is invalid; use true or false")
        self._check_rope_scaling()
        self._check_experts()
        if self.dim % self.n_heads:
            raise ModelConfigError(
                f"dim={self.dim} is not divisible by n_heads={self.n_heads}; use a multiple of n_heads"
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; "
                "use a divisor of n_heads"
            )
        if self.head_dim % 2:
            raise ModelConfigError(
                f"dim/n_heads={self.head_dim} is odd but rotary embeddings need an even head size; "
                "change dim or n_heads"
            )

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ModelConfigError(f"rope_scaling={self.rope_scaling!r} is not supported; use one of "
                                   f"{', '.join(ROPE_SCALINGS)}")
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ModelConfigError(f"{name}={value!r} is invalid; use a positive number")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ModelConfigError(f"rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                                   f"rope_low_freq_factor={self.rope_low_freq_factor}")

    def _check_experts(self) -> None:
        for name in ("n_experts", "expert_ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ModelConfigError(f"{name}={value!r} is invalid; use 0 or a positive integer")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k <= 0:
            raise ModelConfigError(f"top_k={self.top_k!r} is invalid; use a positive integer")
        if self.n_experts and self.top_k > self.n_experts:
            raise ModelConfigError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}; route each token to at "
                                   "most n_experts experts")
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ModelConfigError(f"{name}={value!r} is invalid; use 0 or a positive number")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.n_heads

    @property
    def pretraining_seq_len(self) -> int:
        """The sequence length the model was pretrained at: under Llama 3's rope scaling the original context
        (8,192 for Llama 3.1/3.2, whose 131,072 came from a late long-context stage), else its maximum (4,096 for
        Llama 2). What people train it at, and the planner's default."""
        return min(self.rope_original_max_seq_len, self.max_seq_len) if self.rope_scaling == "llama3" \
            else self.max_seq_len

    def num_params(self) -> int:
        """Exact number of parameters of `Transformer(self)`, a tied table counted once."""
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else embedding
        return embedding + self.n_layers * self._block_params() + self.dim + output

    def num_active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (top_k of n_experts run)."""
        unused = (self.n_experts - self.top_k) * self._expert_params() if self.is_moe else 0
        return self.num_params() - self.n_layers * unused

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at sequence length `seq_len`.

        PaLM (Chowdhery et al. 2022, appendix B): 6·N + 12·L·H·Q·T with H·Q = dim and
        T = seq_len. N counts every parameter used in a matmul: all of them except the
        input embedding table, whose lookup does no arithmetic; the output projection counts
        even when tied to that table. The attention term is not halved for the causal mask,
        following the same convention, so MFU figures stay comparable with published ones.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ModelConfigError(f"seq_len={seq_len!r} is invalid; use a positive integer")
        matmul_params = self.num_active_params() - self.vocab_size * self.dim * (not self.tie_embeddings)
        return 6 * matmul_params + 12 * self.n_layers * self.dim * seq_len

    def _block_params(self) -> int:
        hd = self.head_dim
        attention = 2 * self.dim * self.n_heads * hd + 2 * self.dim * self.n_kv_heads * hd
        feed_forward = 3 * self.dim * self.ffn_dim
        if self.is_moe:
            shared = self._expert_params() if self.shared_expert else 0
            feed_forward = self.dim * self.n_experts + self.n_experts * self._expert_params() + shared
        norms = 2 * self.dim
        return attention + feed_forward + norms

    def _expert_params(self) -> int:
        return 3 * self.dim * self.expert_hidden_dim


ROPE_SCALINGS = ("none", "llama3")

MODEL_CONFIGS: dict[str, ModelConfig] = {
    # Small enough to train on a CPU in minutes; 8 query and 4 kv heads divide by tp=2 and tp=4.
    "tiny": ModelConfig(
        vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=1024
    ),
    "small": ModelConfig(
        vocab_size=32000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536,
        max_seq_len=2048, tie_embeddings=True,
    ),
    "llama2-7b": ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, max_seq_len=4096
    ),
    "llama2-13b": ModelConfig(
        vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, max_seq_len=4096
    ),
    "llama2-70b": ModelConfig(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, max_seq_len=4096
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        max_seq_len=8192, rope_theta=500000.0,
    ),
    # Llama 3.1 and 3.2 (Hugging Face's meta-llama configs): 128K context by rope scaling, 3.2's small models with
    # tied embeddings.
    "llama3.1-8b": ModelConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling="llama3",
    ),
    "llama3.1-70b": ModelConfig(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling="llama3",
    ),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling="llama3", rope_factor=32.0, tie_embeddings=True,
    ),
    "llama3.2-3b": ModelConfig(
        vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling="llama3", rope_factor=32.0, tie_embeddings=True,
    ),
    # Trains on the default corpus on a CPU in minutes; 8 experts split over ep = 1, 2, 4 or 8, heads over tp 2.
    "tiny-moe": ModelConfig(
        vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=1024,
        n_experts=8, top_k=2,
    ),
    # Mixtral 8x7B (Jiang et al. 2024, table 1; Hugging Face's mistralai/Mixtral-8x7B-v0.1 config).
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=32768,
        rope_theta=1e6, n_experts=8, top_k=2, expert_ffn_dim=14336,
    ),
}


@dataclass(frozen=True)
class Recipe:
    """The optimizer and learning-rate schedule a named model trains with: the defaults of the trainer's `[train]`
    options of the same names (`paratrain.config.resolve_recipe`; an option the user gives wins).

    Fields:
        lr: peak learning rate, reached at the end of the warm-up.
        min_lr: where the cosine decay ends (with another peak given, the same fraction of it).
        warmup_steps: steps of linear warm-up from 0 to the peak.
        beta1, beta2, eps: AdamW's moment decays and denominator epsilon.
        weight_decay: AdamW's decoupled weight decay (matrices only).
        grad_clip: the global gradient norm is clipped to this (0: no clipping).
        source: where the numbers come from.
    """

    lr: float
    min_lr: float
    warmup_steps: int
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip: float
    source: str


# The small configs train in minutes on a CPU: a high peak and a short warm-up, torch's AdamW epsilon.
_QUICK = Recipe(lr=3e-3, min_lr=3e-4, warmup_steps=20, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                grad_clip=1.0, source="paratrain's own, for runs of a few hundred steps")
# Llama 2 (Touvron et al. 2023, §2.2): "AdamW optimizer with β1 = 0.9, β2 = 0.95, eps = 10⁻⁵ ... a cosine
# learning rate schedule, with warmup of 2000 steps, and decay final learning rate down to 10% of the peak
# learning rate ... weight decay of 0.1 and gradient clipping of 1.0"; peak 3.0e-4 for 7B and 13B, 1.5e-4
# for 34B and 70B (table 1).
_LLAMA2 = Recipe(lr=3e-4, min_lr=3e-5, warmup_steps=2000, beta1=0.9, beta2=0.95, eps=1e-5, weight_decay=0.1,
                 grad_clip=1.0, source="Llama 2 (Touvron et al. 2023), §2.2 and table 1")
# Llama 3 (Dubey et al. 2024): peak 3e-4 for 8B (table 3). Its schedule is published for 405B only (§3.4.1:
# linear warm-up of 8,000 steps, cosine decay to 1% of the peak), taken here as it stands; the paper does not
# restate AdamW's betas, epsilon, weight decay or clipping, which stay Llama 2's.
_LLAMA3_8B = Recipe(lr=3e-4, min_lr=3e-6, warmup_steps=8000, beta1=0.9, beta2=0.95, eps=1e-5,
                    weight_decay=0.1, grad_clip=1.0,
                    source="Llama 3 (Dubey et al. 2024), table 3 and §3.4.1 (schedule of 405B); AdamW as Llama 2")

RECIPES: dict[str, Recipe] = {
    "tiny": _QUICK,
    "small": _QUICK,
    "llama2-7b": _LLAMA2,
    "llama2-13b": _LLAMA2,
    "llama2-70b": dataclasses.replace(_LLAMA2, lr=1.5e-4, min_lr=1.5e-5),
    "llama3-8b": _LLAMA3_8B,
    "llama3.1-8b": _LLAMA3_8B,
    "llama3.1-70b": dataclasses.replace(_LLAMA3_8B, lr=1.5e-4, min_lr=1.5e-6),  # table 3: 70B's peak
    # The Llama 3.2 small models were pruned and distilled from 3.1 8B: no pretraining schedule of their own.
    "llama3.2-1b": dataclasses.replace(_LLAMA3_8B, source="none published for Llama 3.2 1B/3B; Llama 3 8B's"),
    "llama3.2-3b": dataclasses.replace(_LLAMA3_8B, source="none published for Llama 3.2 1B/3B; Llama 3 8B's"),
    "tiny-moe": _QUICK,
    # Mixtral's paper publishes no optimizer settings: Llama 2's, as for the dense models of its size.
    "mixtral-8x7b": dataclasses.replace(_LLAMA2, source="none published for Mixtral (Jiang et al. 2024); Llama 2's"),
}


# Full fine-tuning of a pretrained model (--init-from): Llama 2-Chat's supervised fine-tuning (Touvron et al. 2023,
# §3.1: "a cosine learning rate schedule, with an initial learning rate of 2 × 10⁻⁵, a weight decay of 0.1"),
# the optimizer otherwise as its pretraining (§2.2: AdamW β1 0.9, β2 0.95, eps 10⁻⁵, clipping 1.0, decay to 10% of
# the peak). §3.1 states no warm-up; Alpaca's recipe for the same models (Taori et al. 2023) warms up over 3% of
# the steps, which `FINE_TUNE_WARMUP` takes (`paratrain.config.resolve_recipe`). A toy config's peak (3e-3) would
# destroy a pretrained model's weights in a few steps.
FINE_TUNE = Recipe(lr=2e-5, min_lr=2e-6, warmup_steps=0, beta1=0.9, beta2=0.95, eps=1e-5, weight_decay=0.1,
                   grad_clip=1.0, source="full fine-tuning: Llama 2-Chat's SFT (Touvron et al. 2023, §3.1; AdamW and "
                                         "the decay to 10% as §2.2), warm-up 3% of the steps as Alpaca's")
FINE_TUNE_WARMUP = 0.03


def get_recipe(name: str, fine_tune: bool = False) -> Recipe:
    """The named model's recipe, or with `fine_tune` (--init-from: a pretrained model) `FINE_TUNE`; a name that is
    not a named config gets the small configs'."""
    return FINE_TUNE if fine_tune else RECIPES.get(name, _QUICK)


def get_model_config(name: str) -> ModelConfig:
    """The named config from `MODEL_CONFIGS`; raises `ModelConfigError` listing the names if unknown."""
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        choices = ", ".join(MODEL_CONFIGS)
        raise ModelConfigError(f"unknown model {name!r}; choose one of: {choices}") from None
