"""Goodput (``dt.goodput``): where a run's wall time went, across restarts.

A run with ``dt.callbacks.Goodput(workdir)`` (``distrain train`` adds it when
``logging.dir`` is set) appends its time, bucket by bucket, to
``workdir/goodput.jsonl``; :func:`report` reads every attempt back and accounts for
each second: productive steps, start-up, compilation, input, checkpoints,
evaluation, work lost to failures and downtime between attempts. A custom loop keeps
a :class:`Ledger` itself. From a shell: ``distrain goodput WORKDIR [--json F] [--png F]``.

Example:
  >>> r = dt.goodput.report("runs/exp")
  >>> print(r.table())
  >>> r.plot("runs/exp/goodput.png")
"""

from distrain._src.goodput.ledger import Ledger as Ledger
from distrain._src.goodput.report import Report as Report
from distrain._src.goodput.report import report as report

__all__ = ["Ledger", "Report", "report"]
