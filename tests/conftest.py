"""Test set-up: 8 virtual CPU devices, set before JAX initialises its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

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
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep order
