"""Shared fixtures: tiny models built from configs (no weights are ever downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs 2 workers on the 2 cores: one thread each
    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``-n 2 --dist loadgroup`` (``make test``), a file's tests run on one worker (its module fixtures are
    built once), and every file that reads the session's 2-rank launch runs on the same worker, so the launch
    happens once: each worker has its own session."""
    shared = {item.path for item in items if "two_ranks" in item.fixturenames}
    for item in items:
        item.add_marker(pytest.mark.xdist_group("two_ranks" if item.path in shared else str(item.path)))


@pytest.fixture
def tiny_bert_config():
    """A 2-layer BERT config small enough to build in milliseconds (``tests._models.bert_config``)."""
    from tests._models import bert_config

    return bert_config()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _environment():
    """Undo what a test leaves in os.environ: LightningCLI's seed_everything sets PL_GLOBAL_SEED, which the DDP
    tests' subprocesses would inherit (and reseed with, after the model is built)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def two_ranks(request, tmp_path_factory):
    """One 2-rank launch (gloo) for the session's multi-process modules (``tests/_two_ranks.py``):
    ``two_ranks.path(job)`` is where that job's results are."""
    from tests import _two_ranks

    jobs = _two_ranks.jobs_for({item.path for item in request.session.items})
    return _two_ranks.launch(tmp_path_factory.mktemp("two_ranks"), jobs)
