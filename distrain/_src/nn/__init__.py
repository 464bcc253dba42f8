"""Framework ops a model calls inside a replica; the public names are in ``distrain.nn``."""
