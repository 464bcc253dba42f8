"""Test set-up: 8 virtual CPU devices, set before JAX initialises its backend."""

import atexit
import importlib.util
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the run: pytest-xdist's workers and every
# process a test starts inherit it. The suite compiles the same programs many times,
# mostly in fresh processes (a SIGKILL and its rerun, the CLI, the docs' commands). A
# new directory per run, so no test sees an entry of another checkout;
# DISTRAIN_TEST_XLA_CACHE=0 turns it off.
_cache_wanted = os.environ.get("DISTRAIN_TEST_XLA_CACHE") != "0"
if _cache_wanted and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="distrain-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = f"{_flags} --xla_force_host_platform_device_count=8"
# XLA:CPU spends most of a test's compile in LLVM's optimisation passes, which the tests
# do not need (a test compares values, never speed; buffer assignment, hence memory
# analysis, happens before LLVM). Without them compile-heavy tests run 17-20% faster
# (README, "Test time"). DISTRAIN_TEST_XLA_FAST_COMPILE=0 keeps XLA's defaults. The processes a
# test starts inherit them: `tests.processes.xla_flags` adds them to a test's own flags.
_compile = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if os.environ.get("DISTRAIN_TEST_XLA_FAST_COMPILE") == "0":
    _compile = ""
os.environ["DISTRAIN_TEST_XLA_COMPILE_FLAGS"] = _compile
if _compile and "backend_optimization_level" not in _flags:
    _flags = f"{_flags} {_compile}"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_DEVICES = 8


@pytest.fixture(scope="session")
def devices():
    """All 8 virtual CPU devices; fails (never skips) if there are fewer."""
    devs = jax.devices()
    assert len(devs) == NUM_DEVICES, f"expected {NUM_DEVICES} CPU devices, got {len(devs)}"
    return devs


# The files that take a minute or more (real processes, local Ray clusters, the LM
# example's compiles) are collected first, so that under `pytest -n 2 --dist loadfile`
# they start first and the run does not end waiting on one of them.
_SLOW_FILES_FIRST = (
    "test_example_lm.py",
    "test_ray_train.py",
    "test_example_seeds.py",
    "test_lm_packed.py",
    "test_replica_mesh.py",
    "test_benchmarks.py",
    "test_ps_ray.py",
    "test_tracking.py",
    "test_multi_worker_failures.py",
    "test_islands_faults.py",
)


# `make test` runs the suite on both ends of the jax range and sets DISTRAIN_TEST_END to
# the end it runs. A slow test of what does not change with jax (real processes, Ray,
# the CLI's words, the docs, the benchmark scripts) is marked `one_end("newest")` or
# `one_end("lowest")` and runs on that end only. A slow parametrized test marked
# `split_ends` runs its variants on alternate ends (the first on the lowest, the second
# on the newest, ...): each end still runs the test, on half of its cases. Without the
# variable (plain `pytest`, or a `make test` that has no Python 3.12 for the newest
# end) every test runs. docs/architecture.md ("Tests") says how to choose.
ENDS = ("lowest", "newest")


def _end_of(item, variants: dict) -> str | None:
    """The end ``item`` runs on (None: both), from its one_end / split_ends marker."""
    one = item.get_closest_marker("one_end")
    split = item.get_closest_marker("split_ends")
    # A test's own marker overrides its module's; two of its own contradict each other.
    named = {m.args for m in item.own_markers if m.name == "one_end"}
    if len(named) > 1:
        raise pytest.UsageError(
            f"{item.nodeid}: one_end names two ends: {sorted(named)}; keep the one it runs on."
        )
    if one is not None and (len(one.args) != 1 or one.args[0] not in ENDS):
        raise pytest.UsageError(f"{item.nodeid}: one_end takes one of {ENDS}; got {one.args!r}.")
    if split is not None:
        if one is not None or getattr(item, "callspec", None) is None:
            raise pytest.UsageError(
                f"{item.nodeid}: split_ends is for a parametrized test without one_end "
                "(its variants alternate between the ends); use one_end for a single test."
            )
        group = (item.path, getattr(item.cls, "__name__", None), item.originalname)
        i = variants[group] = variants.get(group, -1) + 1
        return ENDS[i % 2]
    return one.args[0] if one is not None else None


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep order
    end = os.environ.get("DISTRAIN_TEST_END")
    if end and end not in ENDS:
        raise pytest.UsageError(f"DISTRAIN_TEST_END must be one of {ENDS}; got {end!r}.")
    keep, other_end, variants = [], [], {}
    for item in items:
        its_end = _end_of(item, variants)
        (other_end if end and its_end not in (None, end) else keep).append(item)
    if other_end:
        config.hook.pytest_deselected(items=other_end)
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    # MLflow's SQL store (the mlflow extra's sqlite://) uses a loader SQLAlchemy 2.1
    # deprecates. Added here, not in pyproject.toml: there a filter naming an absent
    # module is an error that stops pytest (seen on a machine without MLflow).
    if importlib.util.find_spec("sqlalchemy") is not None:
        config.addinivalue_line("filterwarnings", "ignore::sqlalchemy.exc.SADeprecationWarning")


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster for the module's tests (the islands' coordinator actors)."""
    import ray

    from distrain._src.ps.ray_backend import connect

    assert connect(None), "Ray was already running; this module starts its own"
    try:
        yield ray
    finally:
        ray.shutdown()
