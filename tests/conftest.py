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
