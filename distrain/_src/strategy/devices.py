"""Turning user device specs (``jax.Device``, ``3``, ``"cpu:1"``, ``"/gpu:0"``) into devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import jax

DeviceSpec: TypeAlias = jax.Device | int | str


def parse_device(spec: DeviceSpec, candidates: Sequence[jax.Device] | None = None) -> jax.Device:
    """Returns the device named by ``spec``.

    Raises:
      ValueError: if no such device exists; the message lists the available ones.
    """
    devices = list(candidates if candidates is not None else jax.devices())
    if isinstance(spec, jax.Device):
        if spec in devices:
            return spec
    elif isinstance(spec, int) and not isinstance(spec, bool):
        match = [d for d in devices if d.id == spec]
        if match:
            return match[0]
    elif isinstance(spec, str):
        name = spec.strip().lower().lstrip("/").removeprefix("device:")
        platform, _, index = name.partition(":")
        platform = {"gpu": "gpu", "cuda": "gpu", "cpu": "cpu", "tpu": "tpu"}.get(platform, platform)
        if index.isdigit():
            same = [d for d in devices if _platform(d) == platform]
            if int(index) < len(same):
                return same[int(index)]
    available = ", ".join(f"{_platform(d)}:{i}" for i, d in enumerate(devices))
    raise ValueError(
        f"No device matches {spec!r}. Expected a jax.Device, a device id, or a string like "
        f"'cpu:0'. Available devices: {available}."
    )


def parse_devices(specs: Sequence[DeviceSpec] | None) -> list[jax.Device]:
    """Parses device specs (``None``: all local devices); rejects empty or duplicate lists."""
    if specs is None:
        return list(jax.local_devices())
    if isinstance(specs, str | int | jax.Device):
        specs = [specs]
    devices = [parse_device(s) for s in specs]
    if not devices:
        raise ValueError("`devices` must name at least one device. Received an empty list.")
    if len(set(devices)) != len(devices):
        raise ValueError(f"`devices` contains duplicates. Received: {list(specs)!r}.")
    return devices


def _platform(d: jax.Device) -> str:
    return "gpu" if d.platform in ("gpu", "cuda", "rocm") else d.platform
