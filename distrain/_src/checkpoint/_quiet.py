"""Silences the echoes of a failed orbax read, so a damaged checkpoint is one warning.

When orbax fails to read one array of a damaged step, it closes its event loop while
tensorstore still completes the other reads; each completion then calls
``loop.call_soon_threadsafe`` on the closed loop, and Python prints a
``RuntimeError: Event loop is closed`` traceback per read (through
``sys.unraisablehook``), sometimes followed by asyncio's "Task exception was never
retrieved" with a tensorstore spec dump. Those reads belong to a step that is already
being reported and set aside, so they are dropped here; every other unraisable
exception and asyncio message is passed on unchanged.

It also drops orbax's ERROR log with a traceback when Ctrl-C lands while it waits for a
save to finish: orbax logs the ``KeyboardInterrupt`` and re-raises it, and the one who
catches it (``distrain train``: one line saying what was saved) reports it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from distrain._src.checkpoint._errors import TENSORSTORE_DAMAGE_CODES

_installed = False
# asyncio's words for a future or task whose exception nobody awaited.
_UNRETRIEVED = ("Future exception was never retrieved", "Task exception was never retrieved")


def _is_closed_loop_echo(unraisable: Any) -> bool:
    """A ``RuntimeError('Event loop is closed')`` raised by asyncio's closed-loop check."""
    exc = unraisable.exc_value
    if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
        return False
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.basename(tb.tb_frame.f_code.co_filename) == "base_events.py"


class _UnretrievedReadFilter(logging.Filter):
    """Drops asyncio's "Future/Task exception was never retrieved" for a tensorstore error."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(_UNRETRIEVED):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = str(exc) if exc is not None else message
        return not any(code in text for code in TENSORSTORE_DAMAGE_CODES)  # a damaged step's reads


class _InterruptedWaitFilter(logging.Filter):
    """Drops orbax's log record of a ``KeyboardInterrupt`` (orbax re-raises it); another
    module's record of one, or orbax's of any other exception, is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        from_orbax = f"{os.sep}orbax{os.sep}" in record.pathname
        return not (from_orbax and isinstance(exc, KeyboardInterrupt))


def install() -> None:
    """Installs the filters once per process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _is_closed_loop_echo(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_UnretrievedReadFilter())
    logging.getLogger("absl").addFilter(_InterruptedWaitFilter())  # orbax logs through absl
