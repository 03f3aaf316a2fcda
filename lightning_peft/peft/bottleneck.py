"""Bottleneck adapters: a small residual MLP after chosen sub-layers of a frozen model.

Papers: Houlsby et al., "Parameter-Efficient Transfer Learning for NLP", arXiv:1902.00751 (an adapter after the
attention output and after the feed-forward output of every layer); Pfeiffer et al., "AdapterFusion:
Non-Destructive Task Composition for Transfer Learning", arXiv:2005.00247 (one adapter, after the feed-forward
output only).

Update rule. The output ``h`` of a wrapped module (the sub-layer's output projection, before the block's residual
add and LayerNorm) becomes::

    h <- h + dropout(W_up f(W_down h + b_down) + b_up)

with ``f`` the non-linearity. ``W_up`` and ``b_up`` start at zero, so an adapted model starts exactly equal to the
base; ``W_down`` starts from a normal distribution with standard deviation ``init_scale``, truncated at two
standard deviations (Houlsby's near-identity initialisation), ``b_down`` at zero. Only the adapters (and
``modules_to_save``) train; the base is frozen.

Shapes (``d`` = output size of the wrapped module, ``m`` = ``bottleneck_size``, else ``max(1, d //
reduction_factor)``):

=====================  ==========  ===========================================================================
tensor                 shape       state-dict key
=====================  ==========  ===========================================================================
``h``                  (..., d)    output of ``<name>.base_layer`` (the original module, unchanged)
``W_down``, ``b_down`` (m, d), (m) ``<name>.adapter.down.weight``, ``<name>.adapter.down.bias``
``W_up``, ``b_up``     (d, m), (d) ``<name>.adapter.up.weight``, ``<name>.adapter.up.bias``
=====================  ==========  ===========================================================================

Placement. ``placement`` picks the sub-layer output projections by architecture (module names, so BERT-like
models such as RoBERTa or MiniLM, and Llama-like ones such as Mistral or Qwen2, are recognised too):

==========  =====================================  ==================================
family      ``"houlsby"``                          ``"pfeiffer"``
==========  =====================================  ==================================
BERT        ``layer.N.attention.output.dense``,    ``layer.N.output.dense``
            ``layer.N.output.dense``
GPT-2       ``h.N.attn.c_proj``, ``h.N.mlp.c_proj`` ``h.N.mlp.c_proj``
Llama       ``layers.N.self_attn.o_proj``,         ``layers.N.mlp.down_proj``
            ``layers.N.mlp.down_proj``
==========  =====================================  ==================================

Any other model takes ``target_modules`` (a list of exact names or dotted suffixes, or a regular expression that
must match the whole name: the rules of LoRA's ``target_modules``). A target must be a module with a known output
size (``nn.Linear``, ``transformers``' ``Conv1D``, or anything with an integer ``out_features``).

Each target is replaced by a :class:`BottleneckLayer` holding the original as ``base_layer`` and the
:class:`Bottleneck` as ``adapter``. Its projections are not ``nn.Linear`` modules, so LoRA's ``"all-linear"``
never adapts an adapter. With LoRA on the same model, inject the bottleneck adapters first: LoRA then adapts
``<name>.base_layer`` and the bottleneck adapter sees the LoRA-adapted output; a bottleneck adapter around a
module another technique already wraps is refused (it would move that technique's parameters).

Merging: none. A non-linearity cannot be folded into the base weights (``mergeable = False``);
``merged_state_dict`` and ``unload(model, merge=True)`` raise, :func:`unload_bottleneck_adapters` drops the
adapters and gives the base model back.

File format. Hugging Face PEFT has no bottleneck-adapter type, so :func:`~lightning_peft.peft.save_adapter` writes
ours in PEFT's layout, and :func:`~lightning_peft.peft.load_adapter` reads it back (PEFT itself cannot load it):

- ``adapter_model.safetensors``: ``base_model.model.<name>.adapter.down.weight`` (m, d), ``...down.bias`` (m),
  ``...up.weight`` (d, m), ``...up.bias`` (d) for every adapted module, and ``base_model.model.<name>.<param>`` for
  every ``modules_to_save`` module (its trained copy). ``<name>`` is the module path in the saved model;
- ``adapter_config.json``: ``peft_type`` = ``"LIGHTNING_PEFT_BOTTLENECK"``, ``format_version`` = 1,
  ``base_model_name_or_path`` (or null), ``placement`` (``"houlsby"``, ``"pfeiffer"``, or null when
  ``target_modules`` chose), ``target_modules`` (the exact full names adapted, a list), ``reduction_factor``,
  ``bottleneck_size`` (one of them is null), ``non_linearity``, ``dropout``, ``init_scale``, ``modules_to_save``
  (exact full names, a list). Loading refuses another ``format_version`` and any other field.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_peft.peft.bottleneck import inject_bottleneck_adapters
    >>> from lightning_peft.peft.lora import trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> layers = inject_bottleneck_adapters(model, target_modules=["0"], reduction_factor=4)
    >>> sorted(layers), tuple(layers["0"].adapter.down.weight.shape)
    (['0'], (2, 8))
    >>> trainable_parameters(model).trainable  # W_down 2x8, b_down 2, W_up 8x2, b_up 8
    42
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adapter import Adapter, attach, attached, base_model_name, clean_key, detach, register, remove_adapter, unwrap
from ._common import name_matches, refuse_unmatched, task_heads
from .adapter import trainable_parameters
from .modules_to_save import ModulesToSave, plain_key, set_submodule, wrap_modules_to_save

log = logging.getLogger(__name__)

Placement = Literal["houlsby", "pfeiffer"]
Targets = list[str] | str

PEFT_TYPE = "LIGHTNING_PEFT_BOTTLENECK"
FORMAT_VERSION = 1
DEFAULT_REDUCTION_FACTOR = 16
DEFAULT_INIT_SCALE = 1e-2

NON_LINEARITIES: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,  # another name for SiLU
    "tanh": torch.tanh,
}

# (attention output, feed-forward output) of every layer, by family; full-name regular expressions.
_FAMILIES: dict[str, tuple[str, str]] = {
    "BERT": (r"(?:.*\.)?layer\.\d+\.attention\.output\.dense", r"(?:.*\.)?layer\.\d+\.output\.dense"),
    "GPT-2": (r"(?:.*\.)?h\.\d+\.attn\.c_proj", r"(?:.*\.)?h\.\d+\.mlp\.c_proj"),
    "Llama": (r"(?:.*\.)?layers\.\d+\.self_attn\.o_proj", r"(?:.*\.)?layers\.\d+\.mlp\.down_proj"),
}
_FAMILY_NAMES = ("BERT's layer.N.attention.output.dense / layer.N.output.dense, GPT-2's h.N.attn.c_proj / "
                 "h.N.mlp.c_proj, Llama's layers.N.self_attn.o_proj / layers.N.mlp.down_proj")
_HALF = (torch.float16, torch.bfloat16)


# --- config --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BottleneckConfig:
    """Where the adapters go and what they are. Validated on construction.

    Args:
        placement: ``"houlsby"`` (after the attention output and the feed-forward output of every layer) or
            ``"pfeiffer"`` (after the feed-forward output only) on BERT-, GPT-2- and Llama-style models.
            None: ``"houlsby"``, unless ``target_modules`` is given (giving both is refused).
        target_modules: For any other model: module names or dotted suffixes (list), or a regular expression
            matched against the full name (string).
        reduction_factor: The bottleneck is ``max(1, d // reduction_factor)`` for a module of output size ``d``.
            None: 16, unless ``bottleneck_size`` is given (giving both is refused).
        bottleneck_size: The bottleneck size ``m`` of every adapter, instead of a reduction factor.
        non_linearity: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` (or ``"swish"``) or ``"tanh"``.
        dropout: Dropout probability on the adapter's output, before the residual add, in [0, 1).
        init_scale: Standard deviation of the (truncated) normal initialisation of ``W_down``; positive.
        modules_to_save: Modules trained and saved in full (e.g. a new classifier head), names or suffixes.
            None: a Hugging Face task model's head (``classifier`` / ``score`` / ``qa_outputs``, which
            ``from_pretrained`` creates at random), unless another adapter already saves it; ``[]``: none.
    """

    placement: Placement | None = None
    target_modules: Targets | None = None
    reduction_factor: float | None = None
    bottleneck_size: int | None = None
    non_linearity: str = "relu"
    dropout: float = 0.0
    init_scale: float = DEFAULT_INIT_SCALE
    modules_to_save: list[str] | None = None

    def __post_init__(self) -> None:
        normal = object.__setattr__  # frozen dataclass: normalised values; the caller's objects are not mutated
        normal(self, "placement", _as_placement(self.placement, self.target_modules))
        if self.target_modules is not None:
            normal(self, "target_modules", _as_targets(self.target_modules))
        normal(self, "reduction_factor", _as_reduction_factor(self.reduction_factor, self.bottleneck_size))
        if self.bottleneck_size is not None:
            normal(self, "bottleneck_size", _as_positive_int(self.bottleneck_size, "bottleneck_size"))
        if self.non_linearity not in NON_LINEARITIES:
            raise ValueError(
                f"BottleneckAdapters(non_linearity={self.non_linearity!r}): choose one of "
                f"{', '.join(repr(k) for k in NON_LINEARITIES)}."
            )
        normal(self, "dropout", _as_dropout(self.dropout))
        normal(self, "init_scale", _as_positive_real(self.init_scale, "init_scale", "e.g. 0.01"))
        if self.modules_to_save is not None:
            names = self.modules_to_save
            if isinstance(names, str) or not isinstance(names, Iterable) or not all(isinstance(m, str) for m in names):
                raise TypeError(
                    f"BottleneckAdapters(modules_to_save={names!r}): give a list of module names, e.g. ['classifier']."
                )
            normal(self, "modules_to_save", sorted(names) if isinstance(names, (set, frozenset)) else list(names))

    def size_for(self, d: int) -> int:
        """The bottleneck size of an adapter on a module of output size ``d``."""
        if self.bottleneck_size is not None:
            return self.bottleneck_size
        return max(1, int(d // self.reduction_factor))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``BottleneckConfig(**config.to_dict()) == config``)."""
        return dataclasses.asdict(self)


def _as_placement(placement: object, target_modules: object) -> Placement | None:
    if placement is not None and placement not in ("houlsby", "pfeiffer"):
        raise ValueError(f"BottleneckAdapters(placement={placement!r}): placement must be 'houlsby' or 'pfeiffer'.")
    if placement is not None and target_modules is not None:
        raise ValueError(
            f"BottleneckAdapters(placement={placement!r}, target_modules={target_modules!r}): give one of them; "
            "placement picks the modules on BERT-, GPT-2- and Llama-style models, target_modules on any model."
        )
    return "houlsby" if target_modules is None and placement is None else placement


def _as_targets(value: object) -> Targets:
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(
                f"BottleneckAdapters(target_modules={value!r}) is not a valid regular expression: {err}."
            ) from None
        return value
    if isinstance(value, (list, tuple, set, frozenset)) and value and all(isinstance(v, str) for v in value):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    raise TypeError(
        f"BottleneckAdapters(target_modules={value!r}): give a non-empty list of module names or dotted suffixes "
        "(e.g. ['attention.output.dense', 'mlp.c_proj']) or a regular expression string."
    )


def _as_reduction_factor(value: object, bottleneck_size: object) -> float | None:
    if value is not None and bottleneck_size is not None:
        raise ValueError(
            f"BottleneckAdapters(reduction_factor={value!r}, bottleneck_size={bottleneck_size!r}): give one of them; "
            "the bottleneck is either d // reduction_factor or bottleneck_size."
        )
    if value is None:
        return DEFAULT_REDUCTION_FACTOR if bottleneck_size is None else None
    return _as_positive_real(value, "reduction_factor", "e.g. 16")


def _as_positive_real(value: object, what: str, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"BottleneckAdapters({what}={value!r}): {what} must be a positive, finite number, {example}.")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"BottleneckAdapters({what}={value!r}): {what} must be a positive, finite number, {example}.")
    return value if isinstance(value, int) else float(value)


def _as_positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"BottleneckAdapters({what}={value!r}): {what} must be a positive integer, e.g. 24.")
    if value <= 0:
        raise ValueError(f"BottleneckAdapters({what}={value!r}): {what} must be a positive integer, e.g. 24.")
    return int(value)


def _as_dropout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"BottleneckAdapters(dropout={value!r}): dropout must be a number in [0, 1), e.g. 0.1.")
    if not 0 <= value < 1:
        raise ValueError(f"BottleneckAdapters(dropout={value!r}): dropout must be a probability in [0, 1).")
    return float(value)


def as_config(config: object, kwargs: dict[str, Any], who: str) -> BottleneckConfig:
    """A :class:`BottleneckConfig` from a config object or keyword arguments (not both)."""
    if config is None:
        fields = [f.name for f in dataclasses.fields(BottleneckConfig)]
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"{who}: unknown argument {unknown[0]!r}; bottleneck adapters take {', '.join(fields)}.")
        return BottleneckConfig(**kwargs)
    if kwargs:
        raise TypeError(f"{who}: pass either config or keyword arguments, not both (got {sorted(kwargs)}).")
    if not isinstance(config, BottleneckConfig):
        raise TypeError(f"{who}(config={type(config).__name__}): give a BottleneckConfig, or its fields as keyword "
                        "arguments.")
    return config


# --- layers --------------------------------------------------------------------------------------------------


class Projection(nn.Module):
    """``x @ weight.T + bias``: a linear map that is deliberately not an ``nn.Linear`` (LoRA leaves it alone)."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)  # (..., in) -> (..., out)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class Bottleneck(nn.Module):
    """The adapter MLP: ``dropout(W_up f(W_down h + b_down) + b_up)``, the update added to ``h``.

    Args:
        d: Input and output size.
        size: Bottleneck size ``m``.
        non_linearity: A key of :data:`NON_LINEARITIES`.
        dropout: Dropout probability on the output.
        init_scale: Standard deviation of the truncated-normal initialisation of ``W_down``.
    """

    def __init__(self, d: int, size: int, non_linearity: str, dropout: float, init_scale: float,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.non_linearity = non_linearity
        self.down = Projection(d, size, device=device, dtype=dtype)  # W_down (m, d)
        self.up = Projection(size, d, device=device, dtype=dtype)  # W_up (d, m), zero: the start equals the base
        self.dropout = nn.Dropout(dropout)
        nn.init.trunc_normal_(self.down.weight, std=init_scale, a=-2 * init_scale, b=2 * init_scale)

    def forward(self, h: Tensor) -> Tensor:
        x = h.to(self.down.weight.dtype)  # a half-precision base feeds its float32 adapter
        z = NON_LINEARITIES[self.non_linearity](self.down(x))  # (..., m)
        return self.dropout(self.up(z))  # (..., d)

    def extra_repr(self) -> str:
        return f"non_linearity={self.non_linearity!r}"


class BottleneckLayer(nn.Module):
    """A module (``base_layer``, unchanged) followed by a residual :class:`Bottleneck` (``adapter``).

    Attributes the wrapper lacks (``weight``, ``out_features``, ``nf``, ...) are read from the base layer.
    Precision: the adapter of a float16/bfloat16 base is float32 and stays float32 when the model is cast to half
    precision afterwards; the update is added in the dtype of the base output, so a zero update leaves the base
    output bit-for-bit unchanged.
    """

    def __init__(self, base_layer: nn.Module, adapter: Bottleneck) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.adapter = adapter

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base_layer", "adapter"):
                raise
            return getattr(self.base_layer, name)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        h = self.base_layer(*args, **kwargs)  # (..., d)
        return h + self.adapter(h).to(h.dtype)

    def _apply(self, fn, recurse: bool = True):
        # A cast to half precision (model.half(), Trainer(precision="bf16-true")) reaches the base only: the
        # adapter follows device moves but keeps its dtype, so small updates are not lost.
        probe = fn(torch.zeros((), dtype=torch.float32))
        if not (isinstance(probe, Tensor) and probe.dtype in _HALF) or not recurse:
            return super()._apply(fn, recurse)
        device = probe.device

        def move(t: Tensor) -> Tensor:
            return t.to(device=device)

        self.base_layer._apply(fn)
        self.adapter._apply(move)
        return super()._apply(move, recurse=False)


def output_size(module: nn.Module) -> int | None:
    """The output size ``d`` of a Linear-like module (``out_features``, or ``Conv1D``'s ``nf``), else None."""
    for attr in ("out_features", "nf"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _make_layer(base: nn.Module, config: BottleneckConfig) -> BottleneckLayer:
    weight = next(base.parameters(), None)
    device = weight.device if weight is not None else None
    dtype = None if weight is None else (torch.float32 if weight.dtype in _HALF else weight.dtype)
    d = output_size(base)
    adapter = Bottleneck(d, config.size_for(d), config.non_linearity, config.dropout, config.init_scale,
                         device=device, dtype=dtype)
    return BottleneckLayer(base, adapter).train(base.training)  # an eval model gets eval adapters


def bottleneck_layers(model: nn.Module) -> dict[str, BottleneckLayer]:
    """All bottleneck layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, BottleneckLayer)}


# --- selection -----------------------------------------------------------------------------------------------


def _describe_modules(model: nn.Module) -> str:
    """'query, key (x2), ...': leaf names of the modules an adapter can follow, for error messages."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if name and output_size(module) is not None and not isinstance(module, (ModulesToSave, BottleneckLayer)):
            leaf = name.rsplit(".", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + 1
    if not counts:
        return "none (it has no Linear, Conv1D or other module with an integer out_features)"
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items())


def _placement_targets(model: nn.Module, placement: Placement, names: list[str]) -> list[str]:
    found = {family: [[n for n in names if re.fullmatch(p, n)] for p in patterns]
             for family, patterns in _FAMILIES.items()}
    families = [f for f, (attention, feed_forward) in found.items() if attention and feed_forward]
    if not families:
        raise ValueError(
            f"BottleneckAdapters(placement={placement!r}): {type(model).__name__} is not a BERT-, GPT-2- or "
            f"Llama-style model (it lacks the sub-layer output projections: {_FAMILY_NAMES}), so placement cannot "
            "pick the modules. Name the output projections of its attention and feed-forward sub-layers with "
            f"target_modules instead. Modules it can take an adapter after: {_describe_modules(model)}."
        )
    if len(families) > 1:
        raise ValueError(
            f"BottleneckAdapters(placement={placement!r}): {type(model).__name__} has the sub-layer names of "
            f"several families ({', '.join(families)}), so the placement is ambiguous. Name the modules with "
            "target_modules instead."
        )
    attention, feed_forward = found[families[0]]
    chosen = set(feed_forward) | (set(attention) if placement == "houlsby" else set())
    return [n for n in names if n in chosen]


def _select(model: nn.Module, config: BottleneckConfig) -> tuple[list[str], list[str]]:
    """(targets, modules_to_save) full names; raises before anything is changed."""
    names = [n for n, _ in model.named_modules() if n]
    to_save = _select_modules_to_save(model, config, names)

    def saved(name: str) -> bool:
        return any(name == s or name.startswith(f"{s}.") for s in to_save)

    if config.target_modules is None:
        chosen = _placement_targets(model, config.placement, names)
    else:
        chosen = [n for n in names if name_matches(n, config.target_modules)]
        if chosen:
            refuse_unmatched("BottleneckAdapters", config.target_modules, names, model, _describe_modules)
    chosen = [n for n in chosen if not saved(n)]
    if not chosen:
        hint = ""
        if isinstance(config.target_modules, str):
            hint = (" A string is a regular expression that must match the full module name (e.g. "
                    "'bert.encoder.layer.0.output.dense'); to match by name or suffix, give a list: "
                    f"[{config.target_modules!r}].")
        raise ValueError(
            f"BottleneckAdapters(target_modules={config.target_modules!r}) matched no module of "
            f"{type(model).__name__}. Modules it can take an adapter after: {_describe_modules(model)}.{hint}"
        )
    check_targets(model, chosen, "BottleneckAdapters")
    return chosen, to_save


def check_targets(model: nn.Module, chosen: list[str], who: str) -> None:
    """Raise if a module in ``chosen`` cannot take a bottleneck adapter (unknown output size, already wrapped)."""
    for name in chosen:
        module = model.get_submodule(name)
        if isinstance(module, ModulesToSave) or isinstance(module._modules.get("base_layer"), nn.Module):
            owner = next((kind for kind, adapter in attached(model).items()
                          if any(t is p for t in adapter.state(model).values() for p in module.parameters())), None)
            wrapper = f"the {owner} adapter" if owner else "another technique"
            raise ValueError(
                f"{who}: {name!r} is already wrapped by {wrapper} "
                f"({type(module).__name__}); a bottleneck adapter around it would move that adapter's parameters. "
                "Inject the bottleneck adapters first (LoRA then adapts '<name>.base_layer'), or keep the other "
                "technique off this module."
            )
        if output_size(module) is None:
            raise TypeError(
                f"{who}: {name!r} is a {type(module).__name__}, whose output size is unknown; a bottleneck adapter "
                "follows a Linear, Conv1D or other module with an integer out_features (the output projection of a "
                f"sub-layer). {type(model).__name__} has: {_describe_modules(model)}."
            )


def _select_modules_to_save(model: nn.Module, config: BottleneckConfig, names: list[str]) -> list[str]:
    if config.modules_to_save is None:
        # A head another adapter (LoRA) already trains and saves stays with that adapter.
        heads = [h for h in task_heads(model) if not isinstance(model.get_submodule(h), ModulesToSave)]
        if heads:
            log.info("Bottleneck adapters: %s's task head %s is trained and saved in full (modules_to_save); "
                     "pass modules_to_save=[] to keep it frozen.", type(model).__name__, heads)
        return heads
    to_save = [n for n in names if name_matches(n, config.modules_to_save)]
    missing = [m for m in config.modules_to_save if not any(name_matches(n, [m]) for n in to_save)]
    if missing:
        raise ValueError(
            f"BottleneckAdapters(modules_to_save={config.modules_to_save!r}): {missing} matched no module of "
            f"{type(model).__name__}. Check the names with model.named_modules()."
        )
    to_save = [n for n in to_save if not any(n.startswith(f"{o}.") for o in to_save)]  # saved with the outer one
    taken = [n for n in to_save if isinstance(model.get_submodule(n), ModulesToSave)]
    if taken:
        raise ValueError(
            f"BottleneckAdapters(modules_to_save={config.modules_to_save!r}): {taken[0]!r} is already trained and "
            "saved in full by another adapter on this model; leave it out of modules_to_save here."
        )
    return to_save


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
        config: A :class:`BottleneckConfig`; or give its fields as keyword arguments instead.

    Returns:
        The new :class:`BottleneckLayer` modules by full module name.

    Raises:
        RuntimeError: If ``model`` already has bottleneck adapters.
        ValueError: If the targets match nothing, the architecture is unknown to ``placement``, a target is
            already wrapped by another technique, or a setting is invalid.
        TypeError: If a target has no known output size, or an argument has the wrong type.
    """
    config = as_config(config, kwargs, "inject_bottleneck_adapters")
    model = unwrap(model)
    _refuse_second_injection(model)
    targets, to_save = _select(model, config)
    return _inject(model, config, targets, to_save)


def _refuse_second_injection(model: nn.Module) -> None:
    existing = bottleneck_layers(model)
    if existing:
        raise RuntimeError(
            f"inject_bottleneck_adapters: {type(model).__name__} already has {len(existing)} bottleneck adapters "
            f"(e.g. after {next(iter(existing))!r}); they were injected twice. Use the model as it is, or build a "
            "fresh one."
        )


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
    names = {n for n, _ in model.named_modules()}
    absent = [n for n in [*targets, *to_save] if n not in names]
    if absent:
        raise ValueError(
            f"{where} names module {absent[0]!r}, which {type(model).__name__} does not have; it was written for "
            "another model."
        )
    check_targets(model, targets, "BottleneckAdapters")
    _inject(model, config, targets, to_save)
    return attached(model)["bottleneck"]


def unload_bottleneck_adapters(model: nn.Module) -> nn.Module:
    """Remove the bottleneck adapters from ``model`` in place and return the base model as it was.

    Every :class:`BottleneckLayer` is replaced by its base module and every ``modules_to_save`` wrapper by the
    untouched original: the adapters are dropped (they cannot be merged). Other techniques' adapters stay.

    Raises:
        RuntimeError: If ``model`` has no bottleneck adapter.
    """
    adapter = attached(model).get("bottleneck")
    if adapter is None:
        raise RuntimeError(
            f"unload_bottleneck_adapters: {type(unwrap(model)).__name__} has no bottleneck adapter; call "
            "inject_bottleneck_adapters(model, ...) first."
        )
    return remove_adapter(model, adapter, merge=False)


# --- the adapter protocol ------------------------------------------------------------------------------------


@register
class BottleneckAdapter(Adapter):
    """Bottleneck adapters' side of the adapter protocol: what :func:`inject_bottleneck_adapters` did to a model.

    Args:
        config: The config used.
        targets: Full names of the modules the adapters follow.
        modules_to_save: Full names of the modules trained and saved in full.
    """

    kind: ClassVar[str] = "bottleneck"
    peft_type: ClassVar[str] = PEFT_TYPE
    mergeable: ClassVar[bool] = False

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
        for name in self.modules_to_save:
            trained = model.get_submodule(name).trained_module
            state.update(trained.state_dict(prefix=f"{name}.trained_module.", keep_vars=True))
        return state

    def config_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "targets": list(self.targets),
                "modules_to_save": list(self.modules_to_save)}

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
        for name in self.modules_to_save:
            set_submodule(model, name, model.get_submodule(name).original_module)
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
    def from_peft(cls, model: nn.Module, config: dict[str, Any], source: str) -> BottleneckAdapter:
        ours, targets, to_save = config_from_file(config, source)
        return _inject_exact(model, ours, targets, to_save, f"load_adapter: {source}")


_FILE_FIELDS = ("peft_type", "format_version", "base_model_name_or_path", "placement", "target_modules",
                "reduction_factor", "bottleneck_size", "non_linearity", "dropout", "init_scale", "modules_to_save")


def config_from_file(config: object, source: str) -> tuple[BottleneckConfig, list[str], list[str]]:
    """(config, exact target names, exact modules_to_save names) from our ``adapter_config.json`` content."""
    if not isinstance(config, dict):
        raise ValueError(f"load_adapter: {source} holds a JSON {type(config).__name__}, not an object; it is not an "
                         "adapter config.")
    if config.get("peft_type") != PEFT_TYPE:
        raise ValueError(f"load_adapter: {source} has peft_type={config.get('peft_type')!r}, not {PEFT_TYPE!r}.")
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"load_adapter: {source} has format_version={config.get('format_version')!r}; this version of "
            f"lightning-peft reads bottleneck adapters of format_version {FORMAT_VERSION}. Upgrade lightning-peft."
        )
    unknown = sorted(set(config) - set(_FILE_FIELDS))
    if unknown:
        raise ValueError(
            f"load_adapter: {source} has field {unknown[0]!r}, which a bottleneck adapter config does not have; "
            "loading it would ignore what it means. Fields: " + ", ".join(_FILE_FIELDS) + "."
        )
    for key in ("target_modules", "modules_to_save"):
        names = config.get(key)
        listed = isinstance(names, list) and all(isinstance(n, str) for n in names)
        if not listed or (key == "target_modules" and not names):
            raise ValueError(f"load_adapter: {source} has {key}={names!r}; it must be a list of full module names.")
    if config.get("reduction_factor") is None and config.get("bottleneck_size") is None:
        raise ValueError(f"load_adapter: {source} has neither reduction_factor nor bottleneck_size; it is not a "
                         "complete bottleneck adapter config.")
    targets, to_save = list(config["target_modules"]), list(config["modules_to_save"])
    placement = config.get("placement")
    try:
        ours = BottleneckConfig(
            placement=placement,
            target_modules=None if placement else targets,
            reduction_factor=config.get("reduction_factor"),
            bottleneck_size=config.get("bottleneck_size"),
            non_linearity=config.get("non_linearity"),
            dropout=config.get("dropout", 0.0),
            init_scale=config.get("init_scale", DEFAULT_INIT_SCALE),
            modules_to_save=to_save,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"load_adapter: {source}: {err}") from None
    return ours, targets, to_save
