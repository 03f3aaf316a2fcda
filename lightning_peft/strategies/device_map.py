"""``DeviceMapStrategy``: plain model parallelism in one process, consecutive layers on different devices.

The Lightning glue over `lightning_peft.parallel.device_map.dispatch_model` (the map, the hooks, the limits:
see that module): at ``model_to_device`` (after the PEFT callbacks injected their adapters) the LightningModule, or
its ``model_attribute``, is placed by the map; ``LightningModule.device`` is the first device, where batches go;
each parameter's optimizer state lives on the parameter's device.

YAML:

```yaml
trainer:
  accelerator: gpu
  devices: 2              # cuda:0 and cuda:1 ("cpu" twice with accelerator: cpu)
  strategy:
    class_path: lightning_peft.strategies.DeviceMapStrategy
    init_args: {device_map: auto}
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_peft._checkpoint_io import AtomicCheckpoints
from lightning_peft._submodule import submodule
from lightning_peft.parallel.device_map import (
    DeviceMap,
    dispatch_model,
    infer_device_map,
    optimizer_state_to_params,
    parse_device,
    place_outside,
)

__all__ = ["DeviceMapStrategy"]


class DeviceMapStrategy(AtomicCheckpoints, SingleDeviceStrategy):
    """Plain model parallelism in one process: consecutive layers on different devices (see the module docstring).

    Args:
        device_map: ``"auto"`` (balanced by parameter count over ``devices``) or ``{module name: device}``.
        devices: The devices for ``"auto"``, in order (``["cuda:0", "cuda:1"]``, ``[0, 1]``, ``["cpu", "cpu"]``);
            default: the Trainer's (``Trainer(accelerator="gpu", devices=2)`` gives ``cuda:0`` and ``cuda:1``).
            Not with a dict map (its values are the devices).
        model_attribute: Dotted path of the model to split inside the LightningModule (e.g. ``"decoder"``); map
            names are relative to it. Default: the LightningModule itself.
        accelerator: As for Lightning's strategies (the Trainer fills it).
        checkpoint_io: As for Lightning's strategies (the Trainer fills it).
        precision_plugin: As for Lightning's strategies (the Trainer fills it).

    Raises:
        ValueError: If ``device_map`` is neither ``"auto"`` nor a non-empty dict, both a dict and ``devices`` are
            given, ``devices`` is empty, or a device does not exist on this machine.
        TypeError: If a device is not a string, integer or ``torch.device``.

    Examples:
        >>> strategy = DeviceMapStrategy(devices=["cpu", "cpu"])
        >>> strategy.root_device
        device(type='cpu')
    """

    strategy_name = "device_map"

    def __init__(
        self,
        device_map: str | dict[str, str | int] = "auto",
        devices: list[str | int] | None = None,
        model_attribute: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._map: dict[str, torch.device] | None = None
        if isinstance(device_map, dict):
            if not device_map:
                raise ValueError(
                    "DeviceMapStrategy(device_map={}): the map is empty; give {module name: device} entries or "
                    "device_map='auto'."
                )
            if devices is not None:
                raise ValueError(
                    f"DeviceMapStrategy(device_map={{...}}, devices={devices!r}): a dict map names its devices itself; "
                    "give either the dict or devices (with device_map='auto')."
                )
            self._map = {key: parse_device(value, "DeviceMapStrategy(device_map=...)")
                         for key, value in device_map.items()}
        elif device_map != "auto":
            raise ValueError(
                f"DeviceMapStrategy(device_map={device_map!r}): give 'auto' (balanced by parameter count) or a dict "
                "{module name: device}, e.g. {'decoder.embed_tokens': 'cuda:0', 'decoder.layers.0': 'cuda:0', ...}."
            )
        if devices is not None:
            if isinstance(devices, (str, int)) or not list(devices):
                raise ValueError(
                    f"DeviceMapStrategy(devices={devices!r}): give a non-empty list of devices, e.g. "
                    "['cuda:0', 'cuda:1'] or ['cpu', 'cpu']."
                )
            devices = [parse_device(device, f"DeviceMapStrategy(devices={devices!r})") for device in devices]
        elif self._map is not None:
            devices = list(dict.fromkeys(self._map.values()))
        self._devices: list[torch.device] | None = devices
        self.model_attribute = model_attribute
        self.placement: DeviceMap | None = None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices the model is spread over (the Trainer's accelerator connector reads and fills this)."""
        return self._devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._devices = None if devices is None else [torch.device(d) for d in devices]

    @property
    def is_distributed(self) -> bool:
        """One process: no distributed sampler, no collectives."""
        return False

    @property
    @override
    def root_device(self) -> torch.device:
        """The first device: the batch, the loss and everything outside the map live there."""
        if self._map is not None:
            return next(iter(self._map.values()))
        return self._devices[0] if self._devices else torch.device("cpu")

    def _split_model(self) -> nn.Module:
        module = self.lightning_module
        return submodule(module, self.model_attribute, "DeviceMapStrategy") if self.model_attribute else module

    @override
    def model_to_device(self) -> None:
        """Places the model by the map (after any adapter was injected) and hooks the activations between devices."""
        if self.placement is not None:
            self.placement.remove()
        target = self._split_model()
        if self._map is not None:
            device_map: dict[str, torch.device] = dict(self._map)
            who = "DeviceMapStrategy(device_map=...)"
        else:
            device_map = infer_device_map(target, self._devices or [self.root_device])
            who = "DeviceMapStrategy(device_map='auto')"
        module = self.lightning_module
        outputs_of = [module] if target is module else [module, target]
        if target is not module:
            place_outside(module, target, self.root_device)
        self.placement = dispatch_model(target, device_map, self.root_device, outputs_of=outputs_of, who=who)
        _update_properties(module, device=self.root_device)  # LightningModule.device: where its batches go

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:  # Strategy.setup moved any state to the root device
                optimizer_state_to_params(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Loads the optimizer states, each parameter's onto its own device (not all onto the root device)."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
            optimizer_state_to_params(optimizer)

    @override
    def teardown(self) -> None:
        """Removes the hooks, then lets Lightning move the model to the CPU (as every strategy does at the end)."""
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        super().teardown()


StrategyRegistry.register(
    "device_map",
    DeviceMapStrategy,
    description="Plain model parallelism in one process: consecutive layers on different devices (lightning_peft)",
    override=True,
)
