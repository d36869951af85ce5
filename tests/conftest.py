from pathlib import Path

import pytest

from pipeline.dev.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The offline test model, built once per session (a few seconds)."""
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)
