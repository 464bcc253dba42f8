"""Starting JAX's distributed runtime from a cluster resolver, once, with clear failures.

`initialize_distributed` wraps `jax.distributed.initialize` and adds what it
lacks for a training framework:

- it is idempotent (a second call with the same cluster is a no-op);
- a coordinator that cannot be reached raises `TimeoutError` naming the
  address within the timeout (JAX itself aborts the process with
  "DEADLINE_EXCEEDED" and no address); a coordinator port already in use raises
  `OSError` (JAX itself crashes);
- processes that never all join end with a message naming the address and the
  missing count, after the timeout, instead of JAX's bare abort;
- every process must have the same number of local devices (a one-axis mesh
  over all devices assumes it), checked from the global device list;
- every process must have been started with the same number of processes
  (JAX sizes the cluster from process 0 alone), checked through the
  coordination service's key-value store right after joining;
- process 0's coordinator service listens on the coordinator address itself when
  that is a loopback address (JAX's default is every interface), see
  `coordinator_bind_address` (the address's checks are ``coordinator_address.py``'s).

After joining, an uncaught exception ends the process at once (`os._exit`, after
printing it) instead of waiting in JAX's shutdown barrier for peers that will
never arrive; a peer blocked in a collective with it then fails and exits the
same way. A peer that dies without an exception (killed) is noticed by a
process in a collective with it at once; otherwise the coordination service
notices the missing heartbeats after `heartbeat_timeout` seconds (default 20)
and terminates every survivor with "the JAX distributed service detected fatal
errors ... another task died". Not bounded: a collective waiting for a peer
that is alive but stuck, and a `sys.exit(n)` (the normal exit path, with its
barrier, up to the shutdown timeout).

Example:
    >>> from distrain import SimpleClusterResolver
    >>> initialize_distributed(SimpleClusterResolver(None, 1, 0))  # one process: no-op
    SimpleClusterResolver(coordinator_address=None, num_processes=1, process_id=0, ...)
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
from typing import Any

import jax

from distrain._src.cluster.base import ClusterResolver
from distrain._src.cluster.communication import CommunicationOptions
from distrain._src.cluster.coordinator_address import (
    check_port_free,
    coordinator_bind_address,
    wait_for_coordinator,
)
from distrain._src.cluster.resolve import resolve_cluster
from distrain._src.goodput.ledger import milestone

# (coordinator address, num_processes, process_id) of the cluster this process joined.
_joined: tuple[str | None, int, int] | None = None
_lock = threading.Lock()

# Extra seconds JAX's own start-up timeout gets over ours, so that our message
# (naming the address) comes first and JAX's abort is only a backstop.
_JAX_TIMEOUT_MARGIN = 10
# Exit status when the processes never all joined (JAX would abort with SIGABRT).
EXIT_JOIN_TIMEOUT = 3


def _backend_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
        return False


def _requested_platforms() -> str:
    # The ignore: jax.config's options are dynamic attributes, which mypy cannot see up
    # to jax 0.10 (0.12 declares this one: hence unused-ignore, for the range's two ends).
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined, unused-ignore]
    return (platforms or os.environ.get("JAX_PLATFORMS") or "").lower()


def _start_join_watchdog(what: str, timeout: int, num_processes: int) -> threading.Timer:
    def expire() -> None:
        # The main thread is blocked inside JAX's C++ connect and cannot take an
        # exception; JAX would abort a few seconds later without naming the address.
        sys.stderr.write(
            f"distrain: error: not all {num_processes} processes joined the cluster at {what} "
            f"within {timeout} s. Expected every process to start with the same coordinator "
            "address and number of processes and a distinct process id; check the logs of the "
            "other processes.\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_JOIN_TIMEOUT)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    return timer


def _set_local_devices(resolver: ClusterResolver) -> None:
    count = resolver.local_device_count
    platforms = _requested_platforms()
    if count is not None and (platforms in ("", "cpu") or platforms.startswith("cpu")):
        if not _backend_initialized():
            jax.config.update("jax_num_cpu_devices", count)


def _check_devices(resolver: ClusterResolver, options: CommunicationOptions) -> None:
    options.check_platform(jax.default_backend())
    expected = resolver.local_device_count
    local = len(jax.local_devices())
    if expected is not None and local != expected:
        raise RuntimeError(
            f"Process {jax.process_index()} expected {expected} local devices (from the cluster "
            f"resolver, e.g. DISTRAIN_LOCAL_DEVICES) but has {local}. Set the device count "
            "before JAX starts (XLA_FLAGS=--xla_force_host_platform_device_count on CPU) or "
            "fix the resolver."
        )
    counts = collections.Counter(d.process_index for d in jax.devices())
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
        raise RuntimeError(
            "Every process must have the same number of local devices (the replica mesh "
            f"spans all of them evenly). Received: {listing}. Give each process the same "
            "devices (e.g. `distrain launch --devices-per-proc K`)."
        )


def initialize_distributed(
    resolver: ClusterResolver | None = None,
    options: CommunicationOptions | None = None,
) -> ClusterResolver:
    """Joins this process to the cluster `resolver` describes; safe to call again.

    Call it before any other JAX call (JAX's rule): once JAX has created its
    devices the process can no longer join a cluster.

    Args:
        resolver: the cluster; `resolve_cluster()` (env vars > TF_CONFIG > auto) by default.
        options: collectives and timeouts; `CommunicationOptions.from_env()` by default.

    Returns:
        The resolver used.

    Raises:
        ValueError: the task is not part of the synchronous mesh (a "ps" or
            "evaluator" task), or the collectives cannot run on this platform.
        TimeoutError: the coordinator could not be reached within the timeout.
        OSError: process 0 cannot listen on the coordinator port.
        RuntimeError: a different cluster was already joined, JAX had already
            started, or the processes' device counts or expected process counts differ.

    Example:
        >>> import distrain as dt  # with DISTRAIN_* set by `distrain launch`:
        >>> initialize_distributed()  # doctest: +SKIP
    """
    global _joined
    resolver = resolver if resolver is not None else resolve_cluster()
    options = options if options is not None else CommunicationOptions.from_env()
    if resolver.process_id is None:
        raise ValueError(
            f"Task {resolver.task_type}:{resolver.task_id} is not part of the synchronous "
            "cluster: only 'chief' and 'worker' tasks run MultiWorkerMirroredStrategy. Run "
            "'ps' tasks with the parameter-server strategy and evaluators without joining."
        )
    platforms = _requested_platforms()
    if platforms and "cuda" not in platforms and "gpu" not in platforms:
        options.check_platform(platforms.split(",")[0])
    with _lock:
        key = (resolver.coordinator_address, resolver.num_processes, resolver.process_id)
        if _joined is not None:
            if _joined != key and resolver.coordinator_address is not None:
                raise RuntimeError(
                    f"This process already joined a cluster (coordinator, processes, id) = "
                    f"{_joined}; it cannot join {key} as well. A process belongs to one cluster "
                    "for its lifetime: create one MultiWorkerMirroredStrategy and reuse it."
                )
            return resolver
        if jax.distributed.is_initialized():
            # Initialised by the user or a library: accept it if it agrees with the resolver.
            got = (jax.process_count(), jax.process_index())
            want = (resolver.num_processes, resolver.process_id)
            if resolver.coordinator_address is not None and got != want:
                raise RuntimeError(
                    f"jax.distributed is already initialised as process {got[1]} of {got[0]}, "
                    f"but the cluster resolver says process {want[1]} of {want[0]}. Initialise "
                    "once, from the same cluster description."
                )
            _check_devices(resolver, options)
        elif resolver.num_processes > 1:
            timeout = _join(resolver, options)
            _check_cluster(resolver, options, timeout)
            # Only now: a start-up error above is raised by every process, which then
            # leave together through JAX's shutdown barrier, each with its own message.
            if _fail_fast_enabled():
                _install_fail_fast(
                    resolver.process_id, resolver.num_processes, options.heartbeat_timeout
                )
        else:
            _set_local_devices(resolver)
            _check_devices(resolver, options)
        _joined = key
    return resolver


def _join(resolver: ClusterResolver, options: CommunicationOptions) -> int:
    """Starts jax.distributed; returns the start-up seconds left for the checks."""
    if _backend_initialized():
        raise RuntimeError(
            "JAX has already created its devices in this process, so it can no longer join a "
            "cluster. Create the MultiWorkerMirroredStrategy (or call initialize_distributed) "
            "at the start of the program, before any jax.devices(), jax.numpy or jit call."
        )
    if options.cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", options.cpu_collectives)
    _set_local_devices(resolver)
    address = resolver.coordinator_address
    timeout = options.initialization_timeout
    bind_address = None
    if address is not None:
        if resolver.process_id == 0:
            bind_address = coordinator_bind_address(address)
            check_port_free(address, bind_address)
        else:
            timeout = max(1, round(timeout - wait_for_coordinator(address, timeout)))
    what = address if address is not None else "the address auto-detected by JAX"
    watchdog = _start_join_watchdog(what, timeout, resolver.num_processes)
    try:
        kwargs: dict[str, Any] = dict(
            initialization_timeout=timeout + _JAX_TIMEOUT_MARGIN,
            heartbeat_timeout_seconds=options.heartbeat_timeout,
            shutdown_timeout_seconds=options.shutdown_timeout,
        )
        if address is None:
            jax.distributed.initialize(**kwargs)
        else:
            ids = resolver.local_device_ids
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=resolver.num_processes,
                process_id=resolver.process_id,
                local_device_ids=list(ids) if ids is not None else None,
                cluster_detection_method="deactivate",
                coordinator_bind_address=bind_address,
                **kwargs,
            )
    finally:
        watchdog.cancel()
    milestone("distributed")
    return timeout


# Set to "0" to keep Python's normal exit after an uncaught exception (see _install_fail_fast).
ENV_FAIL_FAST = "DISTRAIN_FAIL_FAST"
# Exit status of a process ended by an uncaught exception (Python's own is 1 too).
EXIT_UNCAUGHT = 1


def _fail_fast_enabled() -> bool:
    value = os.environ.get(ENV_FAIL_FAST, "1").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_FAIL_FAST} must be 1 or 0. Received: {value!r}.")


def _install_fail_fast(process_id: int, num_processes: int, heartbeat_timeout: int) -> None:
    """After an uncaught exception, print it and exit at once with status 1 (130 for Ctrl-C).

    A normal interpreter exit runs JAX's atexit hook, which waits in the
    coordination service's shutdown barrier until every process arrives: after an
    error the others never do (they are blocked in a collective with this process,
    or dead), so the failed process would stay alive for the heartbeat timeout
    (100 s) or the shutdown timeout (300 s), and `distrain launch` could not restart
    the job before that. Exiting with `os._exit` closes this process's sockets at
    once, so a peer blocked in a collective with it fails at once too and, through
    this same hook, exits as well.

    What is skipped: atexit handlers and object finalizers (a temporary directory
    may stay behind; an unfinished asynchronous checkpoint stays uncommitted, which
    restore ignores). Standard output, standard error and `logging` are flushed
    first. Only uncaught exceptions take this path; `sys.exit(n)` and a normal
    return keep the normal exit (and its barrier).
    """
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        status = 130 if issubclass(exc_type, KeyboardInterrupt) else EXIT_UNCAUGHT
        try:
            previous(exc_type, exc, tb)
            sys.stderr.write(
                f"distrain: error: process {process_id} of {num_processes} stopped on an "
                f"uncaught {exc_type.__name__}; exiting now with status {status} instead of "
                "waiting in JAX's shutdown barrier for the other processes (they end when "
                "their next collective with this process fails, or after the heartbeat "
                f"timeout of {heartbeat_timeout} s). Set {ENV_FAIL_FAST}=0 to keep Python's "
                "normal exit.\n"
            )
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # a closed or broken stream must not block the exit
                    pass
            logging.shutdown()
        finally:
            os._exit(status)

    sys.excepthook = excepthook


# Key prefix in the coordination service's key-value store for the start-up checks.
_CHECK_KEY = "distrain/cluster/startup_check"


def _check_cluster(resolver: ClusterResolver, options: CommunicationOptions, timeout: int) -> None:
    """The start-up checks, agreed on by all processes: if one fails, every process raises.

    Each process checks its devices and publishes the result with the number of
    processes it was started with (JAX sizes the cluster from process 0 alone, so
    a process started with another DISTRAIN_NUM_PROCESSES but a valid id joins
    without complaint); then every process reads every report.

    Raises:
        RuntimeError: the processes disagree on the number of processes, or a
            process failed its own checks (its message, or one naming it).
        ValueError: this process's collectives cannot run on its platform.
    """
    problem: Exception | None = None
    try:
        _check_devices(resolver, options)
    except (RuntimeError, ValueError) as e:
        problem = e
    client = kv_client()
    if client is None:  # pragma: no cover - initialize() always creates one
        if problem is not None:
            raise problem
        return
    pid = resolver.process_id
    timeout_ms = max(1000, int(timeout * 1000))
    report = {"num_processes": resolver.num_processes, "problem": problem and str(problem)}
    client.key_value_set(f"{_CHECK_KEY}/{pid}", json.dumps(report))

    def read(process: int) -> dict:
        return json.loads(client.blocking_key_value_get(f"{_CHECK_KEY}/{process}", timeout_ms))

    # The cluster's real size is process 0's; every one of its processes has connected.
    reports = {0: read(0)}
    for other in range(1, reports[0]["num_processes"]):
        reports[other] = read(other)
    counts = {p: r["num_processes"] for p, r in reports.items()}
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"process {p} expects {n}" for p, n in sorted(counts.items()))
        raise RuntimeError(
            f"The processes disagree on the number of processes in the job: {listing} (this "
            f"is process {pid}; the cluster has process 0's {counts[0]}). Expected every "
            "process to start with the same DISTRAIN_NUM_PROCESSES (or TF_CONFIG / Slurm "
            "task count); fix the launch command and start all of them again."
        )
    if problem is not None:
        raise problem
    failed = [(p, r["problem"]) for p, r in sorted(reports.items()) if r["problem"]]
    if failed:
        p, message = failed[0]
        raise RuntimeError(
            f"Process {p} failed its start-up checks, so process {pid} stops too: {message}"
        )


def kv_client() -> Any:
    """JAX's distributed key-value client (None without ``jax.distributed``).

    JAX has no public accessor for it; this is the one place that reads it.
    """
    try:
        from jax._src import distributed as jax_distributed

        return jax_distributed.global_state.client
    except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
        return None
