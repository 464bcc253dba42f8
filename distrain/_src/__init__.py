"""The implementation of distrain. Nothing here is public API.

Users import ``distrain`` and its public modules (``dt.callbacks``, ``dt.checkpoint``,
``dt.config``, ``dt.data``, ``dt.experimental``, ``dt.metrics``,
``dt.mixed_precision``), which re-export names from here; paths under ``_src`` may
change in any release (docs/architecture.md).
"""
