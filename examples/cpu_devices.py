"""Virtual CPU devices for the examples: asked for before JAX starts, checked after.

Imports no JAX at module level, so a ``main.py`` can call :func:`use_cpu_devices`
first thing.

Example::

    use_cpu_devices(args.devices)          # before anything touches a device
    strategy = mirrored_strategy(args.devices)
"""

from __future__ import annotations

import os
from typing import Any

_FLAG = "--xla_force_host_platform_device_count"


def use_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` virtual CPU devices, one replica each.

    XLA reads the flag once, when JAX creates its CPU backend (the first time any
    device is used), so it must be set before that; it has no effect afterwards
    (e.g. under pytest, whose conftest already set 8), nor when ``XLA_FLAGS`` already
    names a count, and none on GPUs or TPUs.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()


def mirrored_strategy(n: int) -> Any:
    """A ``dt.MirroredStrategy`` over the first ``n`` devices.

    Raises:
      ValueError: JAX has fewer than ``n`` devices.
    """
    import jax

    import distrain as dt

    if jax.device_count() < n:
        raise ValueError(
            f"--devices {n} asks for more replicas than JAX has devices "
            f"({jax.device_count()}); the count is fixed when JAX starts (XLA_FLAGS). "
            f"Use --devices {jax.device_count()} or fewer."
        )
    return dt.MirroredStrategy(jax.devices()[:n])
