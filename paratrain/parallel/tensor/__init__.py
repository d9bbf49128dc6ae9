"""Tensor parallelism (Megatron-style) with sequence parallelism.

- `collectives`: the flat collectives along any dim, and `TensorParallelError`.
- `primitives`: autograd functions named by both passes
  (`copy_to_tp`, `reduce_from_tp`, `gather_sequence`, ...).
- `layers`: column, row and vocabulary-parallel layers, each with its partition math and
  communication per pass, and the vocab-parallel cross-entropy.
- `plan`: styles (`Colwise`, `Rowwise`, `TPRegion`, ...) and `apply_tensor_parallel`, which
  applies a plan {module-name pattern: style} to a plain model in place.
- `adapters`: the LoRA twins of the column and row layers (each adapter split with its base linear).
- `info`: `TensorParallelInfo` (what a plan did) and the whole-model norms that read it.

Ready plans for the reference model and Hugging Face families live beside the model, in
`paratrain.models.tp_plans`.
"""

from paratrain.parallel.tensor.collectives import TensorParallelError, check_divisible  # noqa: F401
from paratrain.parallel.tensor.primitives import (  # noqa: F401
    InitFn, copy_to_tp, enter_tp_region, gather_from_tp, gather_sequence, reduce_from_tp, reduce_scatter_sequence,
    scatter_to_tp,
)
from paratrain.parallel.tensor.layers import (  # noqa: F401
    ColumnParallelLinear, RowParallelLinear, TensorParallelLayer, VocabParallelEmbedding, gather_full,
    linear_features, tp_rng, vocab_parallel_cross_entropy,
)
from paratrain.parallel.tensor.info import (  # noqa: F401
    TensorParallelInfo, clip_grad_norm_tp_, full_parameters, tp_grad_norm_sq, tp_norm_sq, tp_norm_sq_parts,
)
from paratrain.parallel.tensor.plan import (  # noqa: F401
    AttentionRegion, Colwise, OutputHead, PartialGradients, Rowwise, SequenceParallelNorm, SequenceShardInput, Style,
    TPRegion, VocabEmbedding, apply_tensor_parallel,
)
