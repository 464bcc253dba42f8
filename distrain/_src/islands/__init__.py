"""Islands: groups of replicas that train independently and meet every H steps.

``outer.py`` holds the framework-free outer step of DiLoCo and Streaming DiLoCo (the
pseudo-gradient, the outer optimizer step, the merge, the fragment schedule and a
reference driver), ``schedule.py`` the validated configuration and when each fragment
syncs, ``codecs.py`` the quantized outer gradients, and ``diloco_strategy.py``
``dt.experimental.DiLoCoStrategy``, which places the islands on an outer mesh axis and
runs the user's step as the inner step (``docs/islands.md``).
"""
