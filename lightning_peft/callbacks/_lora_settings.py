"""What `AdapterCallback` asks of a technique's callback, answered once for the two LoRA callbacks from their
`LoRAConfig`s: ``LoRA`` keeps one in ``self.config``, ``MultiLoRA`` one per named adapter in ``self.configs``."""

from __future__ import annotations

from typing import Any

from lightning_peft.peft.lora import LoRAAdapter, LoRAConfig


class LoRASettings:
    """Mixin before `AdapterCallback` (the ``LoRA`` callback's): ``quantize``, ``own_dropout`` and ``shown``, read
    from `adapter_configs`."""

    config: LoRAConfig

    def adapter_configs(self) -> list[LoRAConfig]:
        """The configs of the callback's adapters, one per named adapter."""
        return [self.config]

    @property
    def quantize(self) -> str | None:
        """The configs' ``quantize``: one setting for all adapters (``MultiLoRA`` gives each the same)."""
        return self.adapter_configs()[0].quantize

    def own_dropout(self) -> float:
        """The largest dropout probability of the adapters."""
        return max(float(config.dropout) for config in self.adapter_configs())

    def shown(self, adapter: LoRAAdapter) -> Any:
        """The model's adapter as a refusal message shows it: its first adapter's config."""
        return adapter.config


class NamedLoRASettings(LoRASettings):
    """`LoRASettings` of a callback with several named adapters (``MultiLoRA``), ``{name: config}`` in
    ``self.configs``."""

    configs: dict[str, LoRAConfig]
    takes_named_adapters = True

    def adapter_configs(self) -> list[LoRAConfig]:
        return list(self.configs.values())

    def shown(self, adapter: LoRAAdapter) -> Any:
        """Every named adapter's config, by name."""
        return {name: config for name, (config, _) in adapter.adapters.items()}
