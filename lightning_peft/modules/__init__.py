"""Reusable LightningModules, including one that wraps a Hugging Face sequence-classification model."""

from __future__ import annotations

from lightning_peft.modules.hf import HFSequenceClassifier, resolve_pretrained

__all__ = ["HFSequenceClassifier", "resolve_pretrained"]
