"""AdaLoRA on a whole model: inject, allocate, merge, disable, unload, and AdaLoRA's side of the adapter protocol
(with Hugging Face PEFT's file format, ``rank_pattern`` included).

Paper: Zhang et al., "Adaptive Budget Allocation for Parameter-Efficient Fine-Tuning", arXiv:2303.10512. Each adapted
weight gets an update in SVD form whose singular values are pruned during training by importance, so the rank budget
goes where it matters:

```text
h = W x + P Λ Q x * lora_alpha / (init_r + 1e-5)      P = lora_B (out, r), Λ = diag(lora_E), Q = lora_A (r, in)
loss += orth_reg_weight * mean(||P^T P - I||_F, ||Q Q^T - I||_F)
```

The schedule (`lightning_peft.peft.adalora.allocator`) runs once per optimizer step, after ``optimizer.step()`` and
before ``zero_grad`` (`update_and_allocate`; the ``AdaLoRA`` callback calls it). Merged, ``P Λ Q`` scaled is added to
``W`` (transposed for transformers' ``Conv1D``, reshaped for ``nn.Conv2d``). Shapes: `lightning_peft.peft.adalora.layer`.

Equal to Hugging Face PEFT 0.21.2's AdaLoRA (``peft_type: "ADALORA"``): the same targets for a config, outputs, merged
weights, allocation (scores, masks, rank pattern), and files: ``<module>.lora_A`` / ``lora_E`` / ``lora_B``, resized
to the kept triplets once an allocation has masked, with ``rank_pattern`` in ``adapter_config.json``. One difference:
on a float64 model PEFT leaves ``ranknum`` trainable (its dtype move re-creates the parameter), so an optimizer over
PEFT's trainable parameters changes the scale; here it is a constant.

Examples:
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_adalora, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> sorted(inject_adalora(model, target_modules=["0", "2"], init_r=4, target_r=2))
    ['0', '2']
    >>> trainable_parameters(model).trainable  # '0': A 4x8, E 4, B 16x4; '2': A 4x16, E 4, B 2x4
    176
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .. import _wrapping as wrapping
from .._common import (
    refuse_absent,
    require,
)
from ..adapter import (
    attach,
    attached,
    clean_key,
    register,
    remove_adapter,
    trainable_parameters,
    unwrap,
)
from ..modules_to_save import (
    present_modules,
    saved_state,
    set_submodule,
    wrap_modules_to_save,
)
from .allocator import FACTORS, RankAllocator, orthogonal_regularization
from .config import PEFT_FIELDS, PEFT_TYPE, WHO, AdaLoraConfig, as_config
from .layer import SVDLayer, supported

log = logging.getLogger("lightning_peft.peft.adalora")
TARGETING = wrapping.Targeting(WHO, "AdaLoRA", "adapt", "nn.Linear, transformers Conv1D, ungrouped nn.Conv2d",
                               supported, "encoder.layer.0.query")


def adalora_layers(model: nn.Module) -> dict[str, SVDLayer]:
    """All AdaLoRA layers of ``model`` by full module name."""
    return wrapping.layers_of(model, SVDLayer)


def inject_adalora(model: nn.Module, config: AdaLoraConfig | None = None, **kwargs: Any) -> dict[str, SVDLayer]:
    """Wrap the ``target_modules`` of ``model`` in `SVDLayer`s (`lightning_peft.peft.adalora.layer`), in place, and
    freeze everything but the factors (and ``modules_to_save``).

    Args:
        model: Any ``nn.Module`` (a Hugging Face model, the ``PreTrainedModel`` itself).
        config: An [`AdaLoraConfig`][lightning_peft.peft.AdaLoraConfig]; or its fields as keyword arguments.

    Returns:
        The new layers by module name.

    Raises:
        RuntimeError: If ``model`` already has AdaLoRA.
        ValueError: If a name matches nothing, a target is wrapped by another technique, or a setting is invalid.
        TypeError: If a target is a layer AdaLoRA cannot adapt, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_adalora")
    model = unwrap(model)
    wrapping.refuse_second(model, SVDLayer, "inject_adalora", "AdaLoRA")
    targets, to_save = select(model, config)
    return _inject(model, config, targets, to_save)


def select(model: nn.Module, config: AdaLoraConfig) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names, as PEFT picks them (a ``rank_pattern`` must name each target);
    raises before anything is changed."""
    chosen, to_save = TARGETING.select(model, config)
    if config.rank_pattern is not None:
        missing = [n for n in chosen if f"{clean_key(n)}.lora_E" not in config.rank_pattern]
        if missing:
            raise ValueError(f"{WHO}(rank_pattern=...): no entry {clean_key(missing[0])}.lora_E for target "
                             f"{missing[0]!r}; the pattern holds {sorted(config.rank_pattern)}.")
    return chosen, to_save


def _inject(model: nn.Module, config: AdaLoraConfig, targets: list[str], to_save: list[str]) -> dict[str, SVDLayer]:
    """Wrap exactly ``targets`` (checked) and ``to_save``, resize by a loaded ``rank_pattern``, attach the adapter."""
    adapter = AdaLoraAdapter(config, targets, to_save)
    for wrapper in wrap_modules_to_save(model, to_save).values():
        wrapper.routing = adapter.switch  # disabled, they run the original module
    layers = {}
    for name in targets:
        layer = SVDLayer(model.get_submodule(name), config.init_r, config.init_r, config.lora_alpha,
                         config.lora_dropout, config.init_lora_weights, adapter.switch)
        if config.rank_pattern is not None:
            layer.resize(config.rank_pattern[f"{clean_key(name)}.lora_E"])
        layers[name] = layer
        set_submodule(model, name, layer)
    attach(model, adapter)
    log.info("AdaLoRA: %d layers of %s at rank %d (target %d); %s", len(layers), type(model).__name__, config.init_r,
             config.target_r, trainable_parameters(model))
    return layers


# --- the schedule --------------------------------------------------------------------------------------------


def start_allocation(model: nn.Module, total_step: float | None = None) -> RankAllocator:
    """Create the `lightning_peft.peft.adalora.allocator.RankAllocator` of ``model``'s AdaLoRA
    adapter over ``total_step`` optimizer steps (None: the config's ``total_step``) and return it."""
    adapter = require(model, AdaLoraAdapter.kind, "update_and_allocate", "AdaLoRA adapter", "inject_adalora")
    total = total_step if total_step is not None else adapter.config.total_step
    if total is None or not math.isfinite(total):  # an unsized dataset without max_steps: the trainer's is inf
        raise ValueError(f"update_and_allocate: AdaLoraConfig(total_step=None) and total_step={total}; give "
                         "total_step (the run's optimizer steps) in the config or here. The AdaLoRA callback takes "
                         "trainer.estimated_stepping_batches when it is finite.")
    adapter.allocator = RankAllocator(adalora_layers(model), adapter.config, int(total))
    return adapter.allocator


def update_and_allocate(model: nn.Module, step: int) -> dict[str, list[bool]] | None:
    """Run AdaLoRA's allocation for optimizer step ``step`` (0-based), as PEFT's
    ``model.base_model.update_and_allocate(step)``: call it after ``optimizer.step()`` and before ``zero_grad``.

    Returns:
        The rank pattern the step set (None: the step did not mask).
    """
    adapter = require(model, AdaLoraAdapter.kind, "update_and_allocate", "AdaLoRA adapter", "inject_adalora")
    allocator = adapter.allocator or start_allocation(model)
    return allocator.step(step)


def orthogonal_loss(model: nn.Module) -> Tensor:
    """``orth_reg_weight`` times PEFT's orthogonal regularisation of ``model``'s AdaLoRA factors (differentiable):
    add it to the loss before ``backward``, as PEFT adds it to ``outputs.loss``."""
    adapter = require(model, AdaLoraAdapter.kind, "orthogonal_loss", "AdaLoRA adapter", "inject_adalora")
    return adapter.config.orth_reg_weight * orthogonal_regularization(adalora_layers(model).values())


def add_orthogonal_gradient(model: nn.Module) -> Tensor | None:
    """Add the gradient of `orthogonal_loss` to the factors' ``.grad`` (the same as adding the loss before
    ``backward``, without touching the loss); returns the loss (None: ``orth_reg_weight`` is 0)."""
    adapter = require(model, AdaLoraAdapter.kind, "orthogonal_loss", "AdaLoRA adapter", "inject_adalora")
    if adapter.config.orth_reg_weight == 0:
        return None
    params = [getattr(layer, f) for layer in adalora_layers(model).values() for f in ("lora_A", "lora_B")]
    with torch.enable_grad():
        loss = orthogonal_loss(model)
        grads = torch.autograd.grad(loss, params)  # runs no gradient hooks (a DDP reducer's): added on every rank
    for param, grad in zip(params, grads):
        param.grad = grad if param.grad is None else param.grad.add_(grad)
    return loss.detach()


# --- merge, disable, unload ----------------------------------------------------------------------------------


def unload_adalora(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove AdaLoRA from ``model`` in place and return the plain model: with ``merge``, the updates folded into the
    base weights and the trained ``modules_to_save`` copies kept; without, the base as it was.

    Raises:
        RuntimeError: If ``model`` has no AdaLoRA, or (``merge``) a merged weight would be quantized or not finite.
    """
    adapter = require(model, AdaLoraAdapter.kind, "unload_adalora", "AdaLoRA adapter", "inject_adalora")
    return remove_adapter(model, adapter, merge)


def merge_adalora(model: nn.Module) -> list[str]:
    """Add every update to its base weight in place (`unmerge_adalora` subtracts it); layers already merged are left
    alone. All or nothing.

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no AdaLoRA, a weight is tied to another module or quantized, or a merged weight
            is not finite (the layers merged by this call are unmerged again).
    """
    require(model, AdaLoraAdapter.kind, "merge_adalora", "AdaLoRA adapter", "inject_adalora")
    return wrapping.merge_layers(model, adalora_layers(model), "merge_adalora")


def unmerge_adalora(model: nn.Module) -> list[str]:
    """Subtract the merged updates from the base weights, in place.

    Raises:
        RuntimeError: If no AdaLoRA layer is merged.
    """
    require(model, AdaLoraAdapter.kind, "unmerge_adalora", "AdaLoRA adapter", "inject_adalora")
    return wrapping.unmerge_layers(model, adalora_layers(model), "unmerge_adalora", "AdaLoRA", "merge_adalora")


def disable_adalora(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Context manager: inside it every AdaLoRA layer computes its base layer's output, and every
    ``modules_to_save`` wrapper its original module's.

    Raises:
        RuntimeError: If ``model`` has no AdaLoRA, or a layer is merged (the base output is then not available).
    """
    switch = require(model, AdaLoraAdapter.kind, "disable_adalora", "AdaLoRA adapter", "inject_adalora").switch
    return wrapping.disabled(switch, adalora_layers(model).values(), "disable_adalora", "unmerge_adalora")


# --- the adapter protocol ------------------------------------------------------------------------------------


@register
class AdaLoraAdapter(wrapping.TargetsAdapter):
    """AdaLoRA's side of the adapter protocol: what [`inject_adalora`][lightning_peft.peft.inject_adalora] did to a
    model, and its `lightning_peft.peft.adalora.allocator.RankAllocator` once allocation started.

    Args:
        config: The config used.
        targets: Full names of the adapted modules.
        modules_to_save: Full names of the modules trained and saved in full.
    """

    kind: ClassVar[str] = "adalora"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = PEFT_FIELDS
    mergeable: ClassVar[bool] = True
    training_only: ClassVar[tuple[str, ...]] = ("init_lora_weights", "lora_dropout")

    def __init__(self, config: AdaLoraConfig, targets: Iterable[str], modules_to_save: Iterable[str]) -> None:
        super().__init__(config, targets, modules_to_save)
        self.allocator: RankAllocator | None = None

    def rank_pattern(self) -> dict[str, list[bool]] | None:
        """The triplets kept per layer (``"<module>.lora_E"``): the allocation's, else the loaded file's."""
        allocated = self.allocator.rank_pattern if self.allocator is not None else None
        return allocated if allocated is not None else self.config.rank_pattern

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state = {f"{name}.{f}": getattr(model.get_submodule(name), f) for name in self.targets for f in FACTORS}
        return {**state, **saved_state(model, self.modules_to_save)}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> AdaLoraAdapter:
        """Inject at the recorded names (the same modules whatever the rules would pick today)."""
        model = unwrap(model)
        wrapping.refuse_second(model, SVDLayer, "inject_adalora", "AdaLoRA")
        targets, to_save = list(config["targets"]), list(config["modules_to_save"])
        refuse_absent(model, [*targets, *to_save], "AdaLoRA: the recorded adapter")
        _inject(model, AdaLoraConfig(**config["config"]), targets, to_save)
        return attached(model)[cls.kind]

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        own = [f"{name}.{factor}" for name in self.targets for factor in FACTORS]
        return wrapping.merged_state(model, state, self.targets, own)

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        """PEFT's keys; after an allocation, each layer's factors cut to the triplets it kept (PEFT's resized save)."""
        state = super().peft_state(model)
        pattern = self.rank_pattern()
        for name in self.targets if pattern is not None else ():
            keep = pattern[f"{clean_key(name)}.lora_E"]
            if len(keep) == state[f"{clean_key(name)}.lora_E"].shape[0] != sum(keep):  # not resized yet
                index = torch.tensor(keep, dtype=torch.bool, device=state[f"{clean_key(name)}.lora_E"].device)
                for factor in FACTORS:
                    key = f"{clean_key(name)}.{factor}"
                    state[key] = state[key][:, index] if factor == "lora_B" else state[key][index]
        return state

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        c = self.config
        total = self.allocator.total_step if self.allocator is not None else c.total_step
        return {
            **wrapping.peft_common(model, PEFT_TYPE, self.targets, self.modules_to_save),
            "exclude_modules": None,
            "fan_in_fan_out": any(layer.fan_in_fan_out for layer in self.wrapped(model).values()),
            "init_lora_weights": c.init_lora_weights,
            **{f: getattr(c, f) for f in ("init_r", "target_r", "lora_alpha", "lora_dropout", "tinit", "tfinal",
                                          "deltaT", "beta1", "beta2", "orth_reg_weight")},
            # PEFT refuses total_step=None; unknown (no allocation ran), the smallest it accepts: it steers training only
            "total_step": total if total is not None else c.tinit + c.tfinal + 1,
            "rank_pattern": self.rank_pattern(),
        }

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        """The file's ranks must be this adapter's (its factors are loaded into the layers as they are)."""
        wrapping.refuse_merged_load(adalora_layers(model).values(), "AdaLoRA updates", "unmerge_adalora")
        theirs = AdaLoraConfig.from_peft(config, source)
        for name, layer in adalora_layers(model).items():
            keep = (theirs.rank_pattern or {}).get(f"{clean_key(name)}.lora_E")
            rank = sum(keep) if keep is not None else theirs.init_r
            if rank != layer.rank or theirs.init_r != layer.ranknum:
                raise ValueError(f"load_adapter: {source} gives layer {name!r} rank {rank} of init_r={theirs.init_r}, "
                                 f"but the model's AdaLoRA layer has rank {layer.rank} of init_r={layer.ranknum:g}. "
                                 "Load it into a model without AdaLoRA.")

    @classmethod
    def check_peft_shapes(cls, model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                          files: Any, inject: bool) -> None:
        """Every factor has the rank the file's config gives its module (``init_r``, or its ``rank_pattern``'s
        count), and (``inject``) every factor the config would allocate is in the file; before anything is
        allocated."""
        ours = AdaLoraConfig.from_peft(config, str(files.config))
        for key, shape in shapes.items():
            path, _, factor = key.rpartition(".")
            if factor not in FACTORS:
                continue
            keep = (ours.rank_pattern or {}).get(f"{path}.lora_E")
            rank, dim = (sum(keep) if keep is not None else ours.init_r), (1 if factor == "lora_B" else 0)
            if len(shape) != 2 or shape[dim] != rank:
                field = f"rank_pattern[{path + '.lora_E'!r}]" if keep is not None else "init_r"
                raise files.torn(key, shape, dim, field, rank)
        if inject:
            saved = present_modules(unwrap(model), ours.modules_to_save, str(files.config))
            targets, _ = select(unwrap(model), dataclasses.replace(ours, modules_to_save=saved))
            missing = [f"{clean_key(t)}.{f}" for t in targets for f in FACTORS if f"{clean_key(t)}.{f}" not in shapes]
            if missing:
                raise files.lacking(missing, "its adapter config asks for", type(unwrap(model)).__name__)

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> AdaLoraAdapter:
        wrapping.inject_from_peft(model, AdaLoraConfig.from_peft(config, source), source,
                                  lambda ours: inject_adalora(model, ours))
        return attached(model)[cls.kind]
