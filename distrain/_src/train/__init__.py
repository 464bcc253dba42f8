"""Training: state, Trainer, callbacks, metrics (public through ``distrain``)."""
