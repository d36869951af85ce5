"""Helpers the tests share (no test module imports another): the repository's root, and
modules for fake engines, runs, parts and outputs, the stages, the dashboard's queries."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def drawn(png: bytes) -> tuple[int, int, float]:
    """(width, height, share of pixels that are not background) of a PNG: a plot that drew
    nothing is all background, whatever its header says."""
    import io

    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(io.BytesIO(png))[..., :3]
    background = np.all(pixels > 0.97, axis=-1)
    return pixels.shape[1], pixels.shape[0], float(1 - background.mean())
