"""Checkpoints that resume exactly, and preemption handling (public as ``dt.checkpoint``)."""
