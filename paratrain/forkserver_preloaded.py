"""The worker server's last preload (`paratrain.forkserver.context`): it freezes what the preload made.

What the server imported stays for its life: frozen (as Python's docs advise before forking), the garbage
collector never walks it again, in the server or in a worker forked from it. A full collection in a worker
drops from 0.2 s to under a millisecond, no page of torch's objects is copied by one, and the server's exit
skips the final walk over them (1.1 s of 1.3 s, during which it still held the launcher's stdout); the rest, the
teardown of torch's modules, it skips too (`_leave_at_once`). It is a
module of its own because it must come last: `paratrain.forkserver` itself is imported early in the preload
(by paratrain.ranks), before pytest and transformers.

What a worker creates is never frozen: a model it drops is collected as before. Only a cycle through an
object made by the preload that later became garbage would outlive its use; the preload's objects live to
the end. Imported anywhere but the server's preload, it does nothing.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing.forkserver
import os
import sys


def _is_server_preload() -> bool:
    """Whether this import is the server's preload (`multiprocessing.forkserver.main` is a caller)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is multiprocessing.forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _leave_at_once() -> None:
    """The server's exit: it ends when its launcher does (EOF on its pipe), with nothing of its own to write or remove
    (its socket's directory is the launcher's to remove), so it leaves without tearing torch's modules down: 0.2 s
    of one core, more on a loaded machine, during which it still held the launcher's stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if _is_server_preload():
    gc.freeze()
    atexit.register(_leave_at_once)  # registered last, run first
