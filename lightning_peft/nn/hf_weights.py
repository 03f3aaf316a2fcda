"""Reading Hugging Face checkpoints into `TransformerEncoder` (BERT layout) and `TransformerDecoder` (Llama layout;
its families' configs: `lightning_peft.nn.hf_families`).

Papers: Devlin et al. 2019, "BERT" (arXiv:1810.04805); Touvron et al. 2023, "Llama" (arXiv:2302.13971).

Rule. A checkpoint directory's ``config.json`` becomes constructor arguments (``bert_options``, ``decoder_options``;
the caller's overrides on top, except ``moe`` and ``reversible``, which would build another architecture), and its
weights (safetensors or ``torch.load(weights_only=True)``, read by `lightning_peft._pretrained`) are renamed key by
key with the first matching rule of `BERT_KEYS` / `LLAMA_KEYS`:

    Hugging Face key                                   ours
    bert.encoder.layer.<i>.attention.self.query.*     layers.<i>.attn.q_proj.*
    model.layers.<i>.self_attn.q_proj.*                layers.<i>.attn.q_proj.*
    model.layers.<i>.mlp.gate_proj.*                   layers.<i>.mlp.gate_proj.*   (and so on)

then copied in only if every key has a place in the model and every shape fits (the first that does not is named);
a key the rules drop (``position_ids``, rotary caches, task heads) is never loaded.

Shapes: every weight keeps the checkpoint's shape (Linear weights are ``(out, in)`` in both layouts).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from lightning_peft._pretrained import read_config, read_state_dict

__all__ = [
    "BERT_KEYS", "GEMMA2_KEYS", "LLAMA_KEYS", "bert_options", "load_bert_weights", "load_fitting",
    "refuse_new_architecture", "rename_keys",
]

# Hugging Face key -> ours (regex, replacement); keys matching nothing are reported, a None replacement drops them.
BERT_KEYS: list[tuple[str, str | None]] = [
    (r"^(?:bert\.)?embeddings\.position_ids$", None),
    (r"^(?:bert\.)?embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"^(?:bert\.)?embeddings\.(word|position|token_type)_embeddings\.", r"embeddings.\1_embeddings."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.attn.q_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.attn.k_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.attn.v_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn.o_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.mlp.up_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.mlp.down_proj."),
    (r"^(?:bert\.)?encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.mlp_norm."),
    (r"^(?:bert\.)?pooler\.dense\.", "pooler."),
    (r"^(?:cls|classifier|qa_outputs)\.", None),  # task heads of BertFor* checkpoints
]
# Llama's layout, which Qwen2, Qwen3 (with q_norm / k_norm), Mistral and Gemma share.
LLAMA_KEYS: list[tuple[str, str | None]] = [
    (r"^model\.embed_tokens\.", "embed_tokens."),
    (r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.", r"layers.\1.attn.\2_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.([qk])_norm\.", r"layers.\1.attn.\2_norm."),
    (r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.", r"layers.\1.mlp.\2_proj."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.mlp_norm."),
    (r"^model\.layers\.\d+\.self_attn\.rotary_emb\.", None),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "lm_head."),
]
# Gemma 2 and 3: four norms a block; post_attention_layernorm normalises the attention output (in Llama it is the
# feed-forward's input norm), pre_feedforward_layernorm is the feed-forward's input norm.
GEMMA2_KEYS: list[tuple[str, str | None]] = [
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.attn_post_norm."),
    (r"^model\.layers\.(\d+)\.pre_feedforward_layernorm\.", r"layers.\1.mlp_norm."),
    (r"^model\.layers\.(\d+)\.post_feedforward_layernorm\.", r"layers.\1.mlp_post_norm."),
    *LLAMA_KEYS,
]

_BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                     "silu": "silu"}


def refuse_new_architecture(who: str, overrides: dict[str, Any]) -> None:
    """``moe`` and ``reversible`` change the function the pretrained weights compute: refused on loading."""
    for name in ("moe", "reversible"):
        if overrides.get(name):
            raise ValueError(
                f"{who}: {name}={overrides[name]!r} builds another architecture than the checkpoint's (dense, "
                "plain residual blocks), so its weights would not compute what they were trained for. Build the "
                f"model with the constructor and {name}=... to train it from scratch."
            )


def rename_keys(state: dict[str, Tensor], rules: list[tuple[str, str | None]]) -> dict[str, Tensor]:
    """``state`` with each key renamed by the first rule whose pattern matches it (dropped if its replacement is
    None); a key no rule matches is kept as is, so `load_fitting` reports it.

    Examples:
        >>> import torch
        >>> state = {"model.norm.weight": torch.ones(2), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(1)}
        >>> list(rename_keys(state, LLAMA_KEYS))
        ['norm.weight']
    """
    renamed: dict[str, Tensor] = {}
    for key, value in state.items():
        for pattern, replacement in rules:
            if re.match(pattern, key):
                if replacement is not None:
                    renamed[re.sub(pattern, replacement, key)] = value
                break
        else:
            renamed[key] = value  # unknown: reported as unexpected by load_fitting
    return renamed


def load_fitting(model: nn.Module, state: dict[str, Tensor], path: str, optional: tuple[str, ...] = (),
                 assign: bool = False) -> None:
    """Copies ``state`` into ``model`` after checking that every key exists and fits, naming the first that does not.

    ``assign``: the model's tensors become the checkpoint's own (cast to the model's dtype where it differs) instead
    of copies. safetensors' tensors live in the file's private mapping, as transformers keeps its weights, which the
    kernel can map with 2 MB pages: decoding, which reads every weight per token, then misses the TLB less than on
    copies in 4 KB pages (the head's product at batch 8: 16.2 against 15.0 ms a step). The caller re-ties shared
    weights (assigning replaces the parameters)."""
    who = f"{type(model).__name__}.from_pretrained({path!r})"
    own = model.state_dict()
    for key, value in own.items():  # in the model's order, so "the first" is the shallowest
        if key in state and state[key].shape != value.shape:
            raise ValueError(
                f"{who}: the checkpoint's {key!r} has shape {tuple(state[key].shape)} but the model expects "
                f"{tuple(value.shape)}; an override changed the architecture, or config.json does not describe "
                "these weights."
            )
    for key, value in state.items():
        if key not in own:
            raise ValueError(f"{who}: the checkpoint's weight {key!r} has no place in this model (shape "
                             f"{tuple(value.shape)}); the checkpoint's architecture does not fit this module.")
    missing = [k for k in own if k not in state and not k.startswith(optional)]
    if missing:
        raise ValueError(f"{who}: the checkpoint lacks {missing[0]!r} ({len(missing)} weights missing in all).")
    if not assign:
        model.load_state_dict(state, strict=False)
        return
    seen: set[int] = set()
    owned = {}
    for key, value in state.items():  # the model's dtype; a tensor given twice is copied (no accidental tie)
        value = value.to(own[key].dtype)
        owned[key] = value.clone() if value.data_ptr() in seen else value
        seen.add(value.data_ptr())
    model.load_state_dict(owned, strict=False, assign=True)


def bert_options(path: str, overrides: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """``(directory, constructor arguments)`` of `TransformerEncoder` for a BERT-family checkpoint.

    Raises:
        ValueError: If the directory or its config is missing, the model type is not BERT, its positions or
            activation are ones the encoder does not implement, or ``overrides`` asks for ``moe``/``reversible``.
    """
    who = f"TransformerEncoder.from_pretrained({str(path)!r})"
    refuse_new_architecture(who, overrides)
    directory, config = read_config(path, "TransformerEncoder.from_pretrained")
    model_type = config.get("model_type")
    if model_type != "bert":
        raise ValueError(
            f"{who}: model_type {model_type!r} is not supported; this encoder loads BERT-layout checkpoints "
            "(model_type 'bert', such as MiniLM). Use HFSequenceClassifier for other architectures."
        )
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"{who}: position_embedding_type {config['position_embedding_type']!r} is not supported (only "
            "'absolute')."
        )
    activation = _BERT_ACTIVATIONS.get(config.get("hidden_act", "gelu"))
    if activation is None:
        raise ValueError(
            f"{who}: hidden_act {config['hidden_act']!r} is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu, "
            "silu)."
        )
    kwargs: dict[str, Any] = {
        "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
        "num_layers": config["num_hidden_layers"], "num_heads": config["num_attention_heads"],
        "ffn_size": config["intermediate_size"], "max_position_embeddings": config["max_position_embeddings"],
        "type_vocab_size": config.get("type_vocab_size", 2), "activation": activation,
        "dropout": config.get("hidden_dropout_prob", 0.1),
        "attention_dropout": config.get("attention_probs_dropout_prob", 0.1),
        "norm_eps": config.get("layer_norm_eps", 1e-12), "pad_token_id": config.get("pad_token_id") or 0,
    }
    return directory, {**kwargs, **overrides}


def load_bert_weights(model: nn.Module, directory: Path, path: str) -> None:
    """The BERT checkpoint's weights in ``directory`` into ``model`` (a `TransformerEncoder`; its pooler only if it
    has one)."""
    state = rename_keys(read_state_dict(directory, "TransformerEncoder.from_pretrained"), BERT_KEYS)
    if model.pooler is None:
        state = {k: v for k, v in state.items() if not k.startswith("pooler.")}
    load_fitting(model, state, str(path), optional=("pooler.",))
