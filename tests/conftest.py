"""Test-session settings that must be in place before torch compiles anything."""

import getpass
import os
import tempfile

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
