"""Asynchronous parameter-server training (``dt.experimental.ParameterServerStrategy``).

Modules, one concept each: ``strategy`` (the strategy and its variables),
``cluster_coordinator`` (scheduling, failures, checkpoints), ``step`` (the compiled
worker step), ``worker`` (host callbacks and the worker loop), ``server`` (one
parameter server), ``servers`` (all of them as one client), ``layout`` and
``partitioners`` (where variables live), ``datasets`` (per-worker inputs),
``backend`` (the contracts a backend fulfils: ``ServerBackend``, ``Worker``),
``inprocess`` / ``ray_backend`` (the two backends), ``server_checkpoints``.
"""
