"""Prompt learning (Hugging Face PEFT's name): prompt tuning (`prompt_tuning`; the soft prompt and its hook in
`embedding`) and prefix tuning (`prefix_tuning`; the prefix module and the cache hook in `prefix_cache`). What both
share on the adapter protocol, and their common file layout, is in `shared`."""

from .embedding import PromptEmbedding
from .prefix_cache import PrefixEncoder
from .prefix_tuning import (
    PrefixTuningAdapter,
    PrefixTuningConfig,
    fold_prefix_projection,
    inject_prefix_tuning,
    prefix_tuning_spec,
    unload_prefix_tuning,
)
from .prompt_tuning import PromptTuningAdapter, inject_prompt_tuning, prompt_embedding, unload_prompt_tuning

__all__ = ["PrefixEncoder", "PrefixTuningAdapter", "PrefixTuningConfig", "PromptEmbedding", "PromptTuningAdapter",
           "fold_prefix_projection", "inject_prefix_tuning", "inject_prompt_tuning", "prefix_tuning_spec",
           "prompt_embedding", "unload_prefix_tuning", "unload_prompt_tuning"]
