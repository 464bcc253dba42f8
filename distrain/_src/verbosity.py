"""Quiet by default: the INFO logs of the libraries under distrain stay off unless asked.

A run prints distrain's own lines (progress, results, warnings). The libraries it
drives also log, at INFO, things a user does not act on:

* **orbax** logs every checkpoint save and restore (the handlers it creates, the
  metadata dict it writes, bytes per second) through absl's logger. Python drops INFO
  records by default, so they show wherever the root logger is set to INFO: a Ray
  worker's log, a script that called ``logging.basicConfig(level=logging.INFO)``.
* **MLflow** installs its own INFO handler and, on a new SQL store, says so
  ("Creating initial MLflow database tables...", "Updating database tables").
* **Ray**'s ``ray.init`` says where it connects ("Connecting to existing Ray cluster at
  address: ...", "Connected to Ray cluster."), in every island and parameter-server
  driver, at each attempt.

Filters on those loggers drop their records below WARNING; warnings and errors always
pass. ``DISTRAIN_VERBOSE=1`` (what ``distrain train --verbose`` sets, for its own
process and every process it starts) lets everything through; the filters read it on
every record, so it can be set at any time.

Not silenced: gloo, the CPU collectives of multi-process JAX, prints
``[Gloo] Rank i is connected to n peer ranks. Expected number of connected peer ranks
is : n`` from C++ to stdout when a process joins each communicator
(``gloo/transport/tcp/context.cc``, ``Context::printConnectivityInfo``), with
``std::cout`` and no level, variable or flag that turns it off.
"""

from __future__ import annotations

import logging
import os

ENV = "DISTRAIN_VERBOSE"
_OFF = ("", "0", "false", "no", "off")


def verbose() -> bool:
    """Whether third-party INFO logs are wanted: ``DISTRAIN_VERBOSE`` set and not
    ``0``/``false``/``no``/``off``."""
    return os.environ.get(ENV, "").strip().lower() not in _OFF


class _BelowWarning(logging.Filter):
    """Drops a logger's records below WARNING (only those from files under one of
    ``paths``, when given) unless :func:`verbose`."""

    def __init__(self, paths: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or verbose():
            return True
        return bool(self.paths) and not record.pathname.startswith(self.paths)


def _install(logger: logging.Logger, paths: tuple[str, ...] = ()) -> None:
    if not any(isinstance(f, _BelowWarning) for f in logger.filters):
        logger.addFilter(_BelowWarning(paths))


def enable() -> None:
    """What ``distrain train --verbose`` does: sets ``DISTRAIN_VERBOSE=1`` (for this
    process and those it starts) and, unless the program configured logging itself,
    prints INFO records on stderr (Python's default shows only warnings)."""
    os.environ[ENV] = "1"
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def quiet_orbax() -> None:
    """Orbax's INFO records off (see the module). Idempotent."""
    import orbax.checkpoint  # imports absl's logging, whose logger must be absl's own class

    # absl's logger carries every absl user's records: only orbax's files are filtered.
    package = os.path.dirname(os.path.dirname(os.path.abspath(orbax.checkpoint.__file__)))
    paths = {package + os.sep, os.path.realpath(package) + os.sep}
    _install(logging.getLogger("absl"), tuple(sorted(paths)))


def quiet_mlflow() -> None:
    """MLflow's INFO lines about creating and migrating a SQL store off. Idempotent."""
    _install(logging.getLogger("mlflow.store.db.utils"))


def quiet_ray() -> None:
    """Ray's INFO lines on connecting (``ray.init``'s, from ``ray._private.worker``) off.
    Idempotent; ``ray.init`` sets the level of the ``ray`` logger, not this filter."""
    _install(logging.getLogger("ray._private.worker"))
