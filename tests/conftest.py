import os
import shutil
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


# The files that take longest (`--durations` of a full run), started first: with a file per worker, a long file taken last keeps one core
# busy while the other idles. The rest keep their order.
LONGEST_FIRST = ("test_steppers.py", "test_faults.py", "test_docs.py", "test_cluster.py", "test_fine_tuning.py", "test_experiments.py", "test_hf.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: a file's tests stay in their order


@pytest.fixture(scope="session")
def smoke_dir(tmp_path_factory, request):
    "The smoke preset's sweep, run once in one process (bit-identical to a CLI run); the sweep and cluster tests read it, on every xdist worker the same one."
    from filelock import FileLock
    from basedirected.repro import repro_main
    worker = getattr(request.config, "workerinput", None)  # an xdist worker's (pytest -p no:xdist has no worker_id fixture)
    root = tmp_path_factory.getbasetemp() if worker is None else tmp_path_factory.getbasetemp().parent  # the workers' shared folder
    out = root / "smoke-shared"
    with FileLock(str(out) + ".lock"):  # the first worker to ask runs it; the other waits and reads it
        if not (out / "results.csv").is_file():
            if out.exists(): shutil.rmtree(out)
            repro_main(["--preset", "smoke", "--out", str(out), "--quiet", "--jobs", "1"])
    return out


@pytest.fixture(autouse=True)
def _own_subnormals():
    "A run flushes subnormal floats for its process (prepare_run applies its configuration); each test starts and ends with torch's default, keeping them."
    import torch
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(False)
