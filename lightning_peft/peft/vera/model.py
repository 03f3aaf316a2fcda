"""VeRA on a whole model: inject, merge, disable, unload, and VeRA's side of the adapter protocol (with Hugging Face
PEFT's file format).

Paper: Kopiczko, Blankevoort and Asano, "VeRA: Vector-based Random Matrix Adaptation", arXiv:2310.11454. One pair of
frozen random matrices is shared by every adapted layer; each layer trains two vectors only:

```text
h = W x + b + Λ_b B Λ_d A x          Λ_b = diag(lambda_b) (out), Λ_d = diag(lambda_d) (r)
```

``A`` (r, in_max) and ``B`` (out_max, r) are drawn once from ``projection_prng_key`` (Kaiming uniform, as PEFT draws
them) at the largest input and output sizes among the targets; a layer uses ``A[:, :in]`` and ``B[:out]``. They are
the buffers of one `Projections` module, registered in the first adapted layer (``<first target>.vera_projections``;
on the model itself it would be called by an ``nn.Sequential``) and held by the others, so training checkpoints
(adapter-only too) hold them once and every rank, drawing from the same key, has the same ones. ``lambda_b`` starts at zero (the adapted
model equals the base), ``lambda_d`` at ``d_initial``. Merged, ``W + Λ_b B Λ_d A`` (transposed for ``Conv1D``).

Equal to Hugging Face PEFT 0.21.2's VeRA (``peft_type: "VERA"``): the same targets for a config, the same projections
for a key, the same outputs, merged weights and files (``base_model.model.<module>.vera_lambda_b`` / ``_d``, and, with
``save_projection``, ``base_model.vera_A`` / ``vera_B``; without, the loader draws them again from the key).
Differences: on a half-precision model the projections and vectors stay float32 (PEFT rounds the projections to the
base's dtype); ``target_modules="all-linear"`` and several named adapters are refused.

Examples:
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_vera, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> sorted(inject_vera(model, target_modules=["0", "2"], rank=4))
    ['0', '2']
    >>> trainable_parameters(model).trainable  # lambda_b (16 + 2) and lambda_d (4 + 4)
    26
    >>> shared = model[0].vera_projections  # held by model[2] too
    >>> tuple(shared.vera_A.shape), tuple(shared.vera_B.shape)  # (r, in_max), (out_max, r)
    ((4, 16), (16, 4))
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import Tensor, nn

from .. import _wrapping as wrapping
from .._common import (
    adapter_dtype,
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
    plain_key,
    saved_state,
    set_submodule,
    wrap_modules_to_save,
)
from .config import PEFT_FIELDS, PEFT_TYPE, WHO, VeraConfig, as_config
from .layer import Projections, VeraLayer, draw_projections, sizes, supported

log = logging.getLogger("lightning_peft.peft.vera")
PROJECTIONS = "vera_projections"  # the submodule of the first VeRA layer that holds the shared matrices
TARGETING = wrapping.Targeting(WHO, "VeRA", "adapt", "nn.Linear and transformers Conv1D", supported,
                               "bert.encoder.layer.0.attention.self.query")


def vera_layers(model: nn.Module) -> dict[str, VeraLayer]:
    """All VeRA layers of ``model`` by full module name."""
    return wrapping.layers_of(model, VeraLayer)


def inject_vera(model: nn.Module, config: VeraConfig | None = None, **kwargs: Any) -> dict[str, VeraLayer]:
    """Wrap the ``target_modules`` of ``model`` in `VeraLayer`s sharing one pair of random projections (registered in
    the first as ``vera_projections``), in place, and freeze everything but the vectors (and the chosen biases and
    ``modules_to_save``).

    Args:
        model: Any ``nn.Module`` (a Hugging Face model, the ``PreTrainedModel`` itself).
        config: A [`VeraConfig`][lightning_peft.peft.VeraConfig]; or its fields as keyword arguments.

    Returns:
        The new layers by module name.

    Raises:
        RuntimeError: If ``model`` already has VeRA.
        ValueError: If a name matches nothing, a target is wrapped by another technique, or a setting is invalid.
        TypeError: If a target is a layer VeRA cannot adapt, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_vera")
    model = unwrap(model)
    wrapping.refuse_second(model, VeraLayer, "inject_vera", "VeRA")
    targets, to_save = select(model, config)
    return _inject(model, config, targets, to_save)


def select(model: nn.Module, config: VeraConfig) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names, as PEFT picks them; raises before anything is changed."""
    return TARGETING.select(model, config)


def shared_projections(model: nn.Module, config: VeraConfig, targets: list[str]) -> Projections:
    """The projections for ``targets``: drawn from the key at the largest sizes, on the first target's device, in its
    adapter dtype (float32, or float64 for a float64 model)."""
    shapes = [sizes(model.get_submodule(name)) for name in targets]
    first = model.get_submodule(targets[0]).weight
    vera_a, vera_b = draw_projections(config.rank, max(s[0] for s in shapes), max(s[1] for s in shapes),
                                      config.projection_prng_key)
    kind = {"device": first.device, "dtype": adapter_dtype(first)}
    return Projections(vera_a.to(**kind), vera_b.to(**kind))


def _inject(model: nn.Module, config: VeraConfig, targets: list[str], to_save: list[str]) -> dict[str, VeraLayer]:
    """Wrap exactly ``targets`` (checked) and ``to_save``, register the projections, and attach the adapter."""
    adapter = VeraAdapter(config, targets, to_save)
    projections = shared_projections(model, config, targets)
    for wrapper in wrap_modules_to_save(model, to_save).values():
        wrapper.routing = adapter.switch  # disabled, they run the original module
    layers = {}
    for name in targets:
        layers[name] = VeraLayer(model.get_submodule(name), projections, config.dropout, config.d_initial,
                                 config.init_weights, adapter.switch)
        set_submodule(model, name, layers[name])
    setattr(layers[targets[0]], PROJECTIONS, projections)  # registered once: one copy in state dicts and moves
    attach(model, adapter)
    log.info("VeRA: %d layers of %s, rank %d; %s", len(layers), type(model).__name__, config.rank,
             trainable_parameters(model))
    return layers


def unload_vera(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove VeRA from ``model`` in place and return the plain model: with ``merge``, the updates added to the base
    weights and the trained ``modules_to_save`` copies kept; without, the base as it was. Other techniques stay.

    Raises:
        RuntimeError: If ``model`` has no VeRA, or (``merge``) a merged weight would be quantized or not finite.
    """
    return remove_adapter(model, require(model, VeraAdapter.kind, "unload_vera", "VeRA adapter", "inject_vera"),
                          merge)


def merge_vera(model: nn.Module) -> list[str]:
    """Add every layer's update to its base weight in place (`unmerge_vera` subtracts it again); layers already
    merged are left alone. All or nothing.

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no VeRA, a weight is tied to another module or quantized, or a merged weight
            is not finite (the layers merged by this call are unmerged again).
    """
    require(model, VeraAdapter.kind, "merge_vera", "VeRA adapter", "inject_vera")
    return wrapping.merge_layers(model, vera_layers(model), "merge_vera")


def unmerge_vera(model: nn.Module) -> list[str]:
    """Subtract the merged updates from the base weights, in place.

    Raises:
        RuntimeError: If no VeRA layer is merged.
    """
    require(model, VeraAdapter.kind, "unmerge_vera", "VeRA adapter", "inject_vera")
    return wrapping.unmerge_layers(model, vera_layers(model), "unmerge_vera", "VeRA", "merge_vera")


@contextlib.contextmanager
def disable_vera(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it every VeRA layer computes its base layer's output, and every ``modules_to_save``
    wrapper its original module's (trained biases stay trained, as in PEFT).

    Raises:
        RuntimeError: If ``model`` has no VeRA, or a layer is merged (the base output is then not available).
    """
    switch = require(model, VeraAdapter.kind, "disable_vera", "VeRA adapter", "inject_vera").switch
    with wrapping.disabled(switch, vera_layers(model).values(), "disable_vera", "unmerge_vera"):
        yield


# --- the adapter protocol ------------------------------------------------------------------------------------


@register
class VeraAdapter(wrapping.TargetsAdapter):
    """VeRA's side of the adapter protocol: what [`inject_vera`][lightning_peft.peft.inject_vera] did to a model.

    PEFT's files put the projections beside the model (``base_model.vera_A``), so this technique's PEFT keys start
    one level higher than LoRA's (``peft_key_prefix = "base_model."``; the layers' keys start with ``model.``).

    Args:
        config: The config used.
        targets: Full names of the adapted modules.
        modules_to_save: Full names of the modules trained and saved in full.
    """

    kind: ClassVar[str] = "vera"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = PEFT_FIELDS
    peft_key_prefix: ClassVar[str] = "base_model."
    mergeable: ClassVar[bool] = True
    training_only: ClassVar[tuple[str, ...]] = ("init_weights", "d_initial", "save_projection")

    def __repr__(self) -> str:
        return f"VeraAdapter({len(self.targets)} targets, rank {self.config.rank}, " \
               f"modules_to_save={list(self.modules_to_save)})"

    def biases(self, model: nn.Module) -> dict[str, Tensor]:
        """The biases that train (``bias="vera_only"``: the adapted layers'; ``"all"``: every module's)."""
        if self.config.bias == "vera_only":
            layers = {name: model.get_submodule(name).base_layer for name in self.targets}
            return {f"{n}.base_layer.bias": m.bias for n, m in layers.items() if m.bias is not None}
        if self.config.bias == "all":
            return {f"{n}.bias" if n else "bias": m._parameters["bias"] for n, m in model.named_modules()
                    if m._parameters.get("bias") is not None and ".original_module" not in f".{n}"}
        return {}

    def projections(self, model: nn.Module) -> tuple[str, Projections]:
        """(its state-dict key prefix, the shared `Projections`), registered in the first target."""
        return f"{self.targets[0]}.{PROJECTIONS}.", getattr(unwrap(model).get_submodule(self.targets[0]), PROJECTIONS)

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        prefix, projections = self.projections(model)
        state = {f"{prefix}{k}": v for k, v in projections.named_buffers()}
        for name in self.targets:
            layer = model.get_submodule(name)
            state.update({f"{name}.vera_lambda_b": layer.vera_lambda_b, f"{name}.vera_lambda_d": layer.vera_lambda_d})
        return {**state, **self.biases(model), **saved_state(model, self.modules_to_save)}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> VeraAdapter:
        """Inject at the recorded names (the same modules, hence the same projection sizes, whatever the rules would
        pick today)."""
        model = unwrap(model)
        wrapping.refuse_second(model, VeraLayer, "inject_vera", "VeRA")
        targets, to_save = list(config["targets"]), list(config["modules_to_save"])
        refuse_absent(model, [*targets, *to_save], "VeRA: the recorded adapter")
        _inject(model, VeraConfig(**config["config"]), targets, to_save)
        return attached(model)[cls.kind]

    def merged_state(self, model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        prefix = self.projections(model)[0]
        own = [k for k in state if k.startswith(prefix)]
        own += [f"{name}.vera_lambda_{v}" for name in self.targets for v in "bd"]
        return wrapping.merged_state(model, state, self.targets, own)

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        prefix, projections = self.projections(model)
        state = {f"model.{clean_key(plain_key(k))}": v for k, v in self.state(model).items()
                 if not k.startswith(prefix)}
        if self.config.save_projection:
            state.update({"vera_A": projections.vera_A, "vera_B": projections.vera_B})
        return state

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        config = self.config
        return {
            **wrapping.peft_common(model, PEFT_TYPE, self.targets, self.modules_to_save),
            "r": config.rank,
            "projection_prng_key": config.projection_prng_key,
            "save_projection": config.save_projection,
            "vera_dropout": config.dropout,
            "d_initial": config.d_initial,
            "fan_in_fan_out": any(layer.fan_in_fan_out for layer in self.wrapped(model).values()),
            "bias": config.bias,
            "init_weights": config.init_weights,
            "layers_to_transform": None,  # the targets are written out exactly
            "layers_pattern": None,
        }

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        """The file must fit this adapter: the same rank, and the same projections (the same key, or its own)."""
        wrapping.refuse_merged_load(vera_layers(model).values(), "VeRA updates", "unmerge_vera")
        theirs = VeraConfig.from_peft(config, source)
        ours = self.config
        for field in ("rank", "save_projection", "projection_prng_key"):
            if getattr(theirs, field) != getattr(ours, field):
                raise ValueError(f"load_adapter: {source} has {field}={getattr(theirs, field)!r}, but the model's VeRA "
                                 f"adapter has {field}={getattr(ours, field)!r}. Load it into a model without VeRA.")

    @classmethod
    def check_peft_shapes(cls, model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                          files: Any, inject: bool) -> None:
        """Every ``vera_lambda_d`` and ``vera_A`` must have the config's ``r`` rows (a file asking for a huge ``r``
        is refused before the projections are drawn); projections in a file whose config says they were not saved
        are refused (PEFT would ignore them and draw others)."""
        rank = config.get("r")
        for key, shape in shapes.items():
            if (key == "vera_A" or key.endswith(".vera_lambda_d")) and (len(shape) < 1 or shape[0] != rank):
                raise files.torn(key, shape, 0, "r", rank)
        if not config.get("save_projection", True) and {"vera_A", "vera_B"} & set(shapes):
            raise ValueError(f"load_adapter: {files.weights} holds the projections (vera_A, vera_B), but its config "
                             f"{files.config} says save_projection=false, so Hugging Face PEFT ignores them and "
                             "draws others from projection_prng_key. Nothing was loaded; set save_projection to true "
                             "in the config to use the file's, or remove them from the file.")

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> VeraAdapter:
        wrapping.inject_from_peft(model, VeraConfig.from_peft(config, source), source,
                                  lambda ours: inject_vera(model, ours))
        return attached(model)[cls.kind]
