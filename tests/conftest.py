"""Shared fixtures: tiny models built from configs (no weights are ever downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def tiny_bert_config():
    """A 2-layer BERT config small enough to build in milliseconds."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )


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
