"""The decoder families `TransformerDecoder.from_pretrained` loads, one row of `FAMILIES` per ``model_type``.

Papers: Touvron et al. 2023, "Llama 2" (arXiv:2307.09288); Grattafiori et al. 2024, "The Llama 3 Herd of Models"
(arXiv:2407.21783); Bai et al. 2023, "Qwen Technical Report" (arXiv:2309.16609) and Qwen Team 2024, "Qwen2.5
Technical Report" (arXiv:2412.15115); Qwen Team 2025, "Qwen3 Technical Report" (arXiv:2505.09388); Jiang et al.
2023, "Mistral 7B" (arXiv:2310.06825); Gemma Team 2024, "Gemma" (arXiv:2403.08295), "Gemma 2" (arXiv:2408.00118);
Gemma Team 2025, "Gemma 3 Technical Report" (arXiv:2503.19786).

Rule. A checkpoint's ``config.json`` becomes `TransformerDecoder` arguments in two steps: the options every family
shares (sizes, heads, rotary base and scaling, norm epsilon, tied head), then the family's own (its row's
``options``):

    model_type   q/k/v bias      o bias          sliding window                  norm       embeddings  MLP
    llama        attention_bias  attention_bias  -                               w * x      x           SwiGLU
    qwen2        always          never           layer_types "sliding_attention" w * x      x           SwiGLU
    qwen3        attention_bias  attention_bias  layer_types "sliding_attention" w * x      x           SwiGLU
    mistral      never           never           sliding_window, every layer     w * x      x           SwiGLU
    gemma        attention_bias  attention_bias  -                               (1 + w) x  sqrt(H) x   GeGLU-tanh
    gemma2       attention_bias  attention_bias  layer_types (default: even i)   (1 + w) x  sqrt(H) x   GeGLU-tanh
    gemma3_text  attention_bias  attention_bias  layer_types (default: (i+1)%6)  (1 + w) x  sqrt(H) x   GeGLU-tanh

and inside attention: qwen3 and gemma3_text normalise each head's q and k (``qk_norm``; Gemma's ``1 + w``);
gemma2 and gemma3_text scale the scores by ``query_pre_attn_scalar ** -0.5`` and normalise each branch's output too
(``sandwich_norm``: four norms a block, under their own names, `GEMMA2_KEYS`); gemma2 soft-caps the attention scores
and the logits (``attn_logit_softcapping``, ``final_logit_softcapping``); gemma3_text gives its sliding-window layers
their own rotary base (``rope_parameters["sliding_attention"]``, formerly ``rope_local_base_freq``).

The caller's overrides go on top (``moe`` and ``reversible`` refused: another architecture). All store their weights
under Llama's names (`lightning_peft.nn.hf_weights.LLAMA_KEYS`, with Qwen3's and Gemma 3's ``q_norm``/``k_norm``),
Gemma 2 and 3 their block norms under `GEMMA2_KEYS`; a tied head is not read. What a family's config asks for and the
decoder does not implement is refused by name: an unknown ``model_type`` (mixtures of experts, multimodal Gemma 3), a
rotary type outside `lightning_peft.nn.rotary.ROPE_SCALINGS`, partial rotary, an activation, bidirectional attention,
a scaled rotary on Gemma 3's sliding-window layers, attention soft-capping on Gemma 3 (which transformers ignores).

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
from lightning_peft.nn.hf_weights import (
    GEMMA2_KEYS,
    LLAMA_KEYS,
    load_fitting,
    refuse_new_architecture,
    rename_keys,
)
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
        activation_key: The config key of the activation (Gemma 2 and 3: ``hidden_activation``).
    """

    activations: dict[str, str]
    options: Callable[[dict[str, Any], str], dict[str, Any]]
    keys: list[tuple[str, str | None]] = field(default_factory=lambda: LLAMA_KEYS)
    defaults: dict[str, Any] = field(default_factory=dict)
    activation_key: str = "hidden_act"


def _llama(config: dict[str, Any], who: str) -> dict[str, Any]:
    return {"bias": config.get("attention_bias", False), "mlp_bias": config.get("mlp_bias", False)}


def _windows(config: dict[str, Any], who: str, every: int | None = None) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_window_layers`` from ``layer_types``. Configs written before transformers 5
    have none; then, as their transformers config classes: Gemma's layer ``i`` slides where ``(i + 1) % every``
    (Gemma 2: every 2nd, Gemma 3: ``sliding_window_pattern``, default 6); Qwen's from ``max_window_layers`` on when
    ``use_sliding_window`` (``every`` None)."""
    layer_types = config.get("layer_types")
    if not layer_types:
        slides = ((lambda i: bool((i + 1) % every)) if every is not None else
                  (lambda i: bool(config.get("use_sliding_window")) and config.get("sliding_window") is not None
                   and i >= config.get("max_window_layers", 28)))
        layer_types = ["sliding_attention" if slides(i) else "full_attention"
                       for i in range(config["num_hidden_layers"])]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"{who}: layer_types {unknown} are not implemented (full_attention, sliding_attention).")
    windowed = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    window = config.get("sliding_window") if windowed else None
    if windowed and window is None:
        raise ValueError(f"{who}: layer_types name sliding_attention layers {windowed} but sliding_window is None; "
                         "set sliding_window in config.json.")
    return {"sliding_window": window, "sliding_window_layers": windowed if window is not None else None}


def _qwen2(config: dict[str, Any], who: str) -> dict[str, Any]:
    # Qwen2Attention: q/k/v with bias, o_proj without; transformers' Qwen2Config (and Qwen3Config) turns
    # use_sliding_window and max_window_layers into layer_types (and sets sliding_window to None when it is off).
    return {"bias": False, "qkv_bias": True, **_windows(config, who)}


def _qwen3(config: dict[str, Any], who: str) -> dict[str, Any]:
    # Qwen3Attention: attention_bias on all four projections, an RMSNorm over each head's q and k before rotary.
    return {"bias": config.get("attention_bias", False), "qk_norm": True, **_windows(config, who)}


def _mistral(config: dict[str, Any], who: str) -> dict[str, Any]:
    # MistralAttention: no biases; one window on every layer (a layer_types list is ignored by MistralModel too).
    return {"bias": False, "sliding_window": config.get("sliding_window")}


def _gemma(config: dict[str, Any], who: str) -> dict[str, Any]:
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{who}: use_bidirectional_attention=True (Gemma as an encoder) is not implemented; this "
                         "decoder is causal.")
    return {"bias": config.get("attention_bias", False), "norm_offset": 1.0,
            "embedding_scale": math.sqrt(config["hidden_size"])}


def _gemma_sandwich(config: dict[str, Any], who: str) -> dict[str, Any]:
    # Gemma 2 and 3: four norms a block, scores scaled by query_pre_attn_scalar ** -0.5, logits soft-capped if set.
    return {**_gemma(config, who), "sandwich_norm": True, "attention_scale": config["query_pre_attn_scalar"] ** -0.5,
            "final_logit_softcapping": config.get("final_logit_softcapping")}


def _gemma2(config: dict[str, Any], who: str) -> dict[str, Any]:
    # Gemma2Attention: soft-capped scores; a sliding window on the even layers unless layer_types says otherwise.
    return {**_gemma_sandwich(config, who), **_windows(config, who, every=2),
            "attn_logit_softcapping": config.get("attn_logit_softcapping")}


def _gemma3(config: dict[str, Any], who: str) -> dict[str, Any]:
    # Gemma3Attention never passes attn_logit_softcapping to its attention: a set one would mean another model.
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{who}: attn_logit_softcapping={config['attn_logit_softcapping']} on gemma3_text, which "
                         "transformers' Gemma 3 does not apply; set it to null in config.json.")
    sliding = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    if rope_type(sliding) != "default":
        raise ValueError(f"{who}: rope type {rope_type(sliding)!r} on the sliding_attention layers is not "
                         "implemented (Gemma 3's local layers use the unscaled 'default').")
    theta = sliding.get("rope_theta", config.get("rope_local_base_freq", 10000.0))
    return {**_gemma_sandwich(config, who), **_windows(config, who, every=config.get("sliding_window_pattern", 6)),
            "qk_norm": True, "sliding_rope_theta": theta}


# Gemma2Config's defaults, which the official configs of 2024 leave out in part (layer_types among them).
_GEMMA2_DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "head_dim": 256, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0}
# GemmaConfig reads the legacy "gelu" of the official releases as the tanh approximation, as here.
FAMILIES: dict[str, Family] = {
    "llama": Family({"silu": "silu"}, _llama),
    "qwen2": Family({"silu": "silu"}, _qwen2),
    "mistral": Family({"silu": "silu"}, _mistral, defaults={"sliding_window": 4096}),
    "gemma": Family({"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}, _gemma,
                    defaults={"hidden_act": "gelu_pytorch_tanh", "head_dim": 256, "tie_word_embeddings": True}),
    "qwen3": Family({"silu": "silu"}, _qwen3, defaults={"head_dim": 128}),
    "gemma2": Family({"gelu_pytorch_tanh": "gelu_tanh"}, _gemma2, GEMMA2_KEYS, _GEMMA2_DEFAULTS, "hidden_activation"),
    "gemma3_text": Family({"gelu_pytorch_tanh": "gelu_tanh"}, _gemma3, GEMMA2_KEYS, {
        **_GEMMA2_DEFAULTS, "rope_theta": 1_000_000.0, "attn_logit_softcapping": None,
        "final_logit_softcapping": None}, "hidden_activation"),
}
_NOT_IMPLEMENTED = {  # model_type: why it is refused
    "gemma3": "the vision tower and image inputs of multimodal Gemma 3 are not implemented; its language model alone "
              "loads as model_type 'gemma3_text'",
    "qwen2_moe": "mixture-of-experts feed-forwards with a shared expert are not implemented",
    "qwen3_moe": "mixture-of-experts feed-forwards are not implemented",
    "mixtral": "mixture-of-experts feed-forwards are not implemented",
}


def _rope(config: dict[str, Any], who: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)``: transformers 5 keeps both in ``rope_parameters``, older configs in
    ``rope_theta`` and ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if isinstance(params.get("full_attention"), dict):  # one set per layer type (Gemma 3): the global layers'
        params = dict(params["full_attention"])
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
            + (f" ({missing})" if missing else "")
            + f"; this decoder loads {', '.join(map(repr, FAMILIES))}. Use HFCausalLM for other architectures."
        )
    config = {**family.defaults, **config}
    act = config.get(family.activation_key, "silu")
    if act not in family.activations:
        raise ValueError(f"{who}: {family.activation_key} {act!r} is not supported for model_type {model_type!r} "
                         f"(accepted: {', '.join(map(repr, family.activations))}).")
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
    from the checkpoint). The model keeps the checkpoint's tensors (`load_fitting`'s ``assign``: in the file's
    mapping, as transformers keeps them), so its head and layers read their weights as fast as transformers' do."""
    state = rename_keys(read_state_dict(directory, _WHO), family.keys)
    tied = model.config["tie_word_embeddings"]
    if tied:
        state.pop("lm_head.weight", None)
    load_fitting(model, state, str(path), optional=("lm_head.",) if tied else (), assign=True)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight  # assigning replaced the embedding's parameter
