"""Prompt learning (Hugging Face PEFT's name): prompt tuning (`prompt_tuning`; the soft prompt and its hook in
`embedding`), P-tuning (`p_tuning`; a soft prompt produced by an encoder, on the same hook) and prefix tuning
(`prefix_tuning`; the prefix module and the cache hook in `prefix_cache`). What they share on the adapter protocol,
and their common file layout, is in `shared`."""

from .embedding import PromptEmbedding
from .p_tuning import (
    PTuningAdapter,
    PTuningConfig,
    PTuningEncoder,
    fold_prompt_encoder,
    inject_p_tuning,
    unload_p_tuning,
)
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

__all__ = [
    "PTuningAdapter",
    "PTuningConfig",
    "PTuningEncoder",
    "PrefixEncoder",
    "PrefixTuningAdapter",
    "PrefixTuningConfig",
    "PromptEmbedding",
    "PromptTuningAdapter",
    "fold_prefix_projection",
    "fold_prompt_encoder",
    "inject_p_tuning",
    "inject_prefix_tuning",
    "inject_prompt_tuning",
    "prefix_tuning_spec",
    "prompt_embedding",
    "unload_p_tuning",
    "unload_prefix_tuning",
    "unload_prompt_tuning",
]
