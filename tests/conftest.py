"""Test-session settings that must be in place before torch compiles anything."""

import getpass
import os
import sys
import tempfile
from pathlib import Path

# Tests live in folders by room (tests/parallel/data, tests/plan, ... ) and import the shared helpers
# (`parallel_cases`, `hf_families`, ...) and each other by bare module name; the rank processes `run_on_ranks` starts
# unpickle test functions by module name too. Every folder of tests is on the import path, so a name resolves
# wherever its module lives (the rank processes inherit the path).
_TESTS = Path(__file__).resolve().parent
for _folder in sorted({_TESTS, *(path.parent for path in _TESTS.rglob("test_*.py"))}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# The `multirank` mark, derived from each test's code and checked as it runs (tests/process_marks.py).
pytest_plugins = ["process_marks"]

# Inductor's on-disk caches (generated C++, its compile flags, precompiled headers) are keyed without the CPU kernel
# path ATEN_CPU_CAPABILITY picks: a suite run under `default` after one under avx512 reuses vectorized code and
# compiles it without the vector flags ("'at::vec' has not been declared"). One cache per path keeps the reuse
# across runs and `tests/other_machines.sh` honest. The rank processes inherit it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY') or 'native'}"))

# Under pytest-xdist each worker shares the machine's cores with the others (and with the ranks a multi-rank test
# starts): one intra-op thread each, as the ranks have, instead of threads that wait on each other for a core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)
