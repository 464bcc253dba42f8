"""Asynchronous parameter-server training (``dt.experimental.ParameterServerStrategy``).

Modules, one concept each: ``ps_strategy`` (the strategy and its variables),
``cluster_coordinator`` (scheduling, failures, checkpoints), ``step`` (the compiled
worker step), ``worker`` (host callbacks and the worker loop), ``server`` (one
parameter server), ``servers`` (all of them as one client), ``variable_layout`` and
``partitioners`` (where variables live), ``per_worker_datasets`` (per-worker inputs),
``backend`` (the contracts a backend fulfils: ``ServerBackend``, ``Worker``),
``inprocess`` / ``ray_backend`` (the two backends), ``server_checkpoints``.
"""
