"""`python -m paratrain ...` (what `torchrun -m paratrain train ...` runs in each process)."""

import sys

from paratrain.cli import main

sys.exit(main())
