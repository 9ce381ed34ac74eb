"""Shared test setup: offline, seeded, and the device markers' skip reasons."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


if os.environ.get("PYTEST_XDIST_WORKER"):  # one of the workers `-n 2` starts: one torch thread each
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    # Hermetic: a profile.json or reference in the user's cache (~/.cache/mpsimpact) changes no result.
    os.environ["MPSIMPACT_CACHE"] = str(tmp_path_factory.mktemp("mpsimpact-cache"))


def pytest_collection_modifyitems(config, items):
    has_mps = torch.backends.mps.is_available()
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "mps" in item.keywords and not has_mps:
            item.add_marker(pytest.mark.skip(reason="needs a real Apple GPU (MPS is not available)"))
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA is not available)"))
