import os
from pathlib import Path

import pytest
import torch

# Tests never download: any hub lookup fails fast instead.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def _threads():
    # the CI machine's 2 cores; OMP_NUM_THREADS lowers it (e.g. beside a long benchmark)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


@pytest.fixture
def cache_tmp(tmp_path, monkeypatch):
    """An empty $CIDERS_CACHE for tests that exercise conversion / cache logic."""
    d = tmp_path / "cache"
    monkeypatch.setenv("CIDERS_CACHE", str(d))
    return d
