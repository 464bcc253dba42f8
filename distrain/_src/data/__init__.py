"""Input: ``ArrayPipeline``, distributed datasets and iterators, bundled datasets.

Users import these names from ``dt.data`` (``distrain/data.py``).
"""
