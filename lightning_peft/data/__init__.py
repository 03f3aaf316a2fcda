"""Data for the examples: the BBC News corpus as a deterministic, stratified LightningDataModule."""

from __future__ import annotations

from lightning_peft.data.bbc_news import (
    BBCNewsDataModule,
    EpochShuffleSampler,
    load_bbc_news,
    stratified_split,
)

__all__ = ["BBCNewsDataModule", "EpochShuffleSampler", "load_bbc_news", "stratified_split"]
