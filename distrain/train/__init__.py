"""Training: state, Trainer, callbacks, metrics."""
