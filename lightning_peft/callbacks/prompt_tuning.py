"""``PromptTuning`` callback: a trainable soft prompt in front of a LightningModule's model, injected at ``setup``.

The technique lives in :mod:`lightning_peft.peft.prompt_tuning`; this callback decides when to call it:

- ``setup``: :func:`~lightning_peft.peft.prompt_tuning.inject_prompt_tuning` on the model (before
  ``configure_optimizers``, so the optimizer sees only the prompt and the saved head) and a log line with the
  trainable-parameter report. With ``init="text"`` and no ``tokenizer``, the datamodule's ``tokenizer`` attribute is
  used (``BBCNewsDataModule`` has one). A model that already has a prompt (a later ``validate``/``test``, or a
  module restored from a checkpoint) is used as it is, if its length agrees;
- ``on_save_checkpoint``: every checkpoint records the adapters (``checkpoint["lightning_peft"]``, see
  :mod:`lightning_peft.callbacks._checkpoint`), so ``load_from_checkpoint`` rebuilds the prompt; with
  ``adapter_only_checkpoint=True`` the frozen base parameters are left out;
- loading (``Trainer.fit(ckpt_path=...)``): a checkpoint whose prompt differs from this run's (length, saved
  modules) is refused, naming both; an adapter-only checkpoint takes the frozen base from the model as built.

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_peft.callbacks.PromptTuning
          init_args: {num_virtual_tokens: 20, init: text, init_text: "Classify the topic of this article:"}
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._checkpoint import (
    AdapterCallback,
    refuse_changed_settings,
    watch_checkpoint_loads,
)
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.peft.adapter import attached
from lightning_peft.peft.adapter import trainable_parameters
from lightning_peft.peft.prompt_tuning import check_options, inject_prompt_tuning

# What must agree to resume or to reuse a prompt; the initialisation only steers the start of training.
_STRUCTURE = ("num_virtual_tokens", "modules_to_save")


class PromptTuning(AdapterCallback):
    """Prepend a trainable soft prompt to the model's input embeddings at ``setup`` and freeze the rest.

    Args:
        num_virtual_tokens: Number of virtual tokens ``n``.
        init: ``"random"`` (N(0, 1), PEFT's RANDOM), ``"vocab"`` (embeddings of random vocabulary tokens) or
            ``"text"`` (embeddings of ``init_text``'s tokens, repeated or cut to ``n``).
        init_text: The text for ``init="text"``.
        tokenizer: Name or directory of the model's tokenizer for ``init="text"``; None: the datamodule's
            ``tokenizer`` attribute.
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``. None: the task head of a
            Hugging Face task model (the random head ``from_pretrained`` creates), as PEFT's task types do;
            ``[]``: none.
        adapter_only_checkpoint: Checkpoints hold only what trains (and buffers); loading takes the frozen base
            from the model as constructed.
        model_attribute: Dotted path of the Hugging Face model inside the LightningModule. Default: the one
            Hugging Face model inside it.
    """

    who = "PromptTuning"

    def __init__(
        self,
        num_virtual_tokens: int = 8,
        init: Literal["random", "vocab", "text"] = "random",
        init_text: str | None = None,
        tokenizer: str | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        check_options(num_virtual_tokens, init, init_text, modules_to_save, "PromptTuning")
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise TypeError(
                f"PromptTuning(tokenizer={type(tokenizer).__name__}): give the tokenizer's name or directory "
                "(or leave it None to use the datamodule's tokenizer)."
            )
        self.num_virtual_tokens = int(num_virtual_tokens)
        self.init = init
        self.init_text = init_text
        self.tokenizer = tokenizer
        self.modules_to_save = None if modules_to_save is None else list(modules_to_save)
        self.adapter_only_checkpoint = adapter_only_checkpoint
        self.model_attribute = model_attribute

    def _config(self) -> dict[str, Any]:
        return {"num_virtual_tokens": self.num_virtual_tokens, "init": self.init, "init_text": self.init_text,
                "tokenizer": self.tokenizer, "modules_to_save": self.modules_to_save}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        _, model = resolve_target(pl_module, self.model_attribute, "PromptTuning")
        adapter = attached(model).get("prompt_tuning")
        if adapter is None:
            inject_prompt_tuning(model, self.num_virtual_tokens, self.init, self.init_text,
                                 self._tokenizer(trainer), self.modules_to_save)
            saved = attached(model)["prompt_tuning"].modules_to_save
            rank_zero_info(
                f"PromptTuning: {self.num_virtual_tokens} virtual tokens ({self.init} init) on "
                f"{type(model).__name__}{', saving ' + ', '.join(saved) + ' in full' if saved else ''}; "
                f"{trainable_parameters(pl_module)}"
            )
        elif adapter.num_virtual_tokens != self.num_virtual_tokens:
            raise RuntimeError(
                f"PromptTuning(num_virtual_tokens={self.num_virtual_tokens}): {type(model).__name__} already has a "
                f"prompt of {adapter.num_virtual_tokens} virtual tokens; use one PromptTuning callback per model, "
                "with the length the model was adapted with."
            )
        watch_checkpoint_loads(pl_module, "PromptTuning")

    def _tokenizer(self, trainer: pl.Trainer) -> Any:
        if self.init != "text" or self.tokenizer is not None:
            return self.tokenizer
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                "PromptTuning(init='text', tokenizer=None): no tokenizer to turn init_text into token ids; the "
                "datamodule has no `tokenizer` attribute set at setup. Pass tokenizer=<name or directory>."
            )
        return tokenizer

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"config": self._config()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, now = state_dict.get("config") or {}, self._config()
        refuse_changed_settings("PromptTuning", saved, now, tuple(k for k in saved if k not in _STRUCTURE))
