"""Model families and Hugging Face checkpoints in and out (``dt.models``)."""
