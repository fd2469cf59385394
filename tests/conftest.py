import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

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
