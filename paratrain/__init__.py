"""paratrain: train large language models across many processes.

    mesh = paratrain.init_mesh(dp=4)
    model, optimizer = paratrain.parallelize(model, mesh, optimizer=partial(torch.optim.AdamW, lr=3e-4), zero=3)
"""

__version__ = "0.1.0"

from paratrain.mesh import Mesh, MeshShape, init_mesh  # noqa: E402
from paratrain.parallel.api import parallelize  # noqa: E402

__all__ = ["Mesh", "MeshShape", "init_mesh", "parallelize"]
