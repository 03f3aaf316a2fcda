"""Bottleneck adapters: a small residual MLP after chosen sub-layers of a frozen model.

Papers: Houlsby et al., "Parameter-Efficient Transfer Learning for NLP", arXiv:1902.00751 (an adapter after the
attention output and after the feed-forward output of every layer); Pfeiffer et al., "AdapterFusion:
Non-Destructive Task Composition for Transfer Learning", arXiv:2005.00247 (one adapter, after the feed-forward
output only).

Update rule. The output ``h`` of a wrapped module (the sub-layer's output projection, before the block's residual
add and LayerNorm) becomes:

```text
h <- h + dropout(W_up f(W_down h + b_down) + b_up)
```

with ``f`` the non-linearity. ``W_up`` and ``b_up`` start at zero, so an adapted model starts exactly equal to the
base; ``W_down`` starts from a normal distribution with standard deviation ``init_scale``, truncated at two
standard deviations (Houlsby's near-identity initialisation), ``b_down`` at zero. Only the adapters (and
``modules_to_save``) train; the base is frozen.

Shapes (``d`` = output size of the wrapped module, ``m`` = ``bottleneck_size``, else ``max(1, d //
reduction_factor)``):

| tensor | shape | state-dict key |
| --- | --- | --- |
| ``h`` | (..., d) | output of ``<name>.base_layer`` (the original module, unchanged) |
| ``W_down``, ``b_down`` | (m, d), (m) | ``<name>.adapter.down.weight``, ``<name>.adapter.down.bias`` |
| ``W_up``, ``b_up`` | (d, m), (d) | ``<name>.adapter.up.weight``, ``<name>.adapter.up.bias`` |

Placement. ``placement`` picks the sub-layer output projections by architecture (module names, so BERT-like
models such as RoBERTa or MiniLM, and Llama-like ones such as Mistral or Qwen2, are recognised too):

| family | ``"houlsby"`` | ``"pfeiffer"`` |
| --- | --- | --- |
| BERT | ``layer.N.attention.output.dense``, ``layer.N.output.dense`` | ``layer.N.output.dense`` |
| GPT-2 | ``h.N.attn.c_proj``, ``h.N.mlp.c_proj`` | ``h.N.mlp.c_proj`` |
| Llama | ``layers.N.self_attn.o_proj``, ``layers.N.mlp.down_proj`` | ``layers.N.mlp.down_proj`` |

Any other model takes ``target_modules`` (a list of exact names or dotted suffixes, or a regular expression that
must match the whole name: the rules of LoRA's ``target_modules``). A target must be a module with a known output
size (``nn.Linear``, ``transformers``' ``Conv1D``, or anything with an integer ``out_features``).

Each target is replaced by a [`BottleneckLayer`][lightning_peft.peft.BottleneckLayer] holding the original as
``base_layer`` and the [`Bottleneck`][lightning_peft.peft.Bottleneck] as ``adapter``. Its projections are not
``nn.Linear`` modules, so LoRA's ``"all-linear"`` never adapts an adapter. With LoRA on the same model, inject the
bottleneck adapters first: LoRA then adapts ``<name>.base_layer`` and the bottleneck adapter sees the LoRA-adapted
output; a bottleneck adapter around a module another technique already wraps is refused (it would move that technique's
parameters).

Merging: none. A non-linearity cannot be folded into the base weights (``mergeable = False``); ``merged_state_dict`` and
``unload(model, merge=True)`` raise, [`unload_bottleneck_adapters`][lightning_peft.peft.unload_bottleneck_adapters]
drops the adapters and gives the base model back.

File format. Hugging Face PEFT has no bottleneck-adapter type, so [`save_adapter`][lightning_peft.peft.save_adapter]
writes ours in PEFT's layout, and [`load_adapter`][lightning_peft.peft.load_adapter] reads it back (PEFT itself cannot
load it):

- ``adapter_model.safetensors``: ``base_model.model.<name>.adapter.down.weight`` (m, d), ``...down.bias`` (m),
  ``...up.weight`` (d, m), ``...up.bias`` (d) for every adapted module, and ``base_model.model.<name>.<param>`` for
  every ``modules_to_save`` module (its trained copy). ``<name>`` is the module path in the saved model;
- ``adapter_config.json``: ``peft_type`` = ``"LIGHTNING_PEFT_BOTTLENECK"``, ``format_version`` = 1,
  ``base_model_name_or_path`` (or null), ``placement`` (``"houlsby"``, ``"pfeiffer"``, or null when
  ``target_modules`` chose), ``target_modules`` (the exact full names adapted, a list), ``reduction_factor``,
  ``bottleneck_size`` (one of them is null), ``non_linearity``, ``dropout``, ``init_scale``, ``modules_to_save``
  (exact full names, a list). Loading refuses another ``format_version`` and any other field.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_peft.peft.bottleneck.model import inject_bottleneck_adapters
    >>> from lightning_peft.peft import trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> layers = inject_bottleneck_adapters(model, target_modules=["0"], reduction_factor=4)
    >>> sorted(layers), tuple(layers["0"].adapter.down.weight.shape)
    (['0'], (2, 8))
    >>> trainable_parameters(model).trainable  # W_down 2x8, b_down 2, W_up 8x2, b_up 8
    42
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar

from torch import Tensor, nn

from .._base_identity import base_model_name
from .._common import adapter_dtype, refuse_absent, refuse_second_injection, require
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
from ..modules_to_save import plain_key, restore_modules, saved_state, set_submodule, wrap_modules_to_save
from .config import (
    DEFAULT_INIT_SCALE,
    DEFAULT_REDUCTION_FACTOR,
    FILE_FIELDS,
    FORMAT_VERSION,
    PEFT_TYPE,
    BottleneckConfig,
    Placement,
    Targets,
    as_config,
    config_from_file,
)
from .layer import NON_LINEARITIES, Bottleneck, BottleneckLayer, Projection, output_size
from .select import check_targets, select

__all__ = ["DEFAULT_INIT_SCALE", "DEFAULT_REDUCTION_FACTOR", "FILE_FIELDS", "FORMAT_VERSION", "NON_LINEARITIES",
           "PEFT_TYPE", "Bottleneck", "BottleneckAdapter", "BottleneckConfig", "BottleneckLayer", "Placement",
           "Projection", "Targets", "as_config", "bottleneck_layers", "check_targets", "config_from_file",
           "inject_bottleneck_adapters", "output_size", "unload_bottleneck_adapters"]

log = logging.getLogger(__name__)
_WHO = "BottleneckAdapters"


def _make_layer(base: nn.Module, config: BottleneckConfig) -> BottleneckLayer:
    weight = next(base.parameters(), None)
    d = output_size(base)
    adapter = Bottleneck(d, config.size_for(d), config.non_linearity, config.dropout, config.init_scale,
                         device=None if weight is None else weight.device, dtype=adapter_dtype(weight))
    return BottleneckLayer(base, adapter).train(base.training)  # an eval model gets eval adapters


def bottleneck_layers(model: nn.Module) -> dict[str, BottleneckLayer]:
    """All bottleneck layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, BottleneckLayer)}


# --- injection -----------------------------------------------------------------------------------------------


def inject_bottleneck_adapters(
    model: nn.Module, config: BottleneckConfig | None = None, **kwargs: Any
) -> dict[str, BottleneckLayer]:
    """Put a bottleneck adapter after each target module of ``model``, in place, and freeze everything else.

    After the call only the parameters of the adapters attached to ``model`` (these and any other technique's)
    have ``requires_grad=True``. Nothing is changed if an error is raised.

    Args:
        model: The model to adapt (for a Hugging Face model, the ``PreTrainedModel``; a ``torch.compile``
            wrapper is looked through).
        config: A [`BottleneckConfig`][lightning_peft.peft.BottleneckConfig]; or give its fields as keyword arguments
            instead.

    Returns:
        The new [`BottleneckLayer`][lightning_peft.peft.BottleneckLayer] modules by full module name.

    Raises:
        RuntimeError: If ``model`` already has bottleneck adapters.
        ValueError: If the targets match nothing, the architecture is unknown to ``placement``, a target is
            already wrapped by another technique, or a setting is invalid.
        TypeError: If a target has no known output size, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_bottleneck_adapters")
    model = unwrap(model)
    _refuse_second_injection(model)
    targets, to_save = select(model, config)
    return _inject(model, config, targets, to_save)


def _refuse_second_injection(model: nn.Module) -> None:
    existing = bottleneck_layers(model)
    found = f"{len(existing)} bottleneck adapters (e.g. after {next(iter(existing))!r})" if existing else None
    refuse_second_injection("inject_bottleneck_adapters", model, found, "they were")


def _inject(model: nn.Module, config: BottleneckConfig, targets: list[str],
            to_save: list[str]) -> dict[str, BottleneckLayer]:
    """Wrap exactly ``targets`` and ``to_save`` (full names, already checked) and attach the adapter."""
    wrap_modules_to_save(model, to_save)
    layers = {}
    for name in targets:
        layers[name] = _make_layer(model.get_submodule(name), config)
        set_submodule(model, name, layers[name])
    attach(model, BottleneckAdapter(config, targets, to_save))
    log.info("Bottleneck adapters: after %d modules of %s; %s", len(layers), type(model).__name__,
             trainable_parameters(model))
    return layers


def _inject_exact(model: nn.Module, config: BottleneckConfig, targets: list[str], to_save: list[str],
                  where: str) -> BottleneckAdapter:
    """Inject at the recorded names (not the rules: the same modules whatever the rules would pick today)."""
    model = unwrap(model)
    _refuse_second_injection(model)
    refuse_absent(model, [*targets, *to_save], where)
    check_targets(model, targets, _WHO)
    _inject(model, config, targets, to_save)
    return attached(model)["bottleneck"]


def unload_bottleneck_adapters(model: nn.Module) -> nn.Module:
    """Remove the bottleneck adapters from ``model`` in place and return the base model as it was.

    Every [`BottleneckLayer`][lightning_peft.peft.BottleneckLayer] is replaced by its base module and every
    ``modules_to_save`` wrapper by the untouched original: the adapters are dropped (they cannot be merged). Other
    techniques' adapters stay.

    Raises:
        RuntimeError: If ``model`` has no bottleneck adapter.
    """
    adapter = require(model, BottleneckAdapter.kind, "unload_bottleneck_adapters", "bottleneck adapter",
                      "inject_bottleneck_adapters")
    return remove_adapter(model, adapter, merge=False)


# --- the adapter protocol ------------------------------------------------------------------------------------


@register
class BottleneckAdapter(Adapter):
    """Bottleneck adapters' side of the adapter protocol: what
    [`inject_bottleneck_adapters`][lightning_peft.peft.inject_bottleneck_adapters] did to a model.

    Args:
        config: The config used.
        targets: Full names of the modules the adapters follow.
        modules_to_save: Full names of the modules trained and saved in full.
    """

    kind: ClassVar[str] = "bottleneck"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = FILE_FIELDS  # our own format: exact, at this version
    format_version: ClassVar[int] = FORMAT_VERSION
    mergeable: ClassVar[bool] = False
    #: ``config_dict()["config"]`` keys that only steer training: a resume may change them.
    training_only: ClassVar[tuple[str, ...]] = ("dropout", "init_scale")

    def __init__(self, config: BottleneckConfig, targets: Iterable[str], modules_to_save: Iterable[str]) -> None:
        self.config = config
        self.targets = tuple(targets)
        self.modules_to_save = tuple(modules_to_save)

    def __repr__(self) -> str:
        return (f"BottleneckAdapter({self.config}, {len(self.targets)} targets, "
                f"modules_to_save={list(self.modules_to_save)})")

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        state: dict[str, Tensor] = {}
        for name in self.targets:
            state.update(model.get_submodule(name).adapter.state_dict(prefix=f"{name}.adapter.", keep_vars=True))
        return {**state, **saved_state(model, self.modules_to_save)}

    def config_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "targets": list(self.targets),
                "modules_to_save": list(self.modules_to_save)}

    def matches(self, config: dict[str, Any]) -> bool:
        """Whether these are the adapters ``config`` describes (a `config_dict`, or a callback's request
        ``{"config": BottleneckConfig.to_dict()}``, whose targets and modules_to_save are not resolved yet)."""
        if BottleneckConfig(**config["config"]) != self.config:
            return False
        return all(list(config[key]) == list(getattr(self, key)) for key in ("targets", "modules_to_save")
                   if key in config)

    def wrapped(self, model: nn.Module) -> dict[str, nn.Module]:
        model = unwrap(model)
        return {name: model.get_submodule(name) for name in self.targets}

    @classmethod
    def inject(cls, model: nn.Module, config: dict[str, Any]) -> BottleneckAdapter:
        return _inject_exact(model, BottleneckConfig(**config["config"]), list(config["targets"]),
                             list(config["modules_to_save"]), "BottleneckAdapters: the recorded adapter")

    def unload(self, model: nn.Module, merge: bool) -> None:
        if merge:
            raise RuntimeError(
                "BottleneckAdapter.unload(merge=True): a bottleneck adapter cannot be merged into the base weights "
                "(its non-linearity does not fold into a linear layer). unload_bottleneck_adapters(model) drops the "
                "adapters and gives the base model back; keep the adapted model to keep what it learned."
            )
        model = unwrap(model)
        for name in self.targets:
            set_submodule(model, name, model.get_submodule(name).base_layer)
        restore_modules(model, self.modules_to_save)
        detach(model, self.kind)

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        return {clean_key(plain_key(k)): v for k, v in self.state(model).items()}

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        config = self.config
        return {
            "peft_type": PEFT_TYPE,
            "format_version": FORMAT_VERSION,
            "base_model_name_or_path": base_model_name(model),
            "placement": config.placement,
            "target_modules": [clean_key(n) for n in self.targets],
            "reduction_factor": config.reduction_factor,
            "bottleneck_size": config.bottleneck_size,
            "non_linearity": config.non_linearity,
            "dropout": config.dropout,
            "init_scale": config.init_scale,
            "modules_to_save": [clean_key(n) for n in self.modules_to_save],
        }

    def check_peft_config(self, model: nn.Module, config: Any, source: str) -> None:
        ours, targets, to_save = config_from_file(config, source)
        now = (sorted(clean_key(n) for n in self.targets), self.config.non_linearity,
               sorted(clean_key(n) for n in self.modules_to_save))
        saved = (sorted(targets), ours.non_linearity, sorted(to_save))
        if now != saved:
            what = ("target_modules", "non_linearity", "modules_to_save")
            differing = [i for i in range(3) if now[i] != saved[i]]
            raise ValueError(
                f"load_adapter: {source} has " + ", ".join(f"{what[i]}={saved[i]!r}" for i in differing)
                + ", but the model's existing bottleneck adapter has "
                + ", ".join(f"{what[i]}={now[i]!r}" for i in differing)
                + ". Load it into a model without bottleneck adapters."
            )

    @classmethod
    def check_peft_shapes(cls, model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], files,
                          inject: bool) -> None:
        """Every target's ``W_down`` (m, d) and ``W_up`` (d, m) are in the file (``inject``), with the file's own
        ``bottleneck_size`` as m: checked before adapters of that size are allocated."""
        ours, targets, _ = config_from_file(config, str(files.config))
        missing = []
        for target in targets:
            for key, dim in ((f"{target}.adapter.down.weight", 0), (f"{target}.adapter.up.weight", 1)):
                shape = shapes.get(key)
                if shape is None:
                    missing.append(key)
                elif ours.bottleneck_size is not None and (len(shape) <= dim or shape[dim] != ours.bottleneck_size):
                    raise files.torn(key, shape, dim, "bottleneck_size", ours.bottleneck_size)
        if missing and inject:
            refuse_absent(unwrap(model), targets, f"load_adapter: {files.config}")  # the clearer cause first
            raise files.lacking(missing, "its adapter config asks for", type(unwrap(model)).__name__)

    @classmethod
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> BottleneckAdapter:
        ours, targets, to_save = config_from_file(config, source)
        return _inject_exact(model, ours, targets, to_save, f"load_adapter: {source}")
