"""What `AdapterCallback` asks of a technique's callback, answered once for the two LoRA callbacks from their
`LoRAConfig`s: ``LoRA`` keeps one in ``self.config``, ``MultiLoRA`` one per named adapter in ``self.configs``; and the
strategies LoRA's layers cannot run under."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_peft._seams import refuse, strategy_family
from lightning_peft.peft.adapter import unwrap
from lightning_peft.peft.lora import LoRAAdapter, LoRAConfig
from lightning_peft.peft.lora.targets import select_targets


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


def refuse_attention_under_deepspeed_zero3(model: nn.Module, config: LoRAConfig, strategy: Any) -> None:
    """DeepSpeed ZeRO-3 gathers a module's partitioned parameters in hooks around that module's own forward; LoRA on
    ``nn.MultiheadAttention`` runs the module with its adapted weights in their place (``functional_call``), which
    the hooks meet as plain tensors, and the module reads ``out_proj.weight`` without running ``out_proj``. Asked
    before injecting, so a refused model is left as it was."""
    stage = (getattr(strategy, "config", None) or {}).get("zero_optimization", {}).get("stage")
    if strategy_family(strategy) != "deepspeed" or stage != 3:
        return
    model = unwrap(model)  # a torch.compile wrapper, as inject_lora looks through it
    attention = [n for n in select_targets(model, config)[0]
                 if isinstance(model.get_submodule(n), nn.MultiheadAttention)]
    if attention:
        raise refuse(
            f"LoRA on the nn.MultiheadAttention {attention[0]!r}", strategy, "DeepSpeed ZeRO-3 gathers a module's "
            "partitioned parameters around that module's own forward, and the attention adapter runs "
            "nn.MultiheadAttention with its adapted weights in place of its parameters (nn.MultiheadAttention also "
            "reads out_proj.weight without running out_proj), which DeepSpeed cannot gather",
            "use ZeROStrategy(stage=3, backend='native') (FSDP2) or DeepSpeed stage 1 or 2, or leave the attention "
            "modules out of target_modules",
        )
