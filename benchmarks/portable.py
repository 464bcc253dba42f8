"""Commands in result files that anyone can rerun: no machine paths.

A result file records the command behind its figures; a path like
``/work/main/.venv/bin/python`` or ``/tmp/islands_faults-ynn5x7is/solo`` means nothing on
another machine. :func:`command` writes the interpreter as ``python``, paths inside the
repository relative to it, the shared data beside it as ``../shared/...``, and
temporary directories as ``$TMPDIR``.

Example:
  >>> command([sys.executable, "-m", "benchmarks.goodput", "--out", "/tmp/x/g.json"])
  'python -m benchmarks.goodput --out $TMPDIR/x/g.json'
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def path(text: str) -> str:
    """``text`` with the machine's paths made portable (see the module's docstring)."""
    for python in {sys.executable, os.path.realpath(sys.executable)}:
        text = text.replace(python, "python")
    text = re.sub(r"\S*/\.venv[\w-]*/bin/python[\d.]*", "python", text)
    text = text.replace(os.path.join(os.path.dirname(ROOT), "shared") + "/", "../shared/")
    text = text.replace(ROOT + "/", "")
    for tmp in {tempfile.gettempdir(), "/tmp"}:
        text = re.sub(re.escape(tmp) + r"(?=/)", "$TMPDIR", text)
    return text


def command(argv: Sequence[str]) -> str:
    """One command line, portable."""
    return path(" ".join(argv))
