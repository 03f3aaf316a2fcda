"""``PromptTuning`` callback: a trainable soft prompt in front of a LightningModule's model, injected at ``setup``.

`AdapterCallback` calls [`inject_prompt_tuning`][lightning_peft.peft.inject_prompt_tuning] at ``setup`` (before
``configure_optimizers``, so the optimizer sees only the prompt and the saved head). With ``init="text"`` and no
``tokenizer``, the datamodule's ``tokenizer`` attribute is used (``BBCNewsDataModule`` has one). A model that already
has a prompt (a later ``validate``/``test``, or a module restored from a checkpoint) is used as it is, if its length
agrees. Checkpoints record the prompt (``adapter_only_checkpoint=True`` leaves the frozen base out); resuming with
another length or other saved modules is refused, naming both (the initialisation only steers the start, and may
change).

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.PromptTuning
      init_args: {num_virtual_tokens: 20, init: text, init_text: "Classify the topic of this article:"}
```
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from torch import nn

from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.peft.prompt.prompt_tuning import PromptTuningAdapter, check_options, inject_prompt_tuning


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

    who, kind, what = "PromptTuning", "prompt_tuning", "a soft prompt"

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
        super().__init__(adapter_only_checkpoint, model_attribute)
        check_options(num_virtual_tokens, init, init_text, modules_to_save, "PromptTuning")
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise TypeError(f"PromptTuning(tokenizer={type(tokenizer).__name__}): give the tokenizer's name or "
                            "directory (or leave it None to use the datamodule's tokenizer).")
        self.num_virtual_tokens = int(num_virtual_tokens)
        self.init = init
        self.init_text = init_text
        self.tokenizer = tokenizer
        self.modules_to_save = None if modules_to_save is None else list(modules_to_save)

    def settings(self) -> dict[str, Any]:
        return {"num_virtual_tokens": self.num_virtual_tokens, "init": self.init, "init_text": self.init_text,
                "tokenizer": self.tokenizer, "modules_to_save": self.modules_to_save}

    def request(self) -> dict[str, Any]:  # a prompt of this length is this one: the init only steered its start
        return {"config": {"num_virtual_tokens": self.num_virtual_tokens}}

    def shown(self, adapter: PromptTuningAdapter) -> Any:
        return adapter

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        inject_prompt_tuning(model, self.num_virtual_tokens, self.init, self.init_text, self._tokenizer(trainer),
                             self.modules_to_save)
        on = f"on {type(model).__name__}{self.saving(model)}"
        return f"{self.num_virtual_tokens} virtual tokens ({self.init} init) {on}"

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
