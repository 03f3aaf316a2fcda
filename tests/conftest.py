"""Shared fixtures: tiny models built from configs (no weights are ever downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs 2 workers on the 2 cores: one thread each
    torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: pytest without xdist runs the suite too
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n 2`` (``make test``): every file of a job of the session's 2-rank launch runs on one worker, so the
    launch happens once (each worker has its own session); any other file runs whole on one worker, so its module
    fixtures are built once. (xdist's own ``loadgroup`` marks cannot do it: xdist 3.8 writes the group into
    ``Item._nodeid``, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    from tests._two_ranks import JOBS

    shared = {user for user, _ in JOBS.values()}

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "two_ranks" if path in shared else path

    return Scheduling(config, log)


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


@pytest.fixture
def small_disk(tmp_path):
    """A factory of tiny filesystems (tmpfs of ``size`` bytes) under ``tmp_path``, where a write really runs out of
    space; the test is skipped where mounting is not permitted."""
    import subprocess

    mounted = []

    def make(size: int, name: str = "disk"):
        folder = tmp_path / name
        folder.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "--lazy", str(folder)], check=False)
