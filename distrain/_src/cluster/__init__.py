"""Multi-process set-up: cluster resolvers, collectives options, JAX runtime start, launcher.

Users import these names from ``distrain``.
"""
