"""P-tuning: a soft prompt produced by a small trained encoder (MLP or bidirectional LSTM), prepended to a frozen
model's input embeddings.

Paper: Liu, Zheng, Du, Ding, Qian, Yang, Tang, "GPT Understands, Too", arXiv:2103.10385. Hugging Face PEFT calls it
``P_TUNING`` (``PromptEncoderConfig``, ``PromptEncoder``).

The frozen model reads ``[P; E(x)]`` as with prompt tuning (`lightning_peft.peft.prompt.prompt_tuning`: the same
forward pre-hook, so the attention mask, token types, positions, labels and ``generate()`` are handled alike), but
``P`` is not a parameter: an embedding table ``H`` ``(n, d)`` goes through an encoder, and ``H`` and the encoder train:

```text
MLP:   P = W3 relu(W2 relu(W1 H + b1) + b2) + b3             W1 (h, d), W2 (h, h), W3 (d, h)
LSTM:  P = W2 relu(W1 BiLSTM(H) + b1) + b2                    BiLSTM: (n, d) -> (n, 2h), W1 (2h, 2h), W2 (d, 2h)
```

``h`` is ``encoder_hidden_size`` (default: ``d``). The names are PEFT's (``embedding``, ``mlp_head``, ``lstm_head``),
and so are the shapes and the initialisation (``H`` ~ N(0, 1), torch's defaults for the rest).

Files. PEFT saves the encoder's *output* (``prompt_embeddings``, ``(n, d)``) and nothing of the encoder; it loads that
file for inference only (``is_trainable=True`` is refused for prompt-learning methods). So:

- [`save_adapter`][lightning_peft.peft.save_adapter] writes PEFT's file: the prompt ``P`` (computed without dropout),
  which PEFT loads with equal outputs. It is the inference artefact: the encoder is not in it.
- Checkpoints (the ``PTuning`` callback, `adapter_state_dict`) keep the encoder (``H`` and the heads): resuming
  continues the same encoder, bit for bit.
- [`load_adapter`][lightning_peft.peft.load_adapter] of PEFT's file gives a *folded* P-tuning adapter: its prompt is
  the file's ``P`` as a trainable table, with no encoder (none can be recovered from ``P``). Outputs equal PEFT's;
  training on from it trains ``P`` directly, which is prompt tuning started from ``P``, not P-tuning.
  [`fold_prompt_encoder`][lightning_peft.peft.fold_prompt_encoder] does the same to a trained model (outputs unchanged).

Not supported (refused): encoder-decoder models (PEFT's ``num_transformer_submodules=2``), and a second soft prompt on
one model (prompt tuning's or P-tuning's).

Examples:
    >>> import torch
    >>> from transformers import BertConfig, BertForSequenceClassification
    >>> model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
    ...     num_attention_heads=2, intermediate_size=32, max_position_embeddings=32))
    >>> inject_p_tuning(model, num_virtual_tokens=4, encoder_hidden_size=8)
    PTuningEncoder(
      (embedding): Embedding(4, 16)
      (mlp_head): Sequential(
        (0): Linear(in_features=16, out_features=8, bias=True)
        (1): ReLU()
        (2): Linear(in_features=8, out_features=8, bias=True)
        (3): ReLU()
        (4): Linear(in_features=8, out_features=16, bias=True)
      )
    )
    >>> model(torch.tensor([[5, 6, 7]])).logits.shape
    torch.Size([1, 2])
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from ..._checks import choice, integer, names, probability
from .._common import adapter_dtype, config_of, refuse_absent, require
from ..adapter import attach, attached, refreeze, register, remove_adapter, unwrap
from ..modules_to_save import present_modules, select_modules_to_save, wrap_modules_to_save
from .embedding import (
    PROMPT_MODULE,
    SoftPrompt,
    check_model,
    input_embeddings,
    position_limit,
    prepend_prompt,
    remove_prompt_hook,
    token_dim,
)
from .shared import PROMPT_LEARNING_FIELDS, PromptLearningAdapter, check_token_dim

__all__ = ["PTuningAdapter", "PTuningConfig", "PTuningEncoder", "fold_prompt_encoder", "inject_p_tuning",
           "unload_p_tuning"]

log = logging.getLogger(__name__)

_WHO = "PTuning"
_TECHNIQUE = "P-tuning"
_TYPES = ("MLP", "LSTM")
_MLP_LAYERS = 2  # PEFT's MLP always has two hidden layers (PromptEncoderConfig.encoder_num_layers' default)


@dataclass(frozen=True)
class PTuningConfig:
    """P-tuning's settings, with the names of PEFT's ``PromptEncoderConfig``. Validated on construction.

    Settings PEFT accepts and then ignores are refused here, so that a config says what runs: the MLP always has two
    hidden layers and no dropout; the LSTM's dropout acts between its layers, so it needs two or more.

    Args:
        num_virtual_tokens: ``n``, the number of virtual tokens.
        encoder_reparameterization_type: ``"MLP"`` (PEFT's default) or ``"LSTM"`` (bidirectional, then an MLP).
        encoder_hidden_size: ``h``; None: the embedding width ``d`` (PEFT needs it given).
        encoder_num_layers: LSTM layers (``"LSTM"`` only; the MLP's is 2).
        encoder_dropout: Dropout between LSTM layers (``"LSTM"`` with 2+ layers only); only steers training.
        token_dim: ``d``; None: the model's input-embedding width (given, it must be that width).
        modules_to_save: Modules trained and saved in full (names or dotted suffixes), e.g. a new classifier head.
            None: a Hugging Face task model's head (``classifier`` / ``score`` / ``qa_outputs``); ``[]``: none.
    """

    num_virtual_tokens: int = 20
    encoder_reparameterization_type: Literal["MLP", "LSTM"] = "MLP"
    encoder_hidden_size: int | None = None
    encoder_num_layers: int = _MLP_LAYERS
    encoder_dropout: float = 0.0
    token_dim: int | None = None
    modules_to_save: list[str] | None = None

    def __post_init__(self) -> None:
        normal = object.__setattr__  # frozen: normalised values are set this way; the caller's objects are not mutated
        normal(self, "num_virtual_tokens", integer(_WHO, "num_virtual_tokens", self.num_virtual_tokens, minimum=1,
                                                   example="20"))
        kind = choice(_WHO, "encoder_reparameterization_type", self.encoder_reparameterization_type, _TYPES)
        for field in ("encoder_hidden_size", "token_dim"):
            if getattr(self, field) is not None:
                normal(self, field, integer(_WHO, field, getattr(self, field), minimum=1, example="768"))
        layers = integer(_WHO, "encoder_num_layers", self.encoder_num_layers, minimum=1, example="2")
        dropout = probability(_WHO, "encoder_dropout", self.encoder_dropout)
        normal(self, "encoder_num_layers", layers)
        normal(self, "encoder_dropout", dropout)
        if kind == "MLP" and (layers != _MLP_LAYERS or dropout):
            raise ValueError(
                f"PTuning(encoder_reparameterization_type='MLP', encoder_num_layers={layers}, encoder_dropout="
                f"{dropout}): the MLP encoder has exactly {_MLP_LAYERS} hidden layers and no dropout (PEFT ignores "
                "both settings for it). Leave them at their defaults, or use encoder_reparameterization_type='LSTM'."
            )
        if kind == "LSTM" and dropout and layers < 2:
            raise ValueError(
                f"PTuning(encoder_num_layers=1, encoder_dropout={dropout}): the LSTM applies dropout between its "
                "layers, so one layer has none. Use encoder_num_layers=2 or more, or encoder_dropout=0."
            )
        if self.modules_to_save is not None:
            normal(self, "modules_to_save", names(_WHO, "modules_to_save", self.modules_to_save))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``PTuningConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_peft(cls, config: Any, source: str = "peft.PromptEncoderConfig") -> PTuningConfig:
        """Translate a Hugging Face PEFT ``PromptEncoderConfig`` (object or dict) to a
        [`PTuningConfig`][lightning_peft.peft.PTuningConfig]: the settings PEFT ignores (an MLP's layers and
        dropout, a one-layer LSTM's dropout) become what PEFT runs."""
        if not isinstance(config, dict):
            config = config.to_dict()
        n = PTuningAdapter.peft_num_virtual_tokens(config, source)
        kind = str(getattr(config.get("encoder_reparameterization_type"), "value",
                           config.get("encoder_reparameterization_type") or "MLP"))
        layers, dropout = config.get("encoder_num_layers", _MLP_LAYERS), config.get("encoder_dropout", 0.0)
        if kind == "MLP" or (isinstance(layers, int) and layers < 2):
            dropout = 0.0
        try:
            return cls(num_virtual_tokens=n, encoder_reparameterization_type=kind,
                       encoder_hidden_size=config.get("encoder_hidden_size"),
                       encoder_num_layers=_MLP_LAYERS if kind == "MLP" else layers, encoder_dropout=dropout,
                       token_dim=config.get("token_dim"), modules_to_save=config.get("modules_to_save"))
        except (TypeError, ValueError) as err:  # a value PTuningConfig refuses: the message names the file
            raise type(err)(f"load_adapter: {source} holds a value P-tuning refuses: {err}") from None

    def agrees(self, asked: PTuningConfig, folded: bool) -> bool:
        """Whether a prompt made with this config (``folded``: its encoder replaced by its output) is the one
        ``asked`` describes. A folded prompt counts as the encoder it came from; ``token_dim`` and ``modules_to_save``
        left None on either side agree with any; the dropout only steers training."""
        if self.num_virtual_tokens != asked.num_virtual_tokens:
            return False
        for field in ("token_dim", "modules_to_save"):
            mine, theirs = getattr(self, field), getattr(asked, field)
            if mine is not None and theirs is not None and mine != theirs:
                return False
        encoder = ("encoder_reparameterization_type", "encoder_hidden_size", "encoder_num_layers")
        return folded or all(getattr(self, f) == getattr(asked, f) for f in encoder)


class PTuningEncoder(SoftPrompt):
    """The P-tuning prompt: the table ``embedding`` ``(n, d)`` and the encoder that maps it to the prompt (PEFT's
    ``PromptEncoder``, same parameter names); folded, the table is the prompt and both heads are None.

    Args:
        num_virtual_tokens: ``n``.
        token_dim: ``d``.
        config: The encoder's settings; None: folded (no encoder).
        position_limit: How many positions the model's learned position table holds, or None.
    """

    who = _WHO

    def __init__(self, num_virtual_tokens: int, token_dim: int, config: PTuningConfig | None,
                 position_limit: int | None) -> None:
        super().__init__()
        self.position_limit = position_limit
        self.embedding = nn.Embedding(num_virtual_tokens, token_dim)  # (n, d), N(0, 1) as in PEFT
        self.lstm_head: nn.LSTM | None = None
        self.mlp_head: nn.Sequential | None = None
        if config is None:
            return
        d, h = token_dim, config.encoder_hidden_size or token_dim
        if config.encoder_reparameterization_type == "LSTM":
            self.lstm_head = nn.LSTM(d, h, num_layers=config.encoder_num_layers, dropout=config.encoder_dropout,
                                     bidirectional=True, batch_first=True)
            self.mlp_head = nn.Sequential(nn.Linear(2 * h, 2 * h), nn.ReLU(), nn.Linear(2 * h, d))
        else:
            self.mlp_head = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d))

    @property
    def num_virtual_tokens(self) -> int:
        return self.embedding.num_embeddings

    @property
    def folded(self) -> bool:
        return self.mlp_head is None

    def table(self) -> Tensor:
        """The prompt ``(n, d)``: the encoder's output (with the LSTM's dropout in training mode), or the table."""
        # Through the modules' calls, as PEFT does: sharding strategies (ZeRO-3) gather a module's parameters around
        # its own forward, and the embedding is never called otherwise.
        x = self.embedding(torch.arange(self.num_virtual_tokens, device=self.embedding.weight.device))  # (n, d)
        return self._encode(x, nn.Module.__call__)

    def inference_table(self) -> Tensor:
        """The prompt ``(n, d)`` as the model in eval mode uses it (no dropout): what PEFT's file holds.

        It runs the modules' ``forward`` without their hooks: a save computes it on one rank, inside parameters
        gathered on every rank, where a sharding strategy's hooks would start a collective the other ranks never join.
        """
        mode = self.training
        self.eval()
        try:
            return self._encode(self.embedding.weight, lambda module, x: module.forward(x))
        finally:
            self.train(mode)

    def _encode(self, x: Tensor, run) -> Tensor:
        """The encoder on the table ``x`` (n, d); ``run(module, input)`` runs one module."""
        if self.lstm_head is not None:
            x = run(self.lstm_head, x.unsqueeze(0))[0].squeeze(0)  # (1, n, d) -> (1, n, 2h) -> (n, 2h)
        for layer in self.mlp_head or ():
            x = run(layer, x)
        return x  # (n, d)


# --- the technique --------------------------------------------------------------------------------------------


def inject_p_tuning(model: nn.Module, config: PTuningConfig | None = None, **kwargs: Any) -> PTuningEncoder:
    """Prepend ``num_virtual_tokens`` embeddings produced by a trained encoder to every input of ``model``, in place;
    freeze the rest.

    After the call only the parameters of the adapters attached to ``model`` train: the table and the encoder, the
    trainable copies of ``modules_to_save``, and any other technique's. Nothing is changed if an error is raised.

    Args:
        model: A Hugging Face ``PreTrainedModel`` (encoder-only or decoder-only; a ``torch.compile`` wrapper is
            looked through).
        config: A [`PTuningConfig`][lightning_peft.peft.PTuningConfig], or its fields as keyword arguments.

    Returns:
        The [`PTuningEncoder`][lightning_peft.peft.PTuningEncoder] attached at ``model.lightning_peft_prompt``.

    Raises:
        RuntimeError: If ``model`` already has a soft prompt (prompt tuning's or P-tuning's).
        ValueError: If a setting is invalid, ``token_dim`` is not the model's width, the prompt fills the model's
            learned positions, or the model is encoder-decoder.
        TypeError: If ``model`` has no input embeddings or an argument has the wrong type.
    """
    config = config_of(PTuningConfig, config, kwargs, "inject_p_tuning", "P-tuning encoders")
    return _inject(unwrap(model), config, folded=False, who="inject_p_tuning")


def _inject(model: nn.Module, config: PTuningConfig, folded: bool, who: str) -> PTuningEncoder:
    embeddings = input_embeddings(model, who)
    width = token_dim(embeddings)
    if config.token_dim not in (None, width):
        raise ValueError(f"{who}(token_dim={config.token_dim}): {type(model).__name__}'s input embeddings are {width} "
                         "wide; leave token_dim None or give that width.")
    check_model(model, config.num_virtual_tokens, who, _TECHNIQUE)
    to_save = select_modules_to_save(model, config.modules_to_save, who)
    encoder = PTuningEncoder(config.num_virtual_tokens, width, None if folded else config, position_limit(model))
    encoder.to(device=embeddings.weight.device, dtype=adapter_dtype(embeddings.weight)).train(model.training)
    wrap_modules_to_save(model, to_save)
    model.add_module(PROMPT_MODULE, encoder)
    model.register_forward_pre_hook(prepend_prompt, with_kwargs=True)
    attach(model, PTuningAdapter(dataclasses.replace(config, modules_to_save=to_save), folded, to_save))
    log.info("P-tuning: %d virtual tokens on %s (%s)%s", config.num_virtual_tokens, type(model).__name__,
             "folded" if folded else f"{config.encoder_reparameterization_type} encoder",
             f", saving {', '.join(to_save)} in full" if to_save else "")
    return encoder


def fold_prompt_encoder(model: nn.Module) -> Tensor:
    """Replace the P-tuning encoder of ``model`` by the prompt it produces (in eval mode), in place.

    Outputs in eval mode stay bit-identical; the prompt becomes the one parameter (what PEFT saves as
    ``prompt_embeddings``), so training on from here is prompt tuning from that prompt. Idempotent. An optimizer built
    before holds the old parameters: fold after training.

    Returns:
        The prompt ``(n, d)`` (the new parameter, detached).

    Raises:
        RuntimeError: If ``model`` has no P-tuning adapter.
    """
    adapter = require(model, PTuningAdapter.kind, "fold_prompt_encoder", "P-tuning adapter", "inject_p_tuning")
    encoder = adapter.encoder(model)
    if not encoder.folded:
        with torch.no_grad():
            table = encoder.inference_table()  # (n, d)
        encoder.embedding = nn.Embedding(*table.shape, device=table.device, dtype=table.dtype)
        with torch.no_grad():
            encoder.embedding.weight.copy_(table)
        encoder.lstm_head = encoder.mlp_head = None
        adapter.folded = True
        refreeze(model)
    return encoder.embedding.weight.detach()


def unload_p_tuning(model: nn.Module) -> nn.Module:
    """Remove P-tuning from ``model`` in place: the hook, the encoder, and the ``modules_to_save`` copies (the
    original modules come back). Returns the plain model.

    Raises:
        RuntimeError: If ``model`` has no P-tuning adapter.
    """
    adapter = require(model, PTuningAdapter.kind, "unload_p_tuning", "P-tuning adapter", "inject_p_tuning")
    return remove_adapter(model, adapter, merge=False)


@register
class PTuningAdapter(PromptLearningAdapter):
    """P-tuning's side of the adapter protocol: what [`inject_p_tuning`][lightning_peft.peft.inject_p_tuning] did
    to a model.

    Args:
        config: The config used.
        folded: Whether the encoder was replaced by its output (a PEFT file loaded, or
            [`fold_prompt_encoder`][lightning_peft.peft.fold_prompt_encoder]).
        modules_to_save: Full names of the modules trained and saved in full.
    """

    kind: ClassVar[str] = "p_tuning"
    peft_type: ClassVar[str] = "P_TUNING"
    peft_fields: ClassVar[frozenset[str]] = PROMPT_LEARNING_FIELDS | {  # peft 0.21.2's PromptEncoderConfig
        "encoder_dropout", "encoder_hidden_size", "encoder_num_layers", "encoder_reparameterization_type"}
    training_only: ClassVar[tuple[str, ...]] = ("encoder_dropout",)
    module_name: ClassVar[str] = PROMPT_MODULE
    technique: ClassVar[str] = "P-tuning"
    thing: ClassVar[str] = "prompt"
    not_a_weight: ClassVar[str] = "extra input embeddings"

    def __init__(self, config: PTuningConfig, folded: bool, modules_to_save: Iterable[str]) -> None:
        super().__init__(modules_to_save)
        self.config = config
        self.folded = folded

    def __repr__(self) -> str:
        return f"PTuningAdapter({self.config}, folded={self.folded}, modules_to_save={list(self.modules_to_save)})"

    @staticmethod
    def encoder(model: nn.Module) -> PTuningEncoder:
        return getattr(unwrap(model), PROMPT_MODULE)

    def config_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "folded": self.folded, "modules_to_save": list(self.modules_to_save)}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether the prompt is the one ``config["config"]`` asks for (a `config_dict`, or a callback's request of
        that shape), by [`PTuningConfig.agrees`][lightning_peft.peft.PTuningConfig.agrees]."""
        return self.config.agrees(PTuningConfig(**config["config"]), self.folded)

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> PTuningAdapter:
        model = unwrap(model)
        refuse_absent(model, config["modules_to_save"], "PTuning: the recorded adapter")
        ours = PTuningConfig(**{**config["config"], "modules_to_save": list(config["modules_to_save"])})
        _inject(model, ours, bool(config.get("folded")), _WHO)
        return attached(model)[cls.kind]

    def table(self, model: nn.Module) -> Tensor:
        """The prompt ``(n, d)`` without dropout; once folded, the table parameter itself (what a PEFT file loads
        into)."""
        encoder = self.encoder(model)
        return encoder.embedding.weight if encoder.folded else encoder.inference_table()

    def remove_hook(self, model: nn.Module) -> None:
        remove_prompt_hook(model)

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        model = unwrap(model)
        common = self.soft_prompt_common(model, self.config.num_virtual_tokens)
        return {
            **common,
            "encoder_reparameterization_type": self.config.encoder_reparameterization_type,
            "encoder_hidden_size": self.config.encoder_hidden_size or common["token_dim"],
            "encoder_num_layers": self.config.encoder_num_layers,
            "encoder_dropout": self.config.encoder_dropout,
        }

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        if not self.folded:
            raise RuntimeError(
                f"load_adapter: the model's P-tuning prompt is produced by its encoder, and {source} holds only a "
                "prompt (PEFT saves the encoder's output as prompt_embeddings). Call fold_prompt_encoder(model) first, "
                "or load into a model without a prompt."
            )
        self.check_prompt_length(config, source, self.config.num_virtual_tokens)

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> PTuningAdapter:
        model = unwrap(model)
        ours = PTuningConfig.from_peft(config, source)
        check_token_dim(model, config, source)
        present = present_modules(model, config.get("modules_to_save"), source)
        # The file holds the encoder's output, so the adapter is folded: that output is its prompt.
        _inject(model, dataclasses.replace(ours, modules_to_save=present), folded=True, who="load_adapter")
        return attached(model)[cls.kind]
