import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# pytest-xdist runs one worker per core (addopts: -n auto): each worker's torch takes one thread, else two workers' OpenMP
# threads spin-wait on each other's cores (test_kill_9_during_training took 20 s in one fresh-clone run, 91 s in another); a test that
# needs more threads sets them
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hypothesis import settings

# deterministic example generation: the suite must reproduce exactly in CI
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

import pytest


@pytest.fixture(autouse=True)
def _own_thread_count():
    "A run configured with --threads sets the process's torch thread count (prepare_run applies it); each test gets the count it started with back."
    import torch
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smoke_dir(tmp_path_factory):
    "The smoke preset's sweep, run once in one process (bit-identical to a CLI run); the sweep and cluster tests read it."
    from basedirected.repro import repro_main
    out = tmp_path_factory.mktemp("smoke")
    repro_main(["--preset", "smoke", "--out", str(out), "--quiet", "--jobs", "1"])
    return out


@pytest.fixture(autouse=True)
def _own_subnormals():
    "A run flushes subnormal floats for its process (prepare_run applies its configuration); each test starts and ends with torch's default, keeping them."
    import torch
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(False)
