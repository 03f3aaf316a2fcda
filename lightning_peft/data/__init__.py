"""Data for the examples: the BBC News corpus as deterministic, stratified LightningDataModules (classification and language modelling), and instruction data for SFT."""

from __future__ import annotations

from lightning_peft.data.bbc_news import (
    BBCNewsDataModule,
    EpochShuffleSampler,
    load_bbc_news,
    stratified_split,
)
from lightning_peft.data.bbc_news_lm import BBCNewsLMDataModule, pack_blocks
from lightning_peft.data.sft import SFTDataModule

__all__ = ["BBCNewsDataModule", "BBCNewsLMDataModule", "EpochShuffleSampler", "SFTDataModule", "load_bbc_news",
           "pack_blocks", "stratified_split"]
