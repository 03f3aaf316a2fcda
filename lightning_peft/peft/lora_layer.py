"""The LoRA layer base class: a frozen base module plus trainable low-rank updates, one per named adapter.

The update rule, shapes and precision rules are in `lightning_peft.peft.layers` (with the concrete layers);
the per-sample routed path is in `lightning_peft.peft.lora_routing`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import LayerWrapper, adapter_dtype, dense_weight, is_quantized
from ._lora_state import remerge_after_load, unmerge_before_load, unmerged_state
from .lora_routing import DEFAULT, RoutedPath, Routing

Init = Literal["kaiming", "gaussian"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Merges are computed in at least float32 and cast back.
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter's settings on one layer; ``scaling`` is computed once (the forward reads it every call).
    ``use_dora``: the adapter is DoRA's (`lightning_peft.peft.lora_dora`), with a trained magnitude."""

    rank: int
    alpha: float
    use_rslora: bool
    use_dora: bool = False
    scaling: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "scaling", self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank
        )


class LoRALayer(RoutedPath, LayerWrapper):
    """Base class: a frozen ``base_layer`` plus low-rank updates of its weight, one per named adapter.

    As every `LayerWrapper`, it reads missing attributes (``in_features``, ``padding_idx``, ``kernel_size``) from the
    base layer, and a half-precision cast reaches the base layer only. Subclasses define the adapter parameters
    (`_create`), [`delta_weight`][lightning_peft.peft.LoRALayer.delta_weight] and the update paths.

    Args:
        base_layer: The module to adapt. It is kept, not copied.
        rank: ``r``, the rank of the first adapter's update.
        alpha: Scale numerator: the update is multiplied by ``alpha / rank`` (or ``alpha / sqrt(rank)``).
        dropout: Dropout probability on the adapter's input.
        use_rslora: Use the rank-stabilised scale ``alpha / sqrt(rank)``.
        init: Initialisation of ``A`` (``"kaiming"`` or ``"gaussian"``); ``B`` starts at zero.
        adapter_name: The first adapter's name.
        use_dora: Make it a DoRA adapter (`lightning_peft.peft.lora_dora`); only where ``supports_dora``.
    """

    #: How tensor parallelism splits the layer's own tensors with its base (it reads its factors with ``F.linear``,
    #: so the layer is placed as one unit): ``{style: container}``, the factor container whose weights split as the
    #: base's weight does under that style; the rest is replicated. Empty: the layer cannot be split.
    tensor_parallel_split: ClassVar[dict[str, str]] = {}
    #: Whether the layer implements DoRA adapters (``use_dora=True``).
    supports_dora: ClassVar[bool] = False

    def __init__(
        self,
        base_layer: nn.Module,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        init: Init = "kaiming",
        adapter_name: str = DEFAULT,
        use_dora: bool = False,
    ) -> None:
        super().__init__(base_layer)
        self.specs: dict[str, AdapterSpec] = {}
        self.lora_dropout = nn.ModuleDict()
        self.routing = Routing(adapter_name)
        self.merged_adapter: str | None = None
        self._remerge_after_load: str | None = None
        self._factor_cache: dict[str, tuple[tuple[dict, str], tuple[dict, str]]] = {}
        self._init_containers()
        self.add_adapter(adapter_name, rank, alpha, dropout, use_rslora, init, use_dora)
        self.register_state_dict_post_hook(unmerged_state)
        self.register_load_state_dict_pre_hook(unmerge_before_load)
        self.register_load_state_dict_post_hook(remerge_after_load)

    def _apply(self, fn, recurse: bool = True):
        self._forget_cached_tensors()  # then LayerWrapper's: a half-precision cast reaches the base layer only
        return super()._apply(fn, recurse)

    def _forget_cached_tensors(self) -> None:
        # After a move, a cast or a load (assign=True replaces the Parameter objects) the references would be stale.
        self._factor_cache = {}

    @property
    def weight(self) -> Tensor:
        """The base layer's weight: code that reads ``module.weight`` (dtype checks, T5) keeps working."""
        return self.base_layer.weight

    @property
    def bias(self) -> Tensor | None:
        return getattr(self.base_layer, "bias", None)

    # --- adapters ----------------------------------------------------------------------------------------------

    @property
    def adapter_names(self) -> list[str]:
        return list(self.specs)

    def _spec(self, name: str | None = None) -> AdapterSpec:
        """The named adapter's spec; without a name, the active one (or the only one)."""
        if name is None:
            name = self.routing.active if self.routing.active in self.specs else next(iter(self.specs))
        return self.specs[name]

    # The active adapter's settings (read-only), as a single-adapter layer has them.
    rank = property(lambda self: self._spec().rank, doc="The active adapter's rank ``r``.")
    alpha = property(lambda self: self._spec().alpha, doc="The active adapter's scale numerator.")
    use_rslora = property(lambda self: self._spec().use_rslora, doc="Whether its scale is ``alpha / sqrt(r)``.")
    scaling = property(lambda self: self._spec().scaling, doc="The active adapter's scale ``s``.")

    @property
    def reads_base_weight(self) -> bool:
        return any(spec.use_dora for spec in self.specs.values())  # DoRA's magnitude over ||W + s B A||

    @property
    def merged(self) -> bool:
        return self.merged_adapter is not None

    def add_adapter(
        self, name: str, rank: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
        init: Init = "kaiming", use_dora: bool = False,
    ) -> None:
        """Add adapter ``name`` (zero update) to this layer."""
        if name in self.specs:
            raise ValueError(f"{type(self).__name__}: adapter {name!r} already exists on this layer.")
        if use_dora and not self.supports_dora:
            raise TypeError(f"{type(self).__name__}(use_dora=True): DoRA is not implemented for a "
                            f"{type(self.base_layer).__name__} base layer; DoRA supports Linear and Conv1D layers.")
        self.specs[name] = AdapterSpec(rank, alpha, use_rslora, use_dora)
        self.lora_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        weight = self.base_layer.weight
        self._create(name, rank, device=weight.device, dtype=adapter_dtype(weight))
        self.reset_parameters(init, name)
        # New submodules start in training mode; those of an eval layer must not (dropout would stay on).
        for module in (self.lora_dropout[name], *(c[name] for c in self._containers())):
            if isinstance(module, nn.Module):
                module.train(self.training)

    def delete_adapter(self, name: str) -> None:
        """Remove adapter ``name``; its parameters are gone from the module."""
        if self.merged_adapter == name:
            raise RuntimeError(f"{type(self).__name__}: adapter {name!r} is merged; unmerge it before deleting it.")
        del self.specs[name]
        del self.lora_dropout[name]
        self._factor_cache.pop(name, None)
        for container in self._containers():
            del container[name]

    def _init_containers(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _init_containers()")

    def _containers(self) -> list[nn.ModuleDict | nn.ParameterDict]:
        raise NotImplementedError(f"{type(self).__name__} must define _containers()")

    def _create(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _create()")

    def adapter_parameters(self, name: str | None = None) -> dict[str, nn.Parameter]:
        """The trainable adapter parameters by their name relative to this layer (one adapter, or all)."""
        names = self.adapter_names if name is None else [name]
        return {k: p for n in names for k, p in self._parameters_of(n).items()}

    def factors(self, name: str) -> tuple[nn.Parameter, nn.Parameter]:
        """``(A, B)`` of adapter ``name``, read every forward.

        The ``_parameters`` dicts that hold them are found once; the parameters themselves are read from those dicts
        each time, so a parameter replaced in place (``register_parameter``, as FSDP2 and DTensor parallelism do) is
        the one used.
        """
        refs = self._factor_cache.get(name)
        if refs is None:
            refs = self._factor_cache[name] = self._factor_refs(name)
        (holder_a, key_a), (holder_b, key_b) = refs
        return holder_a[key_a], holder_b[key_b]

    def _factor_refs(self, name: str) -> tuple[tuple[dict, str], tuple[dict, str]]:
        raise NotImplementedError(f"{type(self).__name__} must define _factor_refs()")

    def _parameters_of(self, name: str) -> dict[str, nn.Parameter]:
        raise NotImplementedError(f"{type(self).__name__} must define _parameters_of()")

    def delta_weight(self, name: str | None = None) -> Tensor:
        """``s * B @ A`` of one adapter (default: the merged one, else the active one) in the base weight's
        layout and at least float32 precision."""
        name = name or self.merged_adapter or self._active_name()
        return self._delta(name)

    def _active_name(self) -> str:
        return self.routing.active if self.routing.active in self.specs else next(iter(self.specs))

    def _delta(self, name: str) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define _delta()")

    def reset_parameters(self, init: Init = "kaiming", name: str | None = None) -> None:
        """Initialise an adapter (default: every adapter) so that its update is zero."""
        for n in self.adapter_names if name is None else [name]:
            self._reset(n, init)

    def _reset(self, name: str, init: Init) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _reset()")

    # --- merging -----------------------------------------------------------------------------------------------

    def merged_weight(self, name: str | None = None) -> Tensor:
        """``W + delta`` of one adapter computed in float32 (or wider), cast to the base dtype; raises if
        non-finite. On a merged layer: the weight as it is (the merged adapter's)."""
        weight = self.base_layer.weight
        if self.merged:
            if name is not None and name != self.merged_adapter:
                raise RuntimeError(
                    f"{type(self).__name__}: adapter {self.merged_adapter!r} is merged, not {name!r}; "
                    "unmerge_lora(model) first."
                )
            return weight.detach().clone()
        with torch.no_grad():  # a quantized base is dequantized (to the dtype it had) first
            dense = dense_weight(weight, self.base_layer)
            merged = self._with_update(dense.to(_compute_dtype(dense.dtype)), name or self._active_name())
        if not torch.isfinite(merged).all():
            raise RuntimeError(
                f"{type(self).__name__}: merging would write inf or NaN into the base weight "
                f"(shape {tuple(weight.shape)}); the adapter or base weight holds non-finite or overflowing "
                "values. Nothing was merged into this layer."
            )
        return merged.to(dense.dtype)

    def _with_update(self, weight: Tensor, name: str) -> Tensor:
        """The merged weight of adapter ``name`` from the dense base ``weight`` (compute dtype): ``W + delta``."""
        return weight + self.delta_weight(name)

    def _without_update(self, weight: Tensor, name: str) -> Tensor:
        """The base weight back from ``weight``, which holds adapter ``name`` merged: ``W' - delta``."""
        return weight - self.delta_weight(name)

    @torch.no_grad()
    def merge(self, name: str | None = None, dequantize: bool = False) -> None:
        """Add one adapter's update (default: the active one) into the base weight. Merging the merged adapter
        again changes nothing; merging a second one is refused.

        A quantized base weight is never requantized: merging into it is refused unless ``dequantize``, which
        replaces it by the merged weight in full precision (the dtype it had before quantization)."""
        name = name or self._active_name()
        if self.merged_adapter == name:
            return
        if self.merged:
            raise RuntimeError(
                f"{type(self).__name__}: adapter {self.merged_adapter!r} is merged; unmerge it before merging {name!r}."
            )
        if is_quantized(self.base_layer.weight):
            if not dequantize:
                raise RuntimeError(
                    f"{type(self).__name__}: the base weight is quantized ({type(self.base_layer.weight).__name__}); "
                    "merging in place would requantize it and lose most of the update. Use unload_lora(model, "
                    "merge=True) for a plain full-precision model, or merged_state_dict(model) for an export."
                )
            self._dequantize_base(self.merged_weight(name))
        else:
            self.base_layer.weight.copy_(self.merged_weight(name))
        self.merged_adapter = name
        self.routing.merged[name] = self.routing.merged.get(name, 0) + 1

    def _dequantize_base(self, weight: Tensor) -> None:
        """Put ``weight`` (full precision) in place of the quantized base weight; a base layer of another class
        (bitsandbytes' ``Linear4bit`` / ``Linear8bitLt``, whose forward needs its own weights) becomes a plain
        ``nn.Linear`` with the same bias."""
        base = self.base_layer
        if type(base) is nn.Linear:
            base.weight = nn.Parameter(weight, requires_grad=False)
            return
        plain = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None, device=weight.device,
                          dtype=weight.dtype)
        plain.weight = nn.Parameter(weight, requires_grad=False)
        if base.bias is not None:
            plain.bias = nn.Parameter(base.bias.detach().to(weight.dtype), requires_grad=base.bias.requires_grad)
        self.base_layer = plain.train(base.training)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the merged update from the base weight (exact up to one rounding in the compute dtype).

        Raises:
            RuntimeError: If the layer is not merged.
        """
        if not self.merged:
            raise RuntimeError(f"{type(self).__name__}.unmerge(): the layer is not merged; call merge() first.")
        weight = self.base_layer.weight
        restored = self._without_update(dense_weight(weight).to(_compute_dtype(weight.dtype)), self.merged_adapter)
        weight.copy_(restored.to(weight.dtype))
        self.routing.merged[self.merged_adapter] -= 1
        self.merged_adapter = None

    # --- forward -----------------------------------------------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)
        routing = self.routing
        if self.merged_adapter is not None:
            self._check_trainable_forward()
            return result
        if routing.disabled:
            return result
        if routing.names is not None:
            if x.shape[0] != len(routing.names):
                raise ValueError(
                    f"route_adapters: a batch of {x.shape[0]} samples reached {type(self).__name__} "
                    f"({self.base_layer}), but {len(routing.names)} adapter names were given; give one name per "
                    f"sample (the batch dimension must come first).{_repeated(x.shape[0], len(routing.names))}"
                )
            # Only the adapters the batch uses are stacked (the others must get no gradient), every forward.
            selected = routing.select(self.adapter_names, x.device)
            return result if selected is None else self._routed(x, result, *selected)
        name = routing.active
        if name not in self.specs:
            return result
        return self._single(x, result, name)

    def _single(self, x: Tensor, result: Tensor, name: str) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define _single()")

    def _may_overwrite(self, result: Tensor) -> bool:
        """Whether the base output can take the update in place: without autograd, and when no hook on the base
        layer may have kept a reference to it (a copy of the output then costs as much as the update itself)."""
        return not torch.is_grad_enabled() and not self.base_layer._forward_hooks and result.is_contiguous()
    def _check_trainable_forward(self) -> None:
        # A merged layer's output does not depend on the adapter, so training it ends in autograd's cryptic
        # "element 0 of tensors does not require grad"; say why first. A warning, not an error: a merged model
        # run for inference in train mode with autograd on is legitimate.
        if self.training and torch.is_grad_enabled() and any(
            p.requires_grad for p in self.adapter_parameters(self.merged_adapter).values()
        ):
            warnings.warn(
                f"{type(self).__name__}: the layer is merged, so its adapter gets no gradient from this forward. "
                "To train, call unmerge_lora(model) first; for inference, use model.eval() or torch.no_grad().",
                UserWarning, stacklevel=3,
            )

    def _add_update(self, result: Tensor, hidden: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
        """``result + scaling * hidden @ lora_b.T``; one fused GEMM when dtypes agree and autocast is off.

        ``hidden`` is (..., r), ``lora_b`` is (out, r), ``result`` is (..., out). Under autocast the fused
        GEMM would round the base output to the autocast dtype, so the update is added separately.
        """
        fuse = hidden.dtype == result.dtype == lora_b.dtype and not torch.is_autocast_enabled(result.device.type)
        if fuse:
            result2 = result.reshape(-1, result.shape[-1])  # (N, out)
            hidden2 = hidden.reshape(-1, hidden.shape[-1])  # (N, r)
            if self._may_overwrite(result):
                return result2.addmm_(hidden2, lora_b.t(), alpha=scaling).view(result.shape)
            return torch.addmm(result2, hidden2, lora_b.t(), alpha=scaling).view(result.shape)
        update = F.linear(hidden.to(lora_b.dtype), lora_b) * scaling
        return result + update.to(result.dtype)

    def extra_repr(self) -> str:
        adapters = ", ".join(
            f"{n}: rank={s.rank}, alpha={s.alpha}, scaling={s.scaling:.4g}{', dora' if s.use_dora else ''}"
            for n, s in self.specs.items()
        )
        return f"{adapters}, merged={self.merged_adapter!r}" if self.merged else f"{adapters}, merged=False"


def _repeated(samples: int, names: int) -> str:
    """The hint for a batch a whole number of times larger than the names: ``generate`` repeating samples."""
    if samples <= names or samples % names:
        return ""
    k = samples // names
    return (f" A batch {k} times larger is what generate(num_beams={k}) or num_return_sequences={k} makes: call "
            "generate on the Hugging Face model the adapters were injected into (it repeats the names as it repeats "
            f"the samples), or give each name {k} times in a row.")
