"""Padding a short batch to full size, and the mask column that marks its real rows.

Both producers of padded batches use it: ``ArrayPipeline`` (a final partial batch
with ``mask_key``) and the distributed iterator (``InputOptions(mask_key=...)``). The
consumers, ``dt.compute_average_loss(..., mask=...)`` and metrics, weight rows by the
mask, so padding changes no mean; gradient accumulation reads the same column
(``Trainer(mask_key=...)``), whose default name is :data:`MASK_KEY`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MASK_KEY = "mask"


def pad_rows(
    arrays: Sequence[Any], rows: int, full: int, mask: Any = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """``arrays`` (``rows`` long each) padded with zero rows to ``full``, and the mask.

    Args:
      arrays: the batch's leaves.
      rows: their (real) rows.
      full: rows after padding (>= ``rows``).
      mask: the batch's own mask for its real rows, if it has one (default all ones).

    Returns:
      The padded leaves and the float32 mask of ``full`` rows (0.0 on padding).

    Example:
      >>> leaves, mask = pad_rows([np.ones((3, 2))], 3, 4)
      >>> mask
      array([1., 1., 1., 0.], dtype=float32)
    """
    pad = full - rows
    out = []
    for a in arrays:
        a = np.asarray(a)
        out.append(np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a)
    real = np.ones(rows, np.float32) if mask is None else np.asarray(mask, np.float32)
    return out, np.concatenate([real, np.zeros(pad, np.float32)])
