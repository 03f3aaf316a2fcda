"""BOFT on a whole model: inject, merge, disable, unload, and BOFT's side of the adapter protocol (with Hugging Face
PEFT's file format).

Paper: Liu et al., "Parameter-Efficient Orthogonal Finetuning via Butterfly Factorization", arXiv:2311.06243. OFT's
block-diagonal rotation (`lightning_peft.peft.oft`) is dense only inside blocks; BOFT multiplies ``m`` of them, each
between butterfly permutations (the Cooley-Tukey pattern), so that ``m = log2(blocks) + 1`` factors of small blocks
make a dense rotation, and scales each output by a learned ``s`` (starting at 1, with ``A = 0``: the base model).
The formula and the shapes: `lightning_peft.peft.boft.layer`.

Equal to Hugging Face PEFT 0.21.2's BOFT (``peft_type: "BOFT"``) *as its CUDA extension computes it*: PEFT builds the
block-diagonal matrix of every factor with a CUDA kernel (``fbd_cuda``); without it (on every CPU-only machine) it
silently uses one factor (``boft_n_butterfly_factor=1``) while its ``adapter_config.json`` keeps the number asked
for. Ours computes the factors asked for, everywhere; a PEFT file whose tensors hold one factor where its config says
more is refused at loading, with the fix. Sizes that PEFT refuses are refused, with the sizes that fit.

Examples:
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_boft, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> sorted(inject_boft(model, target_modules=["2"], boft_block_size=4, boft_n_butterfly_factor=2))
    ['2']
    >>> trainable_parameters(model).trainable  # boft_R (2, 4, 4, 4) and boft_s (2, 1)
    130
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import Tensor, nn

from .._base_identity import base_model_name, task_type
from .._block_adapter import BlockAdapter
from .._common import exact_choice, refuse_second_injection, require
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
from ..modules_to_save import set_submodule, wrap_modules_to_save
from ..oft.layer import rotated_size
from .config import PEFT_FIELDS, PEFT_TYPE, WHO, BOFTConfig, as_config
from .layer import BOFTLayer

log = logging.getLogger("lightning_peft.peft.boft")
_KINDS = "nn.Linear, nn.Conv2d"


def boft_layers(model: nn.Module) -> dict[str, BOFTLayer]:
    """All BOFT layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, BOFTLayer)}


def inject_boft(model: nn.Module, config: BOFTConfig | None = None, **kwargs: Any) -> dict[str, BOFTLayer]:
    """Wrap the ``target_modules`` of ``model`` in `BOFTLayer`s, in place, and freeze everything but the rotations
    and scales (and ``modules_to_save``, and the biases ``bias`` names).

    Args:
        model: Any ``nn.Module``.
        config: A [`BOFTConfig`][lightning_peft.peft.BOFTConfig]; or its fields as keyword arguments.

    Returns:
        The new layers by module name.

    Raises:
        RuntimeError: If ``model`` already has BOFT.
        ValueError: If a name matches nothing, a target's size does not fit the blocks and factors, or a
            convolution is of a kind PEFT's BOFT has no format for.
        TypeError: If a target is a layer BOFT cannot rotate, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_boft")
    model = unwrap(model)
    _refuse_second_injection(model)
    chosen, to_save = choose_targets(WHO, model, config, describe_modules, "rotate", "model.layers.0.mlp.up_proj")
    for name in chosen:
        _check_kind(name, model.get_submodule(name), config, model)
    return _inject(model, config, {n: block_size(n, model.get_submodule(n), config) for n in chosen}, to_save)


def describe_modules(model: nn.Module) -> str:
    """'query, value (x2 each), ...': leaf names of the modules BOFT can rotate, for messages."""
    return describe_leaves(model, lambda m: isinstance(m, (nn.Linear, nn.Conv2d)), _KINDS, "BOFT rotates")


def _check_kind(name: str, module: nn.Module, config: BOFTConfig, model: nn.Module) -> None:
    if not isinstance(module, (nn.Linear, nn.Conv2d)):
        raise TypeError(f"{WHO}(target_modules={config.target_modules!r}): {name!r} is a {type(module).__name__}; "
                        f"BOFT rotates {_KINDS} (Hugging Face PEFT's BOFT layers). {type(model).__name__} has: "
                        f"{describe_modules(model)}.")
    if isinstance(module, nn.Conv2d):
        refuse_odd_conv(WHO, name, module)


def block_size(name: str, module: nn.Module, config: BOFTConfig) -> int:
    """The block size of target ``name``, after PEFT's checks of sizes, blocks and factors (each refusal names the
    values that fit)."""
    size, factors = rotated_size(module), config.boft_n_butterfly_factor
    given, asked = (("boft_block_size", config.boft_block_size) if config.boft_block_size
                    else ("boft_block_num", config.boft_block_num))
    span = 2 ** (factors - 1)  # the last factor's runs hold span blocks
    fits = [d for d in range(1, size + 1) if size % d == 0 and (factors == 1 or (
        d % 2 == 0 and (size // d) % 2 == 0 and (size // d) % span == 0))]
    if size % asked or (factors > 1 and (asked % 2 or (size // asked) % 2 or (size // asked) % span)):
        raise ValueError(
            f"{WHO}({given}={asked}, boft_n_butterfly_factor={factors}): {name!r} ({type(module).__name__}) rotates "
            f"{size} features, which do not split into {'blocks of' if config.boft_block_size else ''} {asked}"
            f"{'' if config.boft_block_size else ' blocks'} for {factors} butterfly factor(s) (the size must divide "
            f"into blocks; with more than one factor, block size and count even, the count a multiple of "
            f"2**(factors - 1)). {given} that fit: {fits if given == 'boft_block_size' else [size // d for d in fits]}"
            "; or fewer factors, or leave the module out of target_modules.")
    return asked if config.boft_block_size else size // asked


def _refuse_second_injection(model: nn.Module) -> None:
    existing = boft_layers(model)
    found = f"BOFT layers (e.g. {next(iter(existing))!r})" if existing else None
    refuse_second_injection("inject_boft", model, found, "BOFT")


def _inject(model: nn.Module, config: BOFTConfig, targets: dict[str, int], to_save: list[str]) -> dict[str, BOFTLayer]:
    adapter = BOFTAdapter(config, targets, to_save)
    for wrapper in wrap_modules_to_save(model, to_save).values():
        wrapper.routing = adapter.switch
    layers = {}
    for name, size in targets.items():
        layers[name] = BOFTLayer(model.get_submodule(name), size, config, adapter.switch)
        set_submodule(model, name, layers[name])
    attach(model, adapter)
    log.info("BOFT: %d layers of %s; %s", len(layers), type(model).__name__, trainable_parameters(model))
    return layers


def unload_boft(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove BOFT from ``model`` in place and return the plain model (``merge``: folded in; else as it was).

    Raises:
        RuntimeError: If ``model`` has no BOFT, or (``merge``) a merged weight would be quantized or not finite.
    """
    return remove_adapter(model, require(model, BOFTAdapter.kind, "unload_boft", "BOFT adapter", "inject_boft"),
                          merge)


def merge_boft(model: nn.Module) -> list[str]:
    """Fold every rotation and scale into its base weight in place, all or nothing (`unmerge_boft` undoes it).

    Raises:
        RuntimeError: If ``model`` has no BOFT, a weight is tied, quantized, a scale zero, or a merge not finite.
    """
    require(model, BOFTAdapter.kind, "merge_boft", "BOFT adapter", "inject_boft")
    return merge_layers(unwrap(model), boft_layers(model), "merge_boft")


def unmerge_boft(model: nn.Module) -> list[str]:
    """Take the merged rotations and scales out of the base weights, in place.

    Raises:
        RuntimeError: If no BOFT layer is merged.
    """
    require(model, BOFTAdapter.kind, "unmerge_boft", "BOFT adapter", "inject_boft")
    return unmerge_layers(unwrap(model), boft_layers(model), "unmerge_boft", "BOFT", "merge_boft")


@contextlib.contextmanager
def disable_boft(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it every BOFT layer computes its base layer's output.

    Raises:
        RuntimeError: If ``model`` has no BOFT, or a layer is merged.
    """
    switch = require(model, BOFTAdapter.kind, "disable_boft", "BOFT adapter", "inject_boft").switch
    with switched_off(switch, boft_layers(model), "disable_boft", "rotations", "unmerge_boft"):
        yield


@register
class BOFTAdapter(BlockAdapter):
    """BOFT's side of the adapter protocol: what [`inject_boft`][lightning_peft.peft.inject_boft] did to a model
    (`lightning_peft.peft._block_adapter.BlockAdapter`)."""

    kind: ClassVar[str] = "boft"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = PEFT_FIELDS
    training_only: ClassVar[tuple[str, ...]] = ("init_weights", "boft_dropout")
    config_type, who = BOFTConfig, WHO
    compared = ("boft_block_size", "boft_block_num", "boft_n_butterfly_factor", "bias")

    def own(self, layer: nn.Module, name: str) -> dict[str, Tensor]:
        return {f"{name}.boft_R": layer.boft_R, f"{name}.boft_s": layer.boft_s}

    @classmethod
    def place(cls, model: nn.Module, config: BOFTConfig, targets: dict[str, int], to_save: list[str]) -> None:
        _refuse_second_injection(model)
        for name in targets:
            _check_kind(name, model.get_submodule(name), config, model)
        _inject(model, config, targets, to_save)

    @classmethod
    def inject_config(cls, model: nn.Module, config: BOFTConfig) -> None:
        inject_boft(model, config)

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        names = [n for n, _ in unwrap(model).named_modules() if n]
        return {
            "peft_type": PEFT_TYPE, "task_type": task_type(model), "base_model_name_or_path": base_model_name(model),
            "inference_mode": True,
            "target_modules": exact_choice([clean_key(n) for n in self.targets], [clean_key(n) for n in names]),
            "exclude_modules": None, "layers_to_transform": None, "layers_pattern": None, "fan_in_fan_out": False,
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
            **{key: getattr(self.config, key) for key in ("boft_block_size", "boft_block_num",
                                                          "boft_n_butterfly_factor", "boft_dropout", "bias",
                                                          "init_weights")},
        }

    @classmethod
    def check_peft_shapes(cls, model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], files,
                          inject: bool) -> None:
        """A file whose ``boft_R`` holds fewer factors than its config says was written by PEFT without its CUDA
        extension, which trains one factor whatever the config asks: refused, with the fix."""
        factors = config.get("boft_n_butterfly_factor", 1)
        short = [k for k, shape in shapes.items() if k.endswith(".boft_R") and shape[0] != factors]
        if short:
            raise ValueError(
                f"load_adapter: {files.config} says boft_n_butterfly_factor={factors}, but {short[0]} holds "
                f"{shapes[short[0]][0]} factor(s): PEFT without its CUDA extension (fbd_cuda) trains a single "
                "factor whatever the config asks, and writes the number asked for. Set boft_n_butterfly_factor to "
                f"{shapes[short[0]][0]} in that adapter_config.json to load what was trained.")
