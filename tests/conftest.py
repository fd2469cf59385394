import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import settings

# deterministic example generation: the suite must reproduce exactly in CI
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
