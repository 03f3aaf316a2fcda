"""OFT on a whole model: inject, merge, disable, unload, and OFT's side of the adapter protocol (with Hugging Face
PEFT's file format).

Papers: Qiu et al., "Controlling Text-to-Image Diffusion by Orthogonal Finetuning", arXiv:2306.07280; Qiu et al.,
"Orthogonal Finetuning Made Scalable", arXiv:2506.19847 (the input-centric form and the Cayley-Neumann series PEFT
0.21 uses). A frozen weight ``W`` is multiplied by a learned orthogonal matrix, which keeps the angles between its
neurons (the "hyperspherical energy"); the matrix is block diagonal, each block the Cayley transform of a
skew-symmetric ``Q_i``:

```text
y = W (x M) + b,    M = diag(R_1, ..., R_r),    R_i = (I - Q_i)(I + Q_i)^-1    (or a truncated Neumann series)
```

``Q = 0`` at the start, so the adapted model starts equal to the base. Merged: ``W' = W M^T`` (an embedding:
``E' = E M``). Shapes, the layer types and the Cayley variants: `lightning_peft.peft.oft.layer`.

Equal to Hugging Face PEFT 0.21.2's OFT (``peft_type: "OFT"``): the same targets for a config, the same outputs,
merged weights and files (``<module>.oft_R.weight``; an embedding's ``oft_embedding_R.weight``). Deliberate
differences: a size the blocks do not divide is refused (PEFT picks another ``r`` with a warning; the file then
says the ``r`` asked for); ``module_dropout`` drops blocks in training (PEFT 0.21.2 builds its dropout layer and never
calls it); a ``Conv2d`` rotates its weight, which is what PEFT's merge computes (PEFT's unmerged forward folds
rotated patches back and differs from its merge whenever patches overlap). PEFT's OFT has no transformers
``Conv1D``, grouped, dilated or non-square convolution: refused.

Examples:
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_oft, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> sorted(inject_oft(model, target_modules=["0", "2"], oft_block_size=4))
    ['0', '2']
    >>> trainable_parameters(model).trainable  # 2 blocks of 4x4 (6 each) + 4 blocks of 4x4
    36
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import Tensor, nn

from .._base_identity import base_model_name, task_type
from .._block_adapter import BlockAdapter
from .._common import (
    exact_choice,
    refuse_second_injection,
    require,
)
from .._in_place import (
    choose_targets,
    describe_leaves,
    merge_layers,
    refuse_odd_conv,
    switched_off,
    unmerge_layers,
)
from ..adapter import (
    attach,
    clean_key,
    register,
    remove_adapter,
    trainable_parameters,
    unwrap,
)
from ..modules_to_save import (
    set_submodule,
    wrap_modules_to_save,
)
from .config import PEFT_FIELDS, PEFT_TYPE, WHO, OFTConfig, as_config
from .layer import OFTLayer, rotated_size

log = logging.getLogger("lightning_peft.peft.oft")
_KINDS = "nn.Linear, nn.Conv2d, nn.Embedding"
PEFT_VERSION = "0.21.2"  # the PEFT whose OFT (its Cayley-Neumann series of 0.18 on) ours equals; written to our files


def oft_layers(model: nn.Module) -> dict[str, OFTLayer]:
    """All OFT layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, OFTLayer)}


def inject_oft(model: nn.Module, config: OFTConfig | None = None, **kwargs: Any) -> dict[str, OFTLayer]:
    """Wrap the ``target_modules`` of ``model`` in `OFTLayer`s (`lightning_peft.peft.oft.layer`), in place, and
    freeze everything but the rotations (and ``modules_to_save``, and the biases ``bias`` names).

    Args:
        model: Any ``nn.Module`` (a Hugging Face model, the ``PreTrainedModel`` itself).
        config: An [`OFTConfig`][lightning_peft.peft.OFTConfig]; or its fields as keyword arguments.

    Returns:
        The new layers by module name.

    Raises:
        RuntimeError: If ``model`` already has OFT.
        ValueError: If a name matches nothing, a target's size is not divisible into blocks, a convolution is of a
            kind PEFT's OFT has no format for, a target is wrapped by another technique, or a setting is invalid.
        TypeError: If a target is a layer OFT cannot rotate, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_oft")
    model = unwrap(model)
    _refuse_second_injection(model)
    targets, to_save = select(model, config)
    return _inject(model, config, targets, to_save)


def describe_modules(model: nn.Module) -> str:
    """'query, value (x2 each), ...': leaf names of the modules OFT can rotate, for messages."""
    return describe_leaves(model, lambda m: isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding)), _KINDS,
                           "OFT rotates")


def block_size(name: str, module: nn.Module, config: OFTConfig) -> int:
    """The block size of target ``name``; raises, with the sizes that fit, if ``r`` / ``oft_block_size`` does not
    divide its rotated size (PEFT would pick another one, with a warning, and save the one asked for)."""
    size = rotated_size(module)
    given, asked = ("r", config.r) if config.r else ("oft_block_size", config.oft_block_size)
    if size % asked or asked > size:
        fits = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(f"{WHO}({given}={asked}): {name!r} ({type(module).__name__}) rotates {size} features, which "
                         f"{given}={asked} does not divide into blocks. Give {given} among {fits} (r * oft_block_size "
                         f"= {size}), or leave this module out of target_modules.")
    size_of_block = size // asked if config.r else asked
    if size_of_block < 2:
        raise ValueError(f"{WHO}({given}={asked}): {name!r} would get blocks of size 1, which cannot rotate anything. "
                         f"Give a smaller r (at most {size // 2}) or oft_block_size >= 2.")
    return size_of_block


def check_kind(name: str, module: nn.Module, config: OFTConfig, model: nn.Module) -> None:
    """Raise if ``module`` is no layer PEFT's OFT has a format for."""
    if not isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)):
        raise TypeError(f"{WHO}(target_modules={config.target_modules!r}): {name!r} is a {type(module).__name__}; "
                        f"OFT rotates {_KINDS} (Hugging Face PEFT's OFT layers; it has none for transformers Conv1D "
                        f"either). {type(model).__name__} has: {describe_modules(model)}.")
    if isinstance(module, nn.Conv2d):
        refuse_odd_conv(WHO, name, module)


def select(model: nn.Module, config: OFTConfig) -> tuple[dict[str, int], list[str]]:
    """({target: block size}, modules_to_save) by full name, as PEFT picks them; raises before anything changes."""
    chosen, to_save = choose_targets(WHO, model, config, describe_modules, "rotate", "model.layers.0.self_attn.q_proj")
    for name in chosen:
        check_kind(name, model.get_submodule(name), config, model)
    return {name: block_size(name, model.get_submodule(name), config) for name in chosen}, to_save


def _refuse_second_injection(model: nn.Module) -> None:
    existing = oft_layers(model)
    found = f"OFT layers (e.g. {next(iter(existing))!r})" if existing else None
    refuse_second_injection("inject_oft", model, found, "OFT")


def _inject(model: nn.Module, config: OFTConfig, targets: dict[str, int], to_save: list[str]) -> dict[str, OFTLayer]:
    """Wrap exactly ``targets`` (checked) and ``to_save``, and attach the adapter."""
    adapter = OFTAdapter(config, targets, to_save)
    for wrapper in wrap_modules_to_save(model, to_save).values():
        wrapper.routing = adapter.switch  # disabled, they run the original module
    layers = {}
    for name, size in targets.items():
        layers[name] = OFTLayer(model.get_submodule(name), size, config, adapter.switch)
        set_submodule(model, name, layers[name])
    attach(model, adapter)
    log.info("OFT: %d layers of %s; %s", len(layers), type(model).__name__, trainable_parameters(model))
    return layers


def unload_oft(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove OFT from ``model`` in place and return the plain model: with ``merge``, the rotations folded into the
    base weights and the trained ``modules_to_save`` copies kept; without, the base as it was. Other techniques stay.

    Raises:
        RuntimeError: If ``model`` has no OFT, or (``merge``) a merged weight would be quantized or not finite.
    """
    return remove_adapter(model, require(model, OFTAdapter.kind, "unload_oft", "OFT adapter", "inject_oft"), merge)


def merge_oft(model: nn.Module) -> list[str]:
    """Fold every rotation into its base weight in place (`unmerge_oft` undoes it); layers already merged are left
    alone. All or nothing.

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no OFT, a weight is tied to another module or quantized, or a merged weight is
            not finite (the layers merged by this call are unmerged again).
    """
    require(model, OFTAdapter.kind, "merge_oft", "OFT adapter", "inject_oft")
    return merge_layers(unwrap(model), oft_layers(model), "merge_oft")


def unmerge_oft(model: nn.Module) -> list[str]:
    """Take the merged rotations out of the base weights, in place (exact up to rounding).

    Raises:
        RuntimeError: If no OFT layer is merged.
    """
    require(model, OFTAdapter.kind, "unmerge_oft", "OFT adapter", "inject_oft")
    return unmerge_layers(unwrap(model), oft_layers(model), "unmerge_oft", "OFT", "merge_oft")


@contextlib.contextmanager
def disable_oft(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it every OFT layer computes its base layer's output, and every ``modules_to_save``
    wrapper its original module's (trained biases stay trained, as in PEFT).

    Raises:
        RuntimeError: If ``model`` has no OFT, or a layer is merged (the base output is then not available).
    """
    switch = require(model, OFTAdapter.kind, "disable_oft", "OFT adapter", "inject_oft").switch
    with switched_off(switch, oft_layers(model), "disable_oft", "rotations", "unmerge_oft"):
        yield


# --- the adapter protocol ------------------------------------------------------------------------------------


@register
class OFTAdapter(BlockAdapter):
    """OFT's side of the adapter protocol: what [`inject_oft`][lightning_peft.peft.inject_oft] did to a model
    (`lightning_peft.peft._block_adapter.BlockAdapter`: targets with their block sizes, trained biases,
    ``modules_to_save``)."""

    kind: ClassVar[str] = "oft"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = PEFT_FIELDS
    training_only: ClassVar[tuple[str, ...]] = ("init_weights", "module_dropout")
    config_type, who = OFTConfig, WHO
    compared = ("r", "oft_block_size", "coft", "eps", "block_share", "use_cayley_neumann", "num_cayley_neumann_terms",
                "bias")

    def own(self, layer: nn.Module, name: str) -> dict[str, Tensor]:
        return {f"{name}.{layer.key}.weight": layer.rotation.weight}

    @classmethod
    def place(cls, model: nn.Module, config: OFTConfig, targets: dict[str, int], to_save: list[str]) -> None:
        _refuse_second_injection(model)
        for name in targets:
            check_kind(name, model.get_submodule(name), config, model)
        _inject(model, config, targets, to_save)

    @classmethod
    def inject_config(cls, model: nn.Module, config: OFTConfig) -> None:
        inject_oft(model, config)

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        names = [n for n, _ in unwrap(model).named_modules() if n]
        config = self.config
        return {
            "peft_type": PEFT_TYPE,
            "peft_version": PEFT_VERSION,  # PEFT reads a Cayley-Neumann file without it as one of its old series
            "task_type": task_type(model),
            "base_model_name_or_path": base_model_name(model),
            "inference_mode": True,
            "target_modules": exact_choice([clean_key(n) for n in self.targets], [clean_key(n) for n in names]),
            "exclude_modules": None,
            "layers_to_transform": None,  # the targets are exact already
            "layers_pattern": None,
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
            "fan_in_fan_out": False,
            **{key: getattr(config, key) for key in ("r", "oft_block_size", "module_dropout", "bias", "coft", "eps",
                                                     "block_share", "use_cayley_neumann",
                                                     "num_cayley_neumann_terms", "init_weights")},
        }
