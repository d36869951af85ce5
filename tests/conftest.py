from pathlib import Path

import pytest

from pipeline.dev.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The offline test model, built once per session (a few seconds)."""
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def drawn(png: bytes) -> tuple[int, int, float]:
    """(width, height, share of pixels that are not background) of a PNG: a plot that drew
    nothing is all background, whatever its header says."""
    import io

    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(io.BytesIO(png))[..., :3]
    background = np.all(pixels > 0.97, axis=-1)
    return pixels.shape[1], pixels.shape[0], float(1 - background.mean())
