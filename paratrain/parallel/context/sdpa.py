"""Context parallelism applied to a plain model: its inputs split, its causal SDPA calls run as a ring.

No model code changes. During the wrapped forward:

- the token ids (the forward's first argument, [B, S]) become this rank's two chunks [B, 2c]
  (`split`), and the positions of those tokens in the whole sequence are passed by the keyword
  the forward takes them by: `positions` ([2c], paratrain's Transformer) or `position_ids`
  ([1, 2c], Hugging Face), so that RoPE rotates each token by its true position; an nn.Sequential
  (a pipeline stage too) hands them to each layer whose forward takes that keyword, and only the
  tensor to the others (`paratrain.interop.hf_stages.as_sequential` lays a Hugging Face Llama out so);
- a Hugging Face forward that takes `attention_mask` gets one of all ones ([B, 2c], no padding)
  unless the caller passed one (then it is split too): without a mask, transformers reads the jump
  between the two chunks' position ids as two packed sequences and builds a block mask instead of
  calling SDPA with is_causal=True;
- every `F.scaled_dot_product_attention` call is intercepted (a `TorchFunctionMode`) and answered
  by `ring.ring_attention` over the cp group. Causal self-attention without dropout has a ring form
  here, and so has a boolean mask over the whole sequence's keys ([B or 1, 1, 2c, S]) within the
  causal mask: a document mask (a model that keeps packed documents apart, `documents_from_tokens`,
  is given the whole sequences' token ids as `documents`, and masks its chunks' queries against
  every key). Any other call ends in one line naming what to change.

The labels are split like the tokens (`ContextSharding.labels`); a loss summed over this rank's
tokens is this rank's part of the sequence's loss, and the parts add up over the cp ranks.
"""

from __future__ import annotations

import contextlib
import inspect
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from paratrain.comm import Comm
from paratrain.errors import ParatrainError
from paratrain.mesh import Axis
from paratrain.parallel.context.ring import Ring, ring_attention
from paratrain.parallel.context.split import positions, shard_sequence

POSITION_KEYWORDS = ("positions", "position_ids")  # paratrain's Transformer, Hugging Face models


class ContextParallelError(ParatrainError, ValueError):
    """A model or a call that context parallelism cannot run; the message names the fix."""


# The ring mode the current forward runs under, for a recomputation in backward to run under again.
_ACTIVE: ContextVar[RingSDPA | None] = ContextVar("paratrain_ring_sdpa", default=None)


class RingSDPA(TorchFunctionMode):
    """While active, `F.scaled_dot_product_attention(q, k, v, is_causal=True)` runs as ring attention."""

    def __init__(self, ring: Ring):
        super().__init__()
        self.ring = ring
        self.calls = 0
        self._token = None
        self._checked_mask = None  # the mask last checked (every layer of a forward passes the same one)

    def __enter__(self):
        self._token = _ACTIVE.set(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.reset(self._token)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return self._attention(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        if attn_mask is not None:
            self._check_mask(attn_mask, query.shape[-2], is_causal)
        elif not is_causal:
            raise ContextParallelError("context parallelism (--cp) needs causal attention: the model called "
                                       "F.scaled_dot_product_attention with is_causal=False and no mask; call it "
                                       "with is_causal=True, or use --cp 1")
        if dropout_p:
            raise ContextParallelError(f"context parallelism (--cp) has no attention dropout: the model called "
                                       f"F.scaled_dot_product_attention with dropout_p={dropout_p}; set it to 0 "
                                       "or use --cp 1")
        if query.shape[-2] != key.shape[-2]:
            raise ContextParallelError(f"context parallelism (--cp) needs self-attention over the same tokens: "
                                       f"{query.shape[-2]} queries against {key.shape[-2]} keys; use --cp 1")
        return ring_attention(query, key, value, self.ring, scale, attn_mask)

    def _check_mask(self, mask: torch.Tensor, queries: int, is_causal: bool) -> None:
        """A mask the ring can apply: boolean, this rank's queries against the whole sequence's keys, showing no
        query a later key (the ring skips what the causal mask hides). Checked once per mask."""
        if mask is self._checked_mask:
            return
        seq_len = self.ring.seq_len
        if is_causal or mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[-2:]) != (queries, seq_len) \
                or mask.shape[1] != 1:
            raise ContextParallelError(
                "context parallelism (--cp) takes an attn_mask that is boolean, [batch, 1, this rank's "
                f"{queries} queries, the sequence's {seq_len} keys], without is_causal (a document mask from the "
                f"whole sequences' token ids); the model passed {mask.dtype} {list(mask.shape)}"
                f"{' with is_causal=True' if is_causal else ''}; use --cp 1 or --no-document-mask")
        held = self.ring.positions(self.ring.rank, mask.device)
        if (mask & (torch.arange(seq_len, device=mask.device) > held[:, None])).any():
            raise ContextParallelError("context parallelism (--cp) attends causally: the model's attn_mask shows a "
                                       "query a key after it, which the ring never computes; use --cp 1")
        self._checked_mask = mask


def recompute_context():
    """What a recomputation in backward of a forward running now must run under: the same ring (a new
    `RingSDPA` over it; its K/V travel around again), or nothing outside context parallelism.

    Read while the forward runs (torch.utils.checkpoint's `context_fn` is called then), entered when
    backward recomputes: the ring's mode is long exited by then, and attention recomputed outside it
    would attend over this rank's chunks alone.
    """
    active = _ACTIVE.get()
    return contextlib.nullcontext() if active is None else RingSDPA(active.ring)


class ContextSharding:
    """What a `ParallelModel` does around its module's forward under context parallelism."""

    def __init__(self, module: nn.Module, comm: Comm, position_keyword: str | None = None, axis: Axis = Axis.CP):
        self.comm, self.axis = comm, axis
        self.size, self.rank = comm.mesh.size(axis), comm.mesh.coord(axis)
        if isinstance(module, nn.Sequential):
            # A Sequential's forward hands each layer one tensor: the positions go to each layer that takes them,
            # known by child name, which pipeline stages keep and which outlives any later wrapping of a forward.
            self.position_keyword = position_keyword or _sequential_position_keyword(module)
            self.positioned = {name for name, layer in module.named_children() if _takes(layer, self.position_keyword)}
            self.mask_keyword = None
            return
        self.positioned = None
        params = inspect.signature(module.forward).parameters
        self.position_keyword = position_keyword or next((k for k in POSITION_KEYWORDS if k in params), None)
        if self.position_keyword is None:
            raise ContextParallelError(f"context parallelism (--cp) passes each token's position to the model, but "
                                       f"{type(module).__name__}.forward takes neither {' nor '.join(POSITION_KEYWORDS)}"
                                       "; add one (RoPE must rotate by the position in the whole sequence), or "
                                       "name it with ContextParallel(positions=...)")
        self.mask_keyword = "attention_mask" if "attention_mask" in params else None

    def forward(self, module: nn.Module, args: tuple, kwargs: dict):
        """`module(*args, **kwargs)` on this rank's chunks of the sequences, its SDPA calls answered by the ring."""
        if not args or not torch.is_tensor(args[0]) or args[0].dim() < 2:
            raise ContextParallelError("context parallelism (--cp) splits the forward's first argument, token ids "
                                       "[batch, seq]; pass them positionally")
        tokens = args[0]
        kwargs = dict(kwargs)
        if self.mask_keyword is not None and kwargs.get(self.mask_keyword) is not None:
            kwargs[self.mask_keyword] = shard_sequence(kwargs[self.mask_keyword], self.size, self.rank)
        if getattr(module, "documents_from_tokens", False) and kwargs.get("documents") is None:
            kwargs["documents"] = tokens  # the whole sequences' ids: a packed document spans the chunks
        local = shard_sequence(tokens, self.size, self.rank)
        return self.local_forward(module, (local, *args[1:]), kwargs, tokens.shape[1])

    def local_forward(self, module: nn.Module, args: tuple, kwargs: dict, seq_len: int):
        """`module(*args, **kwargs)` on inputs that are this rank's chunks already, of sequences of `seq_len`
        tokens (a later pipeline stage's activations): the positions passed, the SDPA calls answered by the ring."""
        local = args[0]
        kwargs = dict(kwargs)
        pos = positions(seq_len, self.size, self.rank, local.device)
        kwargs[self.position_keyword] = pos[None] if self.position_keyword == "position_ids" else pos
        if self.mask_keyword is not None and kwargs.get(self.mask_keyword) is None:
            kwargs[self.mask_keyword] = torch.ones(local.shape[:2], dtype=torch.bool, device=local.device)
        mode = RingSDPA(Ring(self.comm, seq_len, self.axis))
        with mode:
            if isinstance(module, nn.Sequential):
                output = _sequential_forward(module, args, kwargs, self.positioned)
            else:
                output = module(*args, **kwargs)
        if mode.calls == 0 and _expects_attention(module, self.positioned):
            raise ContextParallelError(f"context parallelism (--cp) found no F.scaled_dot_product_attention call in "
                                       f"{type(module).__name__}'s forward; it needs SDPA attention (Hugging Face: "
                                       "attn_implementation=\"sdpa\"), or use --cp 1")
        return output

    def labels(self, labels: torch.Tensor, output_len: int) -> torch.Tensor:
        """This rank's chunks of `labels` when they are the whole sequence's (cp × the output's length); else as is."""
        if labels.dim() >= 2 and labels.shape[1] == output_len * self.size:
            return shard_sequence(labels, self.size, self.rank)
        return labels


def _takes(layer: nn.Module, keyword: str) -> bool:
    return keyword in inspect.signature(layer.forward).parameters


def _sequential_position_keyword(module: nn.Sequential) -> str:
    """The position keyword the layers of `module` take (the attention blocks of a model written as a Sequential)."""
    found = {k for layer in module for k in POSITION_KEYWORDS if _takes(layer, k)}
    if len(found) != 1:
        raise ContextParallelError("context parallelism (--cp) passes each token's position to the layers of an "
                                   f"nn.Sequential that take {' or '.join(POSITION_KEYWORDS)} by keyword, and "
                                   + ("none of this one's does" if not found else "this one's take both") +
                                   "; give its attention blocks one such keyword (e.g. paratrain.interop.hf_stages."
                                   "as_sequential for a Hugging Face model), or use --cp 1")
    return found.pop()


def _sequential_forward(module: nn.Sequential, args: tuple, kwargs: dict, positioned: set[str]):
    """An nn.Sequential's forward that also hands `kwargs` (the positions) to the layers named in `positioned`."""
    x, = args
    for name, layer in module.named_children():
        x = layer(x, **kwargs) if name in positioned else layer(x)
    return x


def _expects_attention(module: nn.Module, positioned: set[str] | None) -> bool:
    """Whether `module` should have called SDPA: any model but a Sequential (a pipeline stage) none of whose layers
    takes positions, as a stage of only the embedding or the head."""
    return not isinstance(module, nn.Sequential) or any(name in positioned for name in module._modules)
