"""The coordinator's address: reaching process 0's coordinator, and where it listens.

Process 0 starts JAX's coordination service; the others connect to it. This module
waits for it with a bound and a message naming the address (:func:`wait_for_coordinator`;
JAX itself aborts with "DEADLINE_EXCEEDED"), checks that its port is free before process
0 starts it (:func:`check_port_free`; JAX itself crashes), and binds it to the
coordinator address itself when that is a loopback address
(:func:`coordinator_bind_address`; JAX's default is every interface).

Example:
  >>> coordinator_bind_address("127.0.0.1:8476", {})
  '127.0.0.1:8476'
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from collections.abc import Mapping

from distrain._src.cluster.base import parse_address

__all__ = [
    "ENV_JAX_BIND_ADDRESS",
    "check_port_free",
    "coordinator_bind_address",
    "wait_for_coordinator",
]


def wait_for_coordinator(address: str, timeout: float, *, poll_interval: float = 0.2) -> float:
    """Waits until a TCP connection to `address` succeeds; returns the seconds it took.

    Process 0 starts the coordinator, possibly after the others: so connection
    failures are retried until `timeout` seconds have passed.

    Args:
        address: "host:port" of the coordinator.
        timeout: seconds to keep trying.
        poll_interval: seconds between attempts.

    Raises:
        TimeoutError: nothing accepted a connection at `address` within `timeout`.
        ValueError: `address` is not "host:port".

    Example:
        >>> wait_for_coordinator("127.0.0.1:1", timeout=0.1)  # doctest: +SKIP
        TimeoutError: Could not reach the coordinator at 127.0.0.1:1 within 0.1 s ...
    """
    host, port = parse_address(address, field="coordinator address")
    start = time.monotonic()
    last_error: OSError | None = None
    while True:
        remaining = timeout - (time.monotonic() - start)
        if remaining <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 2.0)):
                return time.monotonic() - start
        except OSError as e:  # refused / unreachable / DNS: the coordinator may start later
            last_error = e
        time.sleep(min(poll_interval, max(0.0, timeout - (time.monotonic() - start))))
    raise TimeoutError(
        f"Could not reach the coordinator at {address} within {timeout:g} s "
        f"(last error: {last_error}). Expected process 0 to be listening there: check that it "
        "started, that the address and port are the same in every process, and that no "
        "firewall blocks the port."
    )


# JAX's own variable for where process 0's coordinator service listens ("host:port").
ENV_JAX_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def coordinator_bind_address(address: str, environ: Mapping[str, str] | None = None) -> str:
    """Where process 0's coordinator service listens, for coordinator address `address`.

    JAX binds every interface (``[::]:port``) unless told otherwise. Here:

    - ``JAX_COORDINATOR_BIND_ADDRESS`` if set (JAX's own variable: the user's choice);
    - the coordinator address itself when its host is a loopback address (127.0.0.1,
      ::1, localhost): every process connects there, so nothing needs more, and
      nothing off this machine can reach it (`distrain launch` uses 127.0.0.1);
    - else ``[::]:port``, JAX's default: the address the others use may not be one
      this machine can bind (a NAT, a Kubernetes service, a name that resolves to
      127.0.1.1 here and to the network address elsewhere).

    Raises:
        ValueError: ``JAX_COORDINATOR_BIND_ADDRESS`` is not "host:port".

    Example:
        >>> coordinator_bind_address("127.0.0.1:8476", {})
        '127.0.0.1:8476'
        >>> coordinator_bind_address("10.0.0.1:8476", {})
        '[::]:8476'
    """
    env = os.environ if environ is None else environ
    host, port = parse_address(address, field="coordinator address")
    chosen = env.get(ENV_JAX_BIND_ADDRESS)
    if chosen:
        # Its port may differ from the address's (a forwarded port): taken as given.
        parse_address(chosen, field=ENV_JAX_BIND_ADDRESS)
        return chosen
    if _is_loopback(host):
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"[::]:{port}"


def check_port_free(address: str, bind_address: str | None = None) -> None:
    """Raises if process 0 cannot listen on the port of `address` (JAX would crash).

    Args:
        address: the coordinator address ("host:port").
        bind_address: where the coordinator will listen (`coordinator_bind_address`);
            default ``[::]:port``, every interface.

    Raises:
        OSError: the port is already in use.

    Example:
        >>> check_port_free("127.0.0.1:1")  # doctest: +SKIP
    """
    _, port = parse_address(address, field="coordinator address")
    bind_host = "::"
    if bind_address is not None:
        bind_host, port = parse_address(bind_address, field="coordinator bind address")
    # SO_REUSEADDR ignores TIME_WAIT leftovers of an earlier run on the same port, so
    # only a live listener makes this fail.
    if bind_host in ("::", "0.0.0.0"):
        family, host = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "0.0.0.0")
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            family, host = socket.AF_INET, "0.0.0.0"
            sock = socket.socket(family, socket.SOCK_STREAM)
    else:
        try:
            info = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM)[0]
        except OSError as e:
            raise OSError(
                e.errno,
                f"Process 0 must start the coordinator on {bind_address}, but {bind_host!r} "
                f"does not resolve ({e}). Expected an address of this machine (check "
                f"{ENV_JAX_BIND_ADDRESS}), or unset it to listen on every interface.",
            ) from None
        family, host = info[0], str(info[4][0])
        sock = socket.socket(family, socket.SOCK_STREAM)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise OSError(
                    e.errno,
                    f"Process 0 must start the coordinator on {bind_address}, but cannot "
                    f"listen there ({e.strerror}). Expected an address of this machine (check "
                    f"{ENV_JAX_BIND_ADDRESS}), or unset it to listen on every interface.",
                ) from None
            raise OSError(
                e.errno,
                f"Process 0 must start the coordinator on port {port} ({address}), but the port "
                f"is already in use ({e.strerror}). Pick a free port (`distrain launch` does), "
                "or stop the program holding it.",
            ) from None
