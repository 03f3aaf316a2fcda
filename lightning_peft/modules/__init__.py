"""Reusable LightningModules: one wraps a Hugging Face sequence classifier, two are built from `lightning_peft.nn`."""

from __future__ import annotations

from lightning_peft.modules.blocks import CausalLM, EncoderClassifier
from lightning_peft.modules.hf import ClassifierSteps, HFSequenceClassifier, resolve_pretrained

__all__ = ["CausalLM", "ClassifierSteps", "EncoderClassifier", "HFSequenceClassifier", "resolve_pretrained"]
