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


def pytest_collection_modifyitems(config, items):
    """Tests marked `full_data` need the full datasets ($CIDERS_DATA): skipped, with the reason, where CIDERS_DATA
    is unset (a fresh clone: every other test runs on the vendored slices under data/). .ci/run runs `make test`
    without CIDERS_DATA, then `pytest -m full_data` with it."""
    if os.environ.get("CIDERS_DATA"):
        return
    from helpers import FULL_DATA_REASON

    skip = pytest.mark.skip(reason=FULL_DATA_REASON)
    for item in items:
        if item.get_closest_marker("full_data"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _full_data_marker(request):
    """Tells helpers.shared() whether the running test is marked `full_data` (it refuses otherwise)."""
    import helpers

    helpers.RUNNING_FULL_DATA_TEST = request.node.get_closest_marker("full_data") is not None
    yield
    helpers.RUNNING_FULL_DATA_TEST = False


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
