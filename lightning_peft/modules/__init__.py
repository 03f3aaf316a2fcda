"""Reusable LightningModules: two wrap Hugging Face models (a sequence classifier, a causal LM), two are built from
`lightning_peft.nn`."""

from __future__ import annotations

from lightning_peft.modules.blocks import CausalLM, EncoderClassifier
from lightning_peft.modules.hf import ClassifierSteps, HFSequenceClassifier, resolve_pretrained
from lightning_peft.modules.hf_causal_lm import HFCausalLM

__all__ = ["CausalLM", "ClassifierSteps", "EncoderClassifier", "HFCausalLM", "HFSequenceClassifier",
           "resolve_pretrained"]
