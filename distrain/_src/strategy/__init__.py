"""Strategies (implementation package; import them from ``distrain``)."""
