"""The import path of tensor-parallel plans before the strategies became packages, kept for users' code.

Styles and `apply_tensor_parallel` live in `paratrain.parallel.tensor`; the ready plans beside the
reference model, in `paratrain.models.tp_plans`; the layout rules of both, in `paratrain.parallel.rules`.
"""

from paratrain.models.tp_plans import HF_GPT2_PLAN, HF_LLAMA_PLAN, LLAMA_SP_PLAN, LLAMA_TP_PLAN  # noqa: F401
from paratrain.parallel.rules import llama_tp_violations, sequence_parallel_violations  # noqa: F401
from paratrain.parallel.tensor import *  # noqa: F401,F403
