import os
import tempfile

import pytest
import torch

# Two CPU cores on CI: keep each test process to one intra-op thread so distributed tests
# (two ranks) do not oversubscribe.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# What a developer measured on this machine (the sparse product's crossover) stays out of the tests:
# they, and the processes they start, see an empty cache and the shipped defaults.
os.environ["KANSCALE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kanscale-test-cache-")


@pytest.fixture
def in_tmp_cwd(tmp_path, monkeypatch):
    """Run a test inside an empty working directory (to catch stray files)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
