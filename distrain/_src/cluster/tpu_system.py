"""Whether this machine has TPUs, and ``dt.initialize_tpu_system``: JAX's TPU runtime, once.

TensorFlow's ``tf.tpu.experimental.initialize_tpu_system(resolver)`` connects to a TPU
system and initialises it. On JAX the TPU runtime (libtpu) starts with JAX's backend,
in every process of the slice, and ``jax.distributed`` joins the processes; so here it
means, idempotently:

1. check that this machine has TPUs *before* anything starts: one clear error otherwise
   (``check_tpu_available``), never a backend that falls back to the CPU;
2. join the processes of the slice (``initialize_distributed`` with a
   ``TPUClusterResolver``; one process when the machine gives no TPU worker id);
3. start JAX's backend and check that its devices are TPUs.

``tf.config.experimental_connect_to_cluster(resolver)`` has no JAX meaning (there is no
remote TPU to connect to): drop that line.

Whether there are TPUs is read as JAX itself decides whether to start its TPU runtime:
from the PCI bus (``/sys/bus/pci/devices``: Google's vendor id and a TPU chip's device
id), without starting anything; ``JAX_FORCE_TPU_INIT`` skips that check, as in JAX.

Example:
    >>> tpu_unavailable_reason(pci_root="/nonexistent")  # doctest: +SKIP
    "no TPU chip on this machine's PCI bus (...)"
"""

from __future__ import annotations

import glob
import importlib.util
import os
import threading
from collections.abc import Mapping

import jax

from distrain._src.cluster.base import ClusterResolver
from distrain._src.cluster.communication import CommunicationOptions
from distrain._src.cluster.resolvers import SimpleClusterResolver
from distrain._src.cluster.runtime import (
    _backend_initialized,
    _requested_platforms,
    initialize_distributed,
)
from distrain._src.cluster.tpu_resolver import TPUClusterResolver

PCI_DEVICES = "/sys/bus/pci/devices"
GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of Cloud TPU chips (the table JAX's own detection uses, in
# jax/_src/hardware_utils.py, as of jax 0.12; tests/test_tpu_strategy.py checks that this
# one holds every id the installed jax knows).
TPU_PCI_DEVICE_IDS = {
    "0x0027": "v2/v3",
    "0x0056": "plc (no public name)",
    "0x005e": "v4",
    "0x0062": "v5p",
    "0x0063": "v5e",
    "0x006f": "v6e",
    "0x0076": "tpu7x",
    "0x0083": "tpu8i",
    "0x007c": "tpu8t",
}
ENV_FORCE_TPU_INIT = "JAX_FORCE_TPU_INIT"
ENV_TPU_LIBRARY_PATH = "TPU_LIBRARY_PATH"

_lock = threading.Lock()
_system: ClusterResolver | None = None


def count_tpu_chips(pci_root: str | None = None) -> int:
    """TPU chips on this machine's PCI bus (no backend, no network).

    Example:
        >>> count_tpu_chips("/nonexistent")
        0
    """
    chips = 0
    for vendor_path in glob.glob(os.path.join(pci_root or PCI_DEVICES, "*", "vendor")):
        try:
            with open(vendor_path) as f:
                vendor = f.read().strip()
            if vendor != GOOGLE_PCI_VENDOR:
                continue
            with open(os.path.join(os.path.dirname(vendor_path), "device")) as f:
                device = f.read().strip()
        except OSError:  # a device removed while listing
            continue
        chips += device in TPU_PCI_DEVICE_IDS
    return chips


def _libtpu_installed(environ: Mapping[str, str]) -> bool:
    path = environ.get(ENV_TPU_LIBRARY_PATH)
    if path and os.path.isfile(path):
        return True
    return importlib.util.find_spec("libtpu") is not None


def absent_reason(
    *, started: list[str] | None, requested: str, force: bool, chips: int, libtpu: bool
) -> str | None:
    """Why JAX will not run on TPUs here, or None (the decision, from gathered facts).

    Args:
        started: the platforms of JAX's devices if its backend has started, else None.
        requested: ``JAX_PLATFORMS`` (lower case, "" when unset).
        force: ``JAX_FORCE_TPU_INIT`` is set.
        chips: TPU chips on the PCI bus.
        libtpu: JAX's TPU runtime is installed.
    """
    if started is not None:
        if "tpu" in started:
            return None
        return f"JAX has already started, and its devices are {started} (no TPU among them)"
    if requested and "tpu" not in requested.split(","):
        return f"JAX_PLATFORMS={requested!r} leaves TPUs out"
    if force:
        return None
    if chips == 0:
        return (
            f"no TPU chip on this machine's PCI bus ({PCI_DEVICES}: no device with Google's "
            f"vendor id {GOOGLE_PCI_VENDOR} and a TPU device id)"
        )
    if not libtpu:
        return (
            f"{chips} TPU chips are attached, but JAX's TPU runtime (libtpu) is not installed: "
            "pip install 'distrain[tpu]'"
        )
    return None


def tpu_unavailable_reason(
    environ: Mapping[str, str] | None = None, pci_root: str | None = None
) -> str | None:
    """Why JAX will not run on TPUs in this process, or None; starts nothing."""
    env = os.environ if environ is None else environ
    started = sorted({d.platform for d in jax.devices()}) if _backend_initialized() else None
    return absent_reason(
        started=started,
        requested=(
            _requested_platforms() if environ is None else env.get("JAX_PLATFORMS", "").lower()
        ),
        force=bool(env.get(ENV_FORCE_TPU_INIT)),
        chips=count_tpu_chips(pci_root) if started is None else 0,
        libtpu=_libtpu_installed(env),
    )


def check_tpu_available(what: str = "dt.TPUStrategy") -> None:
    """Raises one clear error if JAX will not run on TPUs here; joins and starts nothing.

    Raises:
        RuntimeError: no TPU devices, and what to use instead.
    """
    reason = tpu_unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"{what} needs TPU devices, and this process has none: {reason}. On CPUs and GPUs "
            "use dt.MirroredStrategy() (the devices of this machine) or "
            "dt.MultiWorkerMirroredStrategy() (several machines); on a Cloud TPU VM or in a "
            "GKE TPU pod, install distrain[tpu] and start the program on every host of the "
            "slice."
        )


def default_tpu_resolver() -> ClusterResolver:
    """`TPUClusterResolver()` where a TPU worker id can be read, else one process."""
    if TPUClusterResolver.is_present():
        return TPUClusterResolver()
    return SimpleClusterResolver(None, 1, 0, _source="TPU (one host, no TPU worker id)")


def tpu_devices() -> list[jax.Device]:
    """JAX's TPU devices in process order (starts the backend).

    Raises:
        RuntimeError: JAX's devices are not TPUs.
    """
    devices = jax.devices()
    platforms = sorted({d.platform for d in devices})
    if platforms != ["tpu"]:
        raise RuntimeError(
            f"JAX started on {platforms} devices, not on TPUs: expected the TPU runtime to "
            "start (check JAX_PLATFORMS and that libtpu matches jax: pip install "
            "'distrain[tpu]'). On CPUs and GPUs use dt.MirroredStrategy() or "
            "dt.MultiWorkerMirroredStrategy()."
        )
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def initialize_tpu_system(cluster_resolver: ClusterResolver | None = None) -> ClusterResolver:
    """Starts JAX's TPU runtime and joins the slice's processes; safe to call again.

    TensorFlow's ``tf.tpu.experimental.initialize_tpu_system(resolver)``. On JAX it checks
    that this machine has TPUs (one clear error before anything starts, otherwise),
    joins the processes of the slice through ``jax.distributed`` (``dt.TPUStrategy``
    does the same, so the call is optional), and starts the backend. A second call
    returns the resolver of the first. TF's return value, a ``Topology``, has no
    counterpart: ``jax.devices()`` lists the chips, each with its ``coords``.

    Call it first thing in the program, as ``dt.MultiWorkerMirroredStrategy``: JAX joins
    a cluster only before its backend starts.

    Args:
        cluster_resolver: the processes; default ``dt.TPUClusterResolver()`` where a TPU
            worker id can be read (a Cloud TPU VM, a GKE TPU pod), else one process.

    Returns:
        The resolver of the processes joined.

    Raises:
        RuntimeError: no TPU devices here, or a different cluster was joined already.
        TypeError: ``cluster_resolver`` is not a ``dt.ClusterResolver``.
        ValueError: the resolver's variables are missing or malformed.

    Example:
        >>> import distrain as dt                   # on every host of a TPU slice:
        >>> resolver = dt.TPUClusterResolver(tpu="")  # doctest: +SKIP
        >>> dt.initialize_tpu_system(resolver)        # doctest: +SKIP
        >>> strategy = dt.TPUStrategy(resolver)       # doctest: +SKIP
    """
    global _system
    if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
        raise TypeError(
            "cluster_resolver must be a dt.ClusterResolver (e.g. dt.TPUClusterResolver()). "
            f"Received: {type(cluster_resolver).__name__}."
        )
    check_tpu_available("dt.initialize_tpu_system")
    with _lock:
        if cluster_resolver is None:
            if _system is not None:
                return _system
            cluster_resolver = default_tpu_resolver()
        initialize_distributed(cluster_resolver, CommunicationOptions.from_env())
        tpu_devices()
        _system = cluster_resolver
    return cluster_resolver
