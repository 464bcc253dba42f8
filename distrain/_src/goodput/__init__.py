"""Goodput: where a run's wall time goes (the ledger) and what it adds up to (the report)."""
