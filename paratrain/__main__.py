"""`python -m paratrain ...` (what `torchrun -m paratrain train ...` runs in each process)."""

import gc
import sys

from paratrain.cli import main

code = main()
# What the command made lives until the process ends: frozen, the interpreter's exit skips the final collection's
# walk over torch's objects, 1 to 2 s of one core after every command that imported torch (a launcher's caller
# waits for it).
gc.freeze()
sys.exit(code)
