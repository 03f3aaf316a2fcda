"""The decoder families `TransformerDecoder.from_pretrained` loads, one row of `FAMILIES` per ``model_type``.

Papers: Touvron et al. 2023, "Llama 2" (arXiv:2307.09288); Grattafiori et al. 2024, "The Llama 3 Herd of Models"
(arXiv:2407.21783); Bai et al. 2023, "Qwen Technical Report" (arXiv:2309.16609) and Qwen Team 2024, "Qwen2.5
Technical Report" (arXiv:2412.15115); Jiang et al. 2023, "Mistral 7B" (arXiv:2310.06825); Gemma Team 2024, "Gemma"
(arXiv:2403.08295).

Rule. A checkpoint's ``config.json`` becomes `TransformerDecoder` arguments in two steps: the options every family
shares (sizes, heads, rotary base and scaling, norm epsilon, tied head), then the family's own (its row's
``options``):

    model_type  q/k/v bias        o bias          sliding window                  norm        embeddings     MLP
    llama       attention_bias    attention_bias  -                               w * x       x              SwiGLU
    qwen2       always            never           layer_types "sliding_attention" w * x       x              SwiGLU
    mistral     never             never           sliding_window, every layer     w * x       x              SwiGLU
    gemma       attention_bias    attention_bias  -                               (1 + w) x   sqrt(H) x      GeGLU-tanh

The caller's overrides go on top (``moe`` and ``reversible`` refused: another architecture). All four store their
weights under Llama's names (`lightning_peft.nn.hf_weights.LLAMA_KEYS`); a tied head is not read. What a family's
config asks for and the decoder does not implement is refused by name: an unknown ``model_type`` (Gemma 2/3's
soft-capping and alternating windows among them), a rotary type outside `lightning_peft.nn.rotary.ROPE_SCALINGS`,
partial rotary, an activation, bidirectional attention.

Shapes: as the checkpoint's; Linear weights ``(out, in)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from lightning_peft._pretrained import read_config, read_state_dict
from lightning_peft.nn.hf_weights import LLAMA_KEYS, load_fitting, refuse_new_architecture, rename_keys
from lightning_peft.nn.rotary import ROPE_SCALINGS, rope_type

__all__ = ["FAMILIES", "Family", "decoder_options", "load_decoder_weights"]

_WHO = "TransformerDecoder.from_pretrained"


@dataclass(frozen=True)
class Family:
    """How one ``model_type`` maps onto `TransformerDecoder`.

    Attributes:
        activations: The config's ``hidden_act`` values accepted, mapped to `FeedForward`'s names.
        options: ``(config, who) -> constructor arguments`` this family adds to the shared ones.
        keys: Hugging Face key -> ours (`lightning_peft.nn.hf_weights.rename_keys` rules).
        defaults: Config values the family's transformers config assumes when ``config.json`` leaves them out.
    """

    activations: dict[str, str]
    options: Callable[[dict[str, Any], str], dict[str, Any]]
    keys: list[tuple[str, str | None]] = field(default_factory=lambda: LLAMA_KEYS)
    defaults: dict[str, Any] = field(default_factory=dict)


def _llama(config: dict[str, Any], who: str) -> dict[str, Any]:
    return {"bias": config.get("attention_bias", False), "mlp_bias": config.get("mlp_bias", False)}


def _qwen2(config: dict[str, Any], who: str) -> dict[str, Any]:
    # Qwen2Attention: q/k/v with bias, o_proj without; transformers' Qwen2Config turns use_sliding_window and
    # max_window_layers into layer_types (and sets sliding_window to None when the window is off).
    layer_types = config.get("layer_types") or []
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"{who}: layer_types {unknown} are not implemented (full_attention, sliding_attention).")
    windowed = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    window = config.get("sliding_window") if windowed else None
    if windowed and window is None:
        raise ValueError(f"{who}: layer_types name sliding_attention layers {windowed} but sliding_window is None; "
                         "set sliding_window in config.json.")
    return {"bias": False, "qkv_bias": True, "sliding_window": window,
            "sliding_window_layers": windowed if window is not None else None}


def _mistral(config: dict[str, Any], who: str) -> dict[str, Any]:
    # MistralAttention: no biases; one window on every layer (a layer_types list is ignored by MistralModel too).
    return {"bias": False, "sliding_window": config.get("sliding_window")}


def _gemma(config: dict[str, Any], who: str) -> dict[str, Any]:
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{who}: use_bidirectional_attention=True (Gemma as an encoder) is not implemented; this "
                         "decoder is causal.")
    return {"bias": config.get("attention_bias", False), "norm_offset": 1.0,
            "embedding_scale": math.sqrt(config["hidden_size"])}


# GemmaConfig reads the legacy "gelu" of the official releases as the tanh approximation, as here.
FAMILIES: dict[str, Family] = {
    "llama": Family({"silu": "silu"}, _llama),
    "qwen2": Family({"silu": "silu"}, _qwen2),
    "mistral": Family({"silu": "silu"}, _mistral, defaults={"sliding_window": 4096}),
    "gemma": Family({"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}, _gemma,
                    defaults={"hidden_act": "gelu_pytorch_tanh", "head_dim": 256, "tie_word_embeddings": True}),
}
_NOT_IMPLEMENTED = {
    "gemma2": "attention-logit and final-logit soft-capping, alternating sliding-window layers, pre- and "
              "post-feed-forward norms",
    "gemma3": "alternating local/global layers with two rotary bases, q/k norms, soft-capping",
    "gemma3_text": "alternating local/global layers with two rotary bases, q/k norms, soft-capping",
    "qwen3": "q/k RMSNorm inside attention",
    "qwen2_moe": "mixture-of-experts feed-forwards with a shared expert",
    "mixtral": "mixture-of-experts feed-forwards",
}


def _rope(config: dict[str, Any], who: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)``: transformers 5 keeps both in ``rope_parameters``, older configs in
    ``rope_theta`` and ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    kind = rope_type(params)
    if kind not in ROPE_SCALINGS:
        raise ValueError(
            f"{who}: rope type {kind!r} (rope_parameters / rope_scaling) is not implemented; implemented: "
            f"{', '.join(map(repr, ROPE_SCALINGS))}."
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{who}: partial_rotary_factor={partial} (rotary on part of each head) is not implemented.")
    if kind == "llama3":  # as transformers' standardize_rope_params
        params.setdefault("original_max_position_embeddings",
                          config.get("original_max_position_embeddings", config.get("max_position_embeddings")))
    return theta, (None if kind == "default" else params)


def decoder_options(path: str, overrides: dict[str, Any]) -> tuple[Path, Family, dict[str, Any]]:
    """``(directory, family, constructor arguments)`` of `TransformerDecoder` for a checkpoint of one of `FAMILIES`.

    Raises:
        ValueError: If the directory or its config is missing, the model type is not one of `FAMILIES`, the config
            asks for something the decoder does not implement (named), or ``overrides`` asks for
            ``moe``/``reversible``.
    """
    who = f"{_WHO}({str(path)!r})"
    refuse_new_architecture(who, overrides)
    directory, config = read_config(path, _WHO)
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        missing = _NOT_IMPLEMENTED.get(model_type)
        raise ValueError(
            f"{who}: model_type {model_type!r} is not supported"
            + (f" ({missing} are not implemented)" if missing else "")
            + f"; this decoder loads {', '.join(map(repr, FAMILIES))}. Use HFCausalLM for other architectures."
        )
    config = {**family.defaults, **config}
    act = config.get("hidden_act", "silu")
    if act not in family.activations:
        raise ValueError(f"{who}: hidden_act {act!r} is not supported for model_type {model_type!r} (accepted: "
                         f"{', '.join(map(repr, family.activations))}).")
    rope_theta, rope_scaling = _rope(config, who)
    kwargs: dict[str, Any] = {
        "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
        "num_layers": config["num_hidden_layers"], "num_heads": config["num_attention_heads"],
        "num_kv_heads": config.get("num_key_value_heads"), "ffn_size": config["intermediate_size"],
        "max_position_embeddings": config.get("max_position_embeddings", 2048), "rope_theta": rope_theta,
        "rope_scaling": rope_scaling, "norm_eps": config.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "attention_dropout": config.get("attention_dropout", 0.0), "head_dim": config.get("head_dim"),
        "activation": family.activations[act], **family.options(config, who),
    }
    return directory, family, {**kwargs, **overrides}


def load_decoder_weights(model: nn.Module, directory: Path, path: str, family: Family) -> None:
    """The checkpoint's weights in ``directory`` into ``model`` (a `TransformerDecoder`; a tied head is not read
    from the checkpoint)."""
    state = rename_keys(read_state_dict(directory, _WHO), family.keys)
    tied = model.config["tie_word_embeddings"]
    if tied:
        state.pop("lm_head.weight", None)
    load_fitting(model, state, str(path), optional=("lm_head.",) if tied else ())
