"""How a ``distrain`` command reports a failure: one line, and an exit status.

Example:
  >>> sys.exit(run_reporting_errors("plan", lambda: child_main(argv)))
"""

from __future__ import annotations

import os
import sys
from typing import Any


def error(message: str, command: str = "train") -> None:
    """Prints ``distrain COMMAND: error: MESSAGE`` on one line, whatever the message
    looks like: logs and launchers that prefix each line with the process stay readable."""
    print(f"distrain {command}: error: {' '.join(message.split())}", file=sys.stderr)


# Errors raised by checks of what the user passed (values, types, files, the network):
# exit 2 like argparse's usage errors. Anything else is unexpected: exit 1.
_USER_ERRORS = (ValueError, TypeError, OSError, ImportError)


def run_reporting_errors(command: str, fn: Any, debug: bool | None = None) -> int:
    """``fn()``'s exit status, or a one-line ``distrain COMMAND: error: ...`` and 2 (a
    user's error) or 1 (anything else); the traceback with ``--debug``/DISTRAIN_DEBUG."""
    from distrain._src.train.config_errors import ConfigError

    if debug is None:
        debug = os.environ.get("DISTRAIN_DEBUG", "").strip() not in ("", "0")
    try:
        return int(fn() or 0)
    except KeyboardInterrupt as e:
        if debug:
            raise
        # Ctrl-C is the user's choice, not an error to trace: say what is kept.
        print(f"distrain {command}: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        hint = " (run with --debug or DISTRAIN_DEBUG=1 for the traceback)"
        if isinstance(e, ConfigError):
            error(str(e), command)
            return 2
        error(f"{type(e).__name__}: {e}{hint}", command)
        return 2 if isinstance(e, _USER_ERRORS) else 1
