"""``MultiLoRA`` callback: several named LoRA adapters on one model, each batch routed per sample.

The math lives in `lightning_peft.peft.lora.multi`. At ``setup`` [`inject_lora`][lightning_peft.peft.inject_lora] adds
the first adapter and [`add_adapter`][lightning_peft.peft.add_adapter] the others (before ``configure_optimizers``),
then ``active`` (default: the first) becomes the active adapter; a model that already has exactly these adapters is used
as it is. Every batch (training, validation, test, predict) runs with the adapters ``batch[routing_key]`` names, by name
or by integer id (the position in ``adapters``; ``-1`` or None: the base model); a batch without the key uses the active
adapter (`RoutesBatches`). Checkpoints record the adapters as the ``LoRA`` callback's do; resuming with other adapters
is refused, naming the difference.

YAML:

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.MultiLoRA
      init_args:
        adapters:
          news: {rank: 8, alpha: 16, target_modules: [query, value]}
          sport: {rank: 4, alpha: 8, target_modules: [query, key, value]}
        modules_to_save: [classifier]
```
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from lightning_peft.callbacks._adapter import AdapterCallback
from lightning_peft.callbacks._lora_settings import NamedLoRASettings
from lightning_peft.callbacks._multi_lora import RoutesBatches, adapter_configs, check_strategy, refuse_changed_adapters
from lightning_peft.peft import add_adapter, inject_lora, set_adapter


class MultiLoRA(RoutesBatches, NamedLoRASettings, AdapterCallback):
    """Inject several named LoRA adapters at ``setup`` and route every batch per sample.

    Args:
        adapters: ``{name: LoRA settings}``: the ``LoRA`` callback's (``rank``, ``alpha``, ``dropout``,
            ``target_modules``, ...), without ``modules_to_save`` and ``bias`` (shared by every adapter).
        routing_key: The batch entry that names each sample's adapter (a list of names, or integer ids).
        active: The adapter of batches without ``routing_key`` (default: the first).
        modules_to_save: Modules trained and saved in full, shared by every adapter (e.g. ``["classifier"]``).
            None: the task head of a Hugging Face task model; ``[]``: none.
        adapter_only_checkpoint: As for ``LoRA``.
        model_attribute: As for ``LoRA``.
        quantize: As for ``LoRA``: one setting for all adapters.
    """

    who, kind, what = "MultiLoRA", "lora", "LoRA adapters"

    def __init__(
        self,
        adapters: dict[str, dict[str, Any]],
        routing_key: str = "adapter",
        active: str | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
        quantize: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.configs = adapter_configs(adapters, modules_to_save, quantize)
        if active is not None and active not in self.configs:
            raise ValueError(f"MultiLoRA(active={active!r}): not one of the adapters {list(self.configs)}.")
        self.names = list(self.configs)
        self.routing_key = routing_key
        self.active = active or self.names[0]

    def settings(self) -> dict[str, Any]:
        return {name: config.to_dict() for name, config in self.configs.items()}

    def request(self) -> dict[str, Any]:
        return {"adapters": {name: {"config": config} for name, config in self.settings().items()}}

    def check(self, trainer: pl.Trainer) -> None:
        check_strategy(trainer.strategy)
        self.check_routes(trainer.datamodule)  # set up already: Lightning sets the datamodule up first

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        first, *others = self.names
        inject_lora(model, self.configs[first], adapter_name=first)
        for name in others:
            add_adapter(model, name, self.configs[name])
        set_adapter(model, self.active)
        return f"adapters {self.names} on {type(model).__name__}"

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"adapters": self.settings()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_adapters(state_dict.get("adapters", {}), self.settings())
