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
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from torch import Tensor, nn

from .._base_identity import base_model_name
from .._common import exact_choice, refuse_absent, refuse_second_injection, require
from .._in_place import (
    Switch,
    choose_targets,
    describe_leaves,
    fold_layers,
    merge_layers,
    refuse_odd_conv,
    switched_off,
    unload_layers,
    unmerge_layers,
)
from ..adapter import (
    Adapter,
    attach,
    attached,
    clean_key,
    detach,
    register,
    remove_adapter,
    trainable_parameters,
    unwrap,
)
from ..modules_to_save import plain_key, present_modules, saved_state, set_submodule, wrap_modules_to_save
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
class BOFTAdapter(Adapter):
    """BOFT's side of the adapter protocol: what [`inject_boft`][lightning_peft.peft.inject_boft] did to a model."""

    kind: ClassVar[str] = "boft"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = PEFT_FIELDS
    mergeable: ClassVar[bool] = True
    training_only: ClassVar[tuple[str, ...]] = ("init_weights", "boft_dropout")

    def __init__(self, config: BOFTConfig, targets: dict[str, int], modules_to_save: Iterable[str]) -> None:
        self.config = config
        self.targets = tuple(targets)
        self.block_sizes = dict(targets)
        self.modules_to_save = tuple(modules_to_save)
        self.switch = Switch()

    def __repr__(self) -> str:
        return f"BOFTAdapter({len(self.targets)} targets, modules_to_save={list(self.modules_to_save)})"

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state: dict[str, Tensor] = {}
        for name in self.targets:
            layer = model.get_submodule(name)
            state.update({f"{name}.boft_R": layer.boft_R, f"{name}.boft_s": layer.boft_s})
            if self.config.bias == "boft_only" and layer.base_layer._parameters.get("bias") is not None:
                state[f"{name}.base_layer.bias"] = layer.base_layer.bias
        if self.config.bias == "all":
            for name, module in model.named_modules():
                if module._parameters.get("bias") is not None and ".original_module" not in f".{name}":
                    state[f"{name}.bias" if name else "bias"] = module._parameters["bias"]
        return {**state, **saved_state(model, self.modules_to_save)}

    def config_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "targets": self.block_sizes,
                "modules_to_save": list(self.modules_to_save)}

    def matches(self, config: dict[str, Any]) -> bool:
        if BOFTConfig(**config["config"]) != self.config:
            return False
        mine = {"targets": self.block_sizes, "modules_to_save": list(self.modules_to_save)}
        return all(dict(config[key]) == value if key == "targets" else list(config[key]) == value
                   for key, value in mine.items() if key in config)

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        model = unwrap(model)
        return {name: model.get_submodule(name) for name in self.targets}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> BOFTAdapter:
        model = unwrap(model)
        _refuse_second_injection(model)
        targets, to_save = dict(config["targets"]), list(config["modules_to_save"])
        refuse_absent(model, [*targets, *to_save], "BOFT: the recorded adapter")
        ours = BOFTConfig(**config["config"])
        for name in targets:
            _check_kind(name, model.get_submodule(name), ours, model)
        _inject(model, ours, targets, to_save)
        return attached(model)[cls.kind]

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        for name in self.targets:
            state.pop(f"{name}.boft_s")
        return fold_layers(unwrap(model), self.targets, lambda name: f"{name}.boft_R", state)

    def unload(self, model: nn.Module, merge: bool) -> None:
        unload_layers(unwrap(model), self.targets, self.modules_to_save, merge, "unload_boft")
        detach(model, self.kind)

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        return {clean_key(plain_key(k)): v for k, v in self.state(model).items()}

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        names = [n for n, _ in unwrap(model).named_modules() if n]
        return {
            "peft_type": PEFT_TYPE, "task_type": None, "base_model_name_or_path": base_model_name(model),
            "inference_mode": True,
            "target_modules": exact_choice([clean_key(n) for n in self.targets], [clean_key(n) for n in names]),
            "exclude_modules": None, "layers_to_transform": None, "layers_pattern": None, "fan_in_fan_out": False,
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
            **{key: getattr(self.config, key) for key in ("boft_block_size", "boft_block_num",
                                                          "boft_n_butterfly_factor", "boft_dropout", "bias",
                                                          "init_weights")},
        }

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        if any(layer.merged for layer in boft_layers(model).values()):
            raise RuntimeError("load_adapter: the BOFT rotations are merged; call unmerge_boft(model) before loading.")
        theirs = BOFTConfig.from_peft(config, source)
        fields = ("boft_block_size", "boft_block_num", "boft_n_butterfly_factor", "bias")
        differ = [f"{f}={getattr(theirs, f)!r} (the model's: {getattr(self.config, f)!r})" for f in fields
                  if getattr(theirs, f) != getattr(self.config, f)]
        if differ:
            raise ValueError(f"load_adapter: {source} has {', '.join(differ)}. Load it into a model without BOFT.")

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

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> BOFTAdapter:
        ours = BOFTConfig.from_peft(config, source)
        ours = dataclasses.replace(ours, modules_to_save=present_modules(unwrap(model), ours.modules_to_save, source))
        try:
            inject_boft(model, ours)
        except ValueError as err:
            raise ValueError(f"load_adapter: {source}: {err}") from None
        return attached(model)[cls.kind]
