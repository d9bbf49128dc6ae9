"""The one private autograd API paratrain uses, behind one function."""

from __future__ import annotations

from typing import Callable

from torch.autograd import Variable


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the current backward pass has finished computing every gradient.

    Must be called from inside a backward pass (e.g. a gradient hook). torch has
    no public API for "backward is over"; DDP and FSDP use this same call.
    """
    Variable._execution_engine.queue_callback(callback)
