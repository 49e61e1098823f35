import os
import shutil
import sys
import tempfile

# The suite runs from a source checkout without installing it too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import importlib.metadata  # noqa: E402
import subprocess  # noqa: E402

from tests.helpers import CHILD_XLA_OPTIONS, xla_flags_text  # noqa: E402


def _use_fast_compile_flags():
    """On a CPU-only JAX, the whole run compiles with ``CHILD_XLA_OPTIONS`` (the backend's lowest
    optimisation level, elemental emitters): the suite compiles thousands of small programs and
    runs each briefly, so compile time is most of its time. Set in the environment before JAX
    starts its backend, they reach the xdist workers and the child processes of the tests alike.
    Not on a JAX with a GPU plugin (``pytest -m gpu`` checks the kernels as they are served), not
    when ``LEAPQUANT_TEST_XLA_FLAGS=0``, and not where this XLA refuses a flag (a trial start of
    JAX in a subprocess: an unknown flag in ``XLA_FLAGS`` aborts the process)."""
    if os.environ.get("LEAPQUANT_TEST_XLA_FLAGS") == "0" or "PYTEST_XDIST_WORKER" in os.environ:
        return
    if list(importlib.metadata.entry_points(group="jax_plugins")):
        return
    flags = xla_flags_text(CHILD_XLA_OPTIONS)
    if flags in os.environ.get("XLA_FLAGS", ""):
        return
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip(), JAX_PLATFORMS="cpu")
    probe = "import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.float32(0)).block_until_ready()"
    if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0:
        os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]


_use_fast_compile_flags()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module: a worker runs hundreds of tests, and
    XLA:CPU's executables (the interpret-mode kernels' are large) would otherwise stay in memory
    to the end of the run."""
    yield
    jax.clear_caches()


# One persistent compilation cache for the run, shared by the xdist workers (and the child
# processes some tests start): a program compiled once (the conftest drops the in-memory ones
# after each module) is read back instead of compiled again. Every program is cached, however
# fast its compile. The cache holds XLA's executables as compiled: the programs and their
# rounding are those of a compile. A JAX_COMPILATION_CACHE_DIR given by the caller is used as it is.
CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _use_compilation_cache(config):
    """The controller (or a run without xdist) makes the cache's folder and exports it; a worker
    reads it from the environment it inherits."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ and not hasattr(config, "workerinput"):
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config._leapquant_cache = tempfile.mkdtemp(prefix="jax-cache-")
        os.environ.update(CACHE_ENV)
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1)))
        jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                          int(os.environ.get("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", 0)))


def pytest_unconfigure(config):
    """Removes the cache folder this run made."""
    folder = getattr(config, "_leapquant_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


def pytest_configure(config):
    """Under ``-n`` without a ``--dist`` of its own, schedules by ``xdist_group`` (``--dist
    loadgroup``): a grouped module runs on one worker, so its module-scoped fixtures run once.
    A worker reads the command line again rather than the controller's choice, so it is told
    here too. Plain ``pytest``, without pytest-xdist, only learns the marker's name."""
    config.addinivalue_line("markers", "xdist_group(name): tests that one pytest-xdist worker runs together")
    _use_compilation_cache(config)
    given = list(config.invocation_params.args) + os.environ.get("PYTEST_ADDOPTS", "").split()
    if any(arg == "--dist" or arg.startswith("--dist=") for arg in given):
        return
    if hasattr(config, "workerinput"):
        config.option.loadgroup = True
    elif getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadgroup"


def _xdist_group_name(item):
    """The group name xdist's loadgroup scheduling gives an item, or None when it has no
    ``xdist_group`` mark (the same rule as xdist: the marks' names, sorted, joined by "_")."""
    names = set()
    for mark in item.iter_markers("xdist_group"):
        names.add(str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")))
    return "_".join(sorted(names)) if names else None


def _select_gpu_tests(config, items):
    """Tests marked ``gpu`` (compiled kernels, ``tests/test_gpu_checks.py``) run only when ``-m``
    names the mark (``pytest -m gpu``): the normal suite deselects them. Selected on a machine
    without a GPU, they are skipped."""
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return
    if "gpu" not in (config.option.markexpr or ""):
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
        config.hook.pytest_deselected(items=marked)
    elif jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason=f"needs a GPU (JAX backend here: {jax.default_backend()})")
        for item in marked:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Selects the ``gpu`` tests (``_select_gpu_tests``), then makes ``--dist loadgroup`` group
    the tests again under pytest >= 9.2.

    On each worker, pytest-xdist tells the scheduler an item's group by appending "@<group>" to
    its node id, and it does so by assigning ``item._nodeid``. From pytest 9.2 a node's id is the
    ``_pytest.nodeid.NodeId`` held in ``item._id`` and ``item.nodeid`` is derived from it, so
    that assignment no longer changes the id the scheduler sees: the grouped modules' tests spread
    over the workers and their module-scoped fixtures (the expensive ones are why the modules are
    grouped) run once per worker. This hook runs after xdist's and adds the suffix to ``_id``.

    It does nothing outside an xdist worker under loadgroup, on a pytest without
    ``_pytest.nodeid``, or for an item whose id already carries the suffix (an xdist and pytest
    pair where xdist's own suffix takes effect).
    """
    _select_gpu_tests(config, items)
    # On a worker, xdist resets --dist to "no" and keeps "is it loadgroup" in option.loadgroup.
    if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:
        return
    for item in items:
        group = _xdist_group_name(item)
        if group is None:
            continue
        suffix = "@" + group
        nodeid = item.nodeid
        if nodeid.endswith(suffix) or not isinstance(getattr(item, "_id", None), NodeId):
            continue
        item._id = NodeId.parse(nodeid + suffix)
