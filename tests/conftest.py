import os
import sys

# The suite runs from a source checkout without installing it too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module: a worker runs hundreds of tests, and
    XLA:CPU's executables (the interpret-mode kernels' are large) would otherwise stay in memory
    to the end of the run."""
    yield
    jax.clear_caches()
