"""paratrain: train large language models across many processes.

    mesh = paratrain.init_mesh(dp=4)
    model, optimizer = paratrain.parallelize(model, mesh, optimizer=partial(torch.optim.AdamW, lr=3e-4),
                                             data=paratrain.DataParallel(zero=3))
"""

__version__ = "0.1.0"

from paratrain.mesh import Mesh, MeshShape, init_mesh  # noqa: E402
from paratrain.errors import ParatrainError, RunFailure  # noqa: E402
from paratrain.parallel.api import (  # noqa: E402
    ContextParallel, DataParallel, GradReduction, ModelSpec, PipelineParallel, TensorParallel, parallelize,
)
from paratrain.parallel.model import ParallelModel  # noqa: E402
from paratrain.parallel.pipeline.schedules import ScheduleName  # noqa: E402

__all__ = ["ContextParallel", "DataParallel", "GradReduction", "Mesh", "MeshShape", "ModelSpec", "ParallelModel", "ParatrainError", "PipelineParallel",
           "RunFailure", "ScheduleName", "TensorParallel", "init_mesh", "parallelize"]
