"""LoRA layers: a frozen base module plus trainable low-rank updates, one per named adapter.

This module is the whole hot path: the base class [`LoRALayer`][lightning_peft.peft.LoRALayer] (adapters, merge,
the forward, the state-dict hooks) and the concrete layers (``LoRALinear``, ``LoRAEmbedding``); the convolution layer
is in `lightning_peft.peft.lora.conv`, the attention layer in `lightning_peft.peft.lora.mha`, the per-sample routed
path in `lightning_peft.peft.lora.routing`; an adapter with a variant (DoRA) runs its variant object
(`lightning_peft.peft.lora.variants`) instead of plain LoRA.

Paper: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.
rsLoRA scaling: Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", arXiv:2312.03732.
Mixed-adapter batches: Chen et al., "Punica: Multi-Tenant LoRA Serving", arXiv:2310.18547 (the gathered batched
matmul); Sheng et al., "S-LoRA: Serving Thousands of Concurrent LoRA Adapters", arXiv:2311.03285.

Update rule. A frozen weight ``W`` (out, in) is adapted by adapter ``n`` as:

```text
W' = W + s_n * B_n @ A_n        A_n: (r_n, in), B_n: (out, r_n), s_n = alpha_n / r_n   (alpha_n / sqrt(r_n), rsLoRA)
y  = W x + s_n * B_n (A_n dropout_n(x))
```

Only the ``A`` and ``B`` train. ``B`` starts at zero, so a new adapter starts equal to the base model.

Shapes (parameters are named and laid out as Hugging Face PEFT names them in memory, ``lora_A.<adapter>.weight``;
adapter files drop the adapter name, as PEFT's do):

| base layer | base weight | parameters of adapter ``n`` |
| --- | --- | --- |
| ``nn.Linear(in, out)`` | (out, in) | ``lora_A.n.weight`` (r, in), ``lora_B.n.weight`` (out, r) |
| ``Conv1D`` (transformers) | (in, out), transposed | same as Linear; the delta is transposed to merge |
| DoRA (``use_dora=True``) | as above | and ``lora_magnitude_vector.n`` (`lora.variants`) |
| ``nn.Embedding(V, d)`` | (V, d) | ``lora_embedding_A.n`` (r, V), ``lora_embedding_B.n`` (d, r) |
| ``nn.Conv1d/2d/3d(in, out, k)`` | (out, in / g, *k) | ``lora_A.n``: Conv(in, r, k), ``lora_B.n``: Conv(r, out, 1, groups=g) |
| ``lora_bias=True`` (not Embedding) | | and ``lora_B.n.bias`` (out,): ``y += s_n * b_n``, merged into the base bias |

Which adapter runs is decided by one [`Routing`][lightning_peft.peft.Routing] object shared by every LoRA layer of a
model (one adapter for all samples, none, or one per sample: see `lightning_peft.peft.lora.routing`).

Each layer wraps its base module (``self.base_layer``); nothing is copied, and attributes the layer does not define
(``in_features``, ``padding_idx``, ``kernel_size``, ...) are read from the base. Merging is explicit
([`LoRALayer.merge`][lightning_peft.peft.LoRALayer.merge] /
[`LoRALayer.unmerge`][lightning_peft.peft.LoRALayer.unmerge], one adapter at a time), never a side effect of
``train()``/``eval()``; a state dict is always taken unmerged (so a merged model's state dict loads anywhere), and
loading into a merged layer re-merges the loaded adapter.

Precision. Adapters of a float16/bfloat16 base are float32, and stay float32 when the module is cast to half
precision afterwards (``model.half()``, ``Trainer(precision="bf16-true")``): only the base changes dtype. Under
``torch.autocast`` the update is computed in the autocast dtype and added to the base output in the base
output's own dtype, so a zero update leaves the base output bit-for-bit unchanged. Merging is computed in
float32; ``unmerge(merge(W))`` restores ``W`` up to one rounding of the weight's dtype (exact only when the
sum is representable, i.e. not in general for bfloat16).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._common import LayerWrapper, adapter_dtype, compute_dtype, dense_weight, is_quantized, require
from .._limits import scale
from ..adapter import attached, unwrap
from . import init as starts
from . import variants
from .routing import DEFAULT, RoutedPath, Routing

__all__ = ["DEFAULT", "LAYER_TYPES", "AdapterSpec", "Init", "LoRAEmbedding", "LoRALayer", "LoRALinear", "Routing",
           "linear_types", "lora_layers", "lora_spec", "make_layer", "require_spec"]

Init = str  # "kaiming", "gaussian", or a start that reads the base weight (lora.init: "pissa", "olora", ...)


# --- state-dict hooks (LoRALayer registers them): a merged layer saves its unmerged base weight, and loads into the
# unmerged layout before merging again (also reading the single-adapter layout of lightning-peft before named adapters)

def unmerged_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: a merged layer reports its unmerged base weight, so no state holds ``W + delta``."""
    if module.merged:
        with torch.no_grad():
            for key, restored in module._restored().items():
                if f"{prefix}{key}" in state_dict:
                    state_dict[f"{prefix}{key}"] = restored


_LEGACY_KEYS = ("lora_A.weight", "lora_B.weight", "lora_embedding_A", "lora_embedding_B")


def unmerge_before_load(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    # Load-state-dict pre-hook. A state dict of the single-adapter layout (lightning-peft before named adapters:
    # ``lora_A.weight``) loads into the first adapter. Then: load into the unmerged layout, and merge the loaded
    # adapter again afterwards.
    first = next(iter(module.specs))
    for key in _LEGACY_KEYS:
        if f"{prefix}{key}" in state_dict:
            container, _, rest = key.partition(".")
            state_dict[f"{prefix}{container}.{first}" + (f".{rest}" if rest else "")] = state_dict.pop(f"{prefix}{key}")
    if module.merged:
        module._remerge_after_load = module.merged_adapter
        module.unmerge()


def remerge_after_load(module: nn.Module, incompatible_keys) -> None:
    module._forget_cached_tensors()
    if module._remerge_after_load is not None:
        name, module._remerge_after_load = module._remerge_after_load, None
        module.merge(name)


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter's settings on one layer; ``scaling`` is computed once (the forward reads it every call).
    ``variant``: what the adapter runs instead of plain LoRA (`lightning_peft.peft.lora.variants`: DoRA), or None;
    ``lora_bias``: ``B`` has a trained bias (PEFT's ``lora_bias``)."""

    rank: int
    alpha: float
    use_rslora: bool
    variant: variants.LoRAVariant | None = None
    lora_bias: bool = False
    scaling: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scaling", scale(self.alpha, self.rank, self.use_rslora))


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
        use_dora: Make it a DoRA adapter: its variant is the layer's ``dora_variant``.
        lora_bias: Give ``B`` a trained bias (PEFT's ``lora_bias``); not on embeddings, not with DoRA.
    """

    #: How tensor parallelism splits the layer's own tensors with its base (it reads its factors with ``F.linear``,
    #: so the layer is placed as one unit): ``{style: container}``, the factor container whose weights split as the
    #: base's weight does under that style; the rest is replicated. Empty: the layer cannot be split.
    tensor_parallel_split: ClassVar[dict[str, str]] = {}
    #: The DoRA variant of this layer kind (`lightning_peft.peft.lora.variants`), for ``use_dora=True``; None: none.
    dora_variant: ClassVar[type[variants.DoRA] | None] = None

    def __init__(
        self,
        base_layer: nn.Module,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        *,
        use_rslora: bool = False,
        init: Init = "kaiming",
        adapter_name: str = DEFAULT,
        use_dora: bool = False,
        lora_bias: bool = False,
    ) -> None:
        super().__init__(base_layer)
        self.specs: dict[str, AdapterSpec] = {}
        self.lora_dropout = nn.ModuleDict()
        self.routing = Routing(adapter_name)
        self.merged_adapter: str | None = None
        self._remerge_after_load: str | None = None
        self._factor_cache: dict[str, tuple[tuple[dict, str], tuple[dict, str]]] = {}
        self._init_containers()
        self.add_adapter(adapter_name, rank, alpha, dropout, use_rslora=use_rslora, init=init, use_dora=use_dora,
                         lora_bias=lora_bias)
        self.register_state_dict_post_hook(unmerged_state)
        self.register_load_state_dict_pre_hook(unmerge_before_load)
        self.register_load_state_dict_post_hook(remerge_after_load)

    def _apply(self, fn, recurse: bool = True):
        self._forget_cached_tensors()  # then LayerWrapper's: a half-precision cast reaches the base layer only
        return super()._apply(fn, recurse)

    def _forget_cached_tensors(self) -> None:
        # After a move, a cast or a load (assign=True replaces the Parameter objects) the references would be stale.
        self._factor_cache = {}
        self.__dict__.pop("_routed_plan", None)  # RoutedPath._plan: it holds references to the parameters too

    @property
    def weight(self) -> Tensor:
        """The base layer's weight: code that reads ``module.weight`` (dtype checks, T5) keeps working."""
        return self.base_layer.weight

    #: Where the tensor the adapters update sits in the layer's state dict (`_adapted`).
    adapted_key: ClassVar[str] = "base_layer.weight"

    def _adapted(self) -> Tensor:
        """The base tensor the adapters update and a merge writes: the base layer's weight (a parameter of
        another module for `lightning_peft.peft.lora.param`)."""
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
        return any(s.variant is not None and s.variant.reads_base_weight for s in self.specs.values())

    @property
    def merged(self) -> bool:
        return self.merged_adapter is not None

    def add_adapter(
        self, name: str, rank: int, alpha: float, dropout: float = 0.0, *, use_rslora: bool = False,
        init: Init = "kaiming", use_dora: bool = False, lora_bias: bool = False,
    ) -> None:
        """Add adapter ``name`` (zero update) to this layer."""
        if name in self.specs:
            raise ValueError(f"{type(self).__name__}: adapter {name!r} already exists on this layer.")
        if use_dora and self.dora_variant is None:
            raise TypeError(f"{type(self).__name__}(use_dora=True): DoRA is not implemented for a "
                            f"{type(self.base_layer).__name__} base layer.")
        if lora_bias and (use_dora or isinstance(self.base_layer, nn.Embedding)):  # as PEFT refuses them
            raise ValueError(f"{type(self).__name__}(lora_bias=True): lora_bias is not supported "
                             f"{'with DoRA' if use_dora else 'on an Embedding'}; set lora_bias=False.")
        variant = self.dora_variant() if use_dora else None
        self.specs[name] = AdapterSpec(rank, alpha, use_rslora, variant, lora_bias)
        self._forget_cached_tensors()  # a routed plan made for the old adapters
        self.lora_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        weight = self._adapted()
        self._create(name, rank, device=weight.device, dtype=adapter_dtype(weight))
        if variant is not None:
            variant.create(self, name, device=weight.device, dtype=adapter_dtype(weight))
        self.reset_parameters(init, name)
        # New submodules start in training mode; those of an eval layer must not (dropout would stay on).
        for module in (self.lora_dropout[name], *(c[name] for c in self._containers())):
            if isinstance(module, nn.Module):
                module.train(self.training)

    def delete_adapter(self, name: str) -> None:
        """Remove adapter ``name``; its parameters are gone from the module."""
        if self.merged_adapter == name:
            raise RuntimeError(f"{type(self).__name__}: adapter {name!r} is merged; unmerge it before deleting it.")
        variant = self.specs.pop(name).variant
        if variant is not None:
            variant.delete(self, name)
        del self.lora_dropout[name]
        self._forget_cached_tensors()
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
        params = {}
        for n in self.adapter_names if name is None else [name]:
            params |= self._parameters_of(n)
            if self.specs[n].variant is not None:
                params |= self.specs[n].variant.parameters(self, n)
        return params

    def factors(self, name: str) -> tuple[nn.Parameter, nn.Parameter]:
        """``(A, B)`` of adapter ``name``, read every forward.

        The ``_parameters`` dicts that hold them are found once; the parameters themselves are read from those dicts
        each time, so a parameter replaced in place (``register_parameter``, as FSDP2 and DTensor parallelism do) is
        the one used.
        """
        (holder_a, key_a), (holder_b, key_b) = self._refs(name)
        return holder_a[key_a], holder_b[key_b]

    def _refs(self, name: str) -> tuple[tuple[dict, str], tuple[dict, str]]:  # `_factor_refs`, found once
        cache = self._factor_cache
        return cache[name] if name in cache else cache.setdefault(name, self._factor_refs(name))

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
            if self.specs[n].variant is not None:
                self.specs[n].variant.reset(self, n)

    def _reset(self, name: str, init: Init) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _reset()")

    # --- merging -----------------------------------------------------------------------------------------------

    def merged_weight(self, name: str | None = None) -> Tensor:
        """``W + delta`` of one adapter computed in float32 (or wider), cast to the base dtype; raises if
        non-finite. On a merged layer: the weight as it is (the merged adapter's)."""
        weight = self._adapted()
        if self.merged:
            if name is not None and name != self.merged_adapter:
                raise RuntimeError(
                    f"{type(self).__name__}: adapter {self.merged_adapter!r} is merged, not {name!r}; "
                    "unmerge_lora(model) first."
                )
            return weight.detach().clone()
        with torch.no_grad():  # a quantized base is dequantized (to the dtype it had) first
            dense = dense_weight(weight, self.base_layer)
            merged = self._with_update(dense.to(compute_dtype(dense.dtype)), name or self._active_name())
        if not torch.isfinite(merged).all():
            raise RuntimeError(
                f"{type(self).__name__}: merging would write inf or NaN into the base weight "
                f"(shape {tuple(weight.shape)}); the adapter or base weight holds non-finite or overflowing "
                "values. Nothing was merged into this layer."
            )
        return merged.to(dense.dtype)

    def merged_weights(self, name: str | None = None) -> dict[str, Tensor]:
        """Every base tensor a merge of adapter ``name`` writes, by its key in this layer's state dict: the adapted
        weight (`merged_weight`) and, with ``lora_bias``, the bias (`merged_bias`)."""
        merged = {self.adapted_key: self.merged_weight(name)}
        bias = self.merged_bias(name)
        if bias is not None:
            merged["base_layer.bias"] = bias
        return merged

    def _restored(self) -> dict[str, Tensor]:
        """The base tensors without the merged adapter's update, by their key in this layer's state dict."""
        weight, name = self._adapted(), self.merged_adapter
        restored = self._without_update(dense_weight(weight).to(compute_dtype(weight.dtype)), name)
        tensors = {self.adapted_key: restored.to(weight.dtype)}
        bias_delta = self._bias_delta(name)
        if bias_delta is not None:
            tensors["base_layer.bias"] = (self.bias.to(bias_delta.dtype) - bias_delta).to(self.bias.dtype)
        return tensors

    def _with_update(self, weight: Tensor, name: str) -> Tensor:
        """The merged weight of adapter ``name`` from the dense base ``weight`` (compute dtype): ``W + delta``."""
        variant = self.specs[name].variant
        return weight + self.delta_weight(name) if variant is None else variant.merged(self, name, weight)

    def _without_update(self, weight: Tensor, name: str) -> Tensor:
        """The base weight back from ``weight``, which holds adapter ``name`` merged: ``W' - delta``."""
        variant = self.specs[name].variant
        return weight - self.delta_weight(name) if variant is None else variant.unmerged(self, name, weight)

    def _bias_delta(self, name: str) -> Tensor | None:
        """``s * b`` of an adapter with ``lora_bias`` (what merging adds to the base bias), else None."""
        return None

    def merged_bias(self, name: str | None = None) -> Tensor | None:
        """The base bias plus adapter ``name``'s ``s * b`` (``lora_bias``), computed in float32 (or wider) and cast
        to the bias dtype; None for an adapter without ``lora_bias``. On a merged layer: the bias as it is."""
        name = name or self.merged_adapter or self._active_name()
        delta = self._bias_delta(name)
        if delta is None or self.merged:
            return None if delta is None else self.bias.detach().clone()
        if self.bias is None:
            raise RuntimeError(
                f"{type(self).__name__}: adapter {name!r} has lora_bias=True, but the base "
                f"{type(self.base_layer).__name__} has no bias to merge it into (PEFT refuses this merge too). Keep "
                "the adapter unmerged (save_adapter), or train it with lora_bias=False."
            )
        merged = self.bias.detach().to(delta.dtype) + delta
        if not torch.isfinite(merged).all():
            raise RuntimeError(f"{type(self).__name__}: merging lora_bias would write inf or NaN into the base bias; "
                               "nothing was merged into this layer.")
        return merged.to(self.bias.dtype)

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
        merged = self.merged_weights(name)  # every refusal comes before any write
        if is_quantized(self._adapted()):
            if not dequantize:
                raise RuntimeError(
                    f"{type(self).__name__}: the base weight is quantized ({type(self.base_layer.weight).__name__}); "
                    "merging in place would requantize it and lose most of the update. Use unload_lora(model, "
                    "merge=True) for a plain full-precision model, or merged_state_dict(model) for an export."
                )
            self._dequantize_base(merged.pop(self.adapted_key))
        for key, value in merged.items():
            self.get_parameter(key).copy_(value)
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
        for key, restored in self._restored().items():
            self.get_parameter(key).copy_(restored)
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
            if routing.cu_seqlens is not None:  # a packed batch: names are rows, routed per token
                return self._packed(x, result, routing)
            if x.shape[0] != len(routing.names):
                raise ValueError(f"route_adapters: a batch of {x.shape[0]} samples reached {type(self).__name__} "
                                 f"({self.base_layer}), but {len(routing.names)} adapter names were given; give one "
                                 "name per sample (the batch dimension must come first)."
                                 f"{_repeated(x.shape[0], len(routing.names))}")
            # Only the adapters the batch uses are stacked (the others must get no gradient), every forward.
            selected = routing.select(self.adapter_names, x.device)
            if selected is None:
                return result
            variants.refuse_routing([n for n in selected[0] if self.specs[n].variant is not None])
            if len(selected[0]) == 1 and 1 not in selected[2]:  # every sample on one adapter: its own path
                return self._single(x, result, selected[0][0])
            return self._routed(x, result, *selected)
        name = routing.active
        if name not in self.specs:
            return result
        variant = self.specs[name].variant
        return self._single(x, result, name) if variant is None else variant.forward(self, name, x, result)

    def _single(self, x: Tensor, result: Tensor, name: str) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define _single()")

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

    def _add_update(self, result: Tensor, hidden: Tensor, lora_b: Tensor, scaling: float,
                    bias: Tensor | None = None) -> Tensor:
        """``result + scaling * (hidden @ lora_b.T + bias)``; one fused GEMM when dtypes agree and autocast is off.

        ``hidden`` is (..., r), ``lora_b`` is (out, r), ``bias`` (out,) or None, ``result`` is (..., out). Under
        autocast the fused GEMM would round the base output to the autocast dtype, so the update is added separately.
        """
        fuse = hidden.dtype == result.dtype == lora_b.dtype and not torch.is_autocast_enabled(result.device.type)
        if fuse:
            result2 = result.reshape(-1, result.shape[-1])  # (N, out)
            hidden2 = hidden.reshape(-1, hidden.shape[-1])  # (N, r)
            if self._may_overwrite(result):
                out = result2.addmm_(hidden2, lora_b.t(), alpha=scaling)
            else:
                out = torch.addmm(result2, hidden2, lora_b.t(), alpha=scaling)
            return (out if bias is None else out.add_(bias, alpha=scaling)).view(result.shape)
        update = F.linear(hidden.to(lora_b.dtype), lora_b, bias) * scaling
        return result + update.to(result.dtype)

    def extra_repr(self) -> str:
        adapters = ", ".join(
            f"{n}: rank={s.rank}, alpha={s.alpha}, scaling={s.scaling:.4g}{f', {s.variant.name}' if s.variant else ''}"
            for n, s in self.specs.items()
        )
        return f"{adapters}, merged={self.merged_adapter!r}" if self.merged else f"{adapters}, merged=False"


def _repeated(samples: int, names: int) -> str:
    """The hint for a batch a whole number of times larger than the names (``generate`` repeating samples), or of one
    sample for several names (a packed batch routed without its boundaries)."""
    if samples == 1:
        return " A packed batch (rows in one sequence) is routed with route_adapters(..., cu_seqlens=row boundaries)."
    if samples <= names or samples % names:
        return ""
    k = samples // names
    return (f" A batch {k} times larger is what generate(num_beams={k}) or num_return_sequences={k} makes: call "
            "generate on the Hugging Face model the adapters were injected into (it repeats the names as it repeats "
            f"the samples), or give each name {k} times in a row.")


def linear_types() -> tuple[type, ...]:
    """The types `LoRALinear` adapts: ``nn.Linear``, and ``transformers``' ``Conv1D`` if ``transformers`` is already
    imported (a model can only contain a ``Conv1D`` once it is, so this never imports it)."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


def lora_layers(model: nn.Module) -> dict[str, LoRALayer]:
    """All LoRA layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, LoRALayer)}


def lora_spec(model: nn.Module):
    """The [`LoRAAdapter`][lightning_peft.peft.LoRAAdapter] [`inject_lora`][lightning_peft.peft.inject_lora] left on
    ``model``, or None."""
    return attached(model).get("lora")


def require_spec(model: nn.Module, who: str):
    """`lora_spec`, raising (``who`` in the message) if ``model`` has no LoRA adapter."""
    return require(model, "lora", who, "LoRA adapter", "inject_lora")


class ABLayer(LoRALayer):
    """A layer whose adapters are pairs of modules: ``lora_A[n]`` (input side) and ``lora_B[n]`` (output side)."""

    lora_A: nn.ModuleDict
    lora_B: nn.ModuleDict

    def _init_containers(self) -> None:
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()

    def _containers(self) -> list[nn.ModuleDict]:
        return [self.lora_A, self.lora_B]

    def _parameters_of(self, name: str) -> dict[str, nn.Parameter]:
        params = {f"lora_A.{name}.weight": self.lora_A[name].weight, f"lora_B.{name}.weight": self.lora_B[name].weight}
        if self.lora_B[name].bias is not None:  # lora_bias
            params[f"lora_B.{name}.bias"] = self.lora_B[name].bias
        return params

    def _bias_delta(self, name: str) -> Tensor | None:
        bias = self.lora_B[name].bias  # (out,) with lora_bias
        return None if bias is None else bias.detach().to(compute_dtype(bias.dtype)) * self.specs[name].scaling

    def _factor_refs(self, name: str) -> tuple[tuple[dict, str], tuple[dict, str]]:
        return (self.lora_A[name]._parameters, "weight"), (self.lora_B[name]._parameters, "weight")

    @torch.no_grad()
    def _reset(self, name: str, init: Init) -> None:
        if init == "gaussian":
            nn.init.normal_(self.lora_A[name].weight, std=1 / self.specs[name].rank)
        else:
            nn.init.kaiming_uniform_(self.lora_A[name].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[name].weight)
        if self.lora_B[name].bias is not None:
            nn.init.zeros_(self.lora_B[name].bias)


class LoRALinear(ABLayer):
    """LoRA for ``nn.Linear`` and for ``transformers``' ``Conv1D`` (``fan_in_fan_out=True``: weight is (in, out))."""

    dora_variant = variants.LinearDoRA

    # A column-wise base (output dim split): B (out, r) splits with it, A replicated; a row-wise base (input dim
    # split): A (r, in) splits with it, B replicated (lightning_peft.parallel.tensor_parallel).
    tensor_parallel_split = {"colwise": "lora_B", "rowwise": "lora_A"}

    @property
    def fan_in_fan_out(self) -> bool:
        """Whether the base weight is (in, out): ``transformers``' ``Conv1D``."""
        return not isinstance(self.base_layer, nn.Linear)

    def _create(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        base = self.base_layer
        if isinstance(base, nn.Linear):  # (a bitsandbytes Linear4bit packs its weight: its shape is not (out, in))
            in_features, out_features = base.in_features, base.out_features
        else:
            in_features, out_features = base.weight.shape
        self.lora_A[name] = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B[name] = nn.Linear(rank, out_features, bias=self.specs[name].lora_bias, device=device, dtype=dtype)

    def _delta(self, name: str) -> Tensor:
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        dtype = compute_dtype(a.dtype)
        delta = (b.to(dtype) @ a.to(dtype)) * self.specs[name].scaling  # (out, in)
        return delta.t() if self.fan_in_fan_out else delta

    @torch.no_grad()
    def _reset(self, name: str, init: Init) -> None:
        if starts.rewrites_base(init) and not starts.loftq_iterations(init):  # PiSSA, OLoRA: from the weight
            starts.initialise(self, name, init)
        else:  # LoftQ needs the model's quantizer: inject_lora starts it once the layers exist (model.py)
            super()._reset(name, init)

    def _single(self, x: Tensor, result: Tensor, name: str) -> Tensor:
        lora_a, lora_b = self.factors(name)  # (r, in), (out, r)
        hidden = F.linear(self.lora_dropout[name](x).to(lora_a.dtype), lora_a)  # (..., r)
        return self._add_update(result, hidden, lora_b, self.specs[name].scaling, self.lora_B[name].bias)

    def _routed(self, x: Tensor, result: Tensor, names: list[str], slots: Tensor, host: list[int]) -> Tensor:
        if self._plan(names, host)[0]:  # a bias per sample (lora_bias): one segment per adapter
            return super()._routed(x, result, names, slots, host)
        a, b, scale = self._gathered(names, host)  # (B, r, in), (B, out, r)
        x3 = self._routed_dropout(x, names, slots).to(a.dtype).reshape(x.shape[0], -1, x.shape[-1])  # (B, T, in)
        # (B, T, r). Without autograd, several tokens per sample: A x^T ran 1.2-3x faster than x A^T on CPU BLAS (its
        # slow case: an output of r columns); x A^T stays at one token (1.4x faster there) and for backward.
        inference = x3.shape[1] > 1 and not torch.is_grad_enabled()
        hidden = torch.bmm(a, x3.transpose(1, 2)).transpose(1, 2) if inference else torch.bmm(x3, a.transpose(1, 2))
        return self._add_batched(result, hidden, b.transpose(1, 2), scale)


class LoRAEmbedding(LoRALayer):
    """LoRA for ``nn.Embedding``: the update looks up rows of ``A^T`` (V, r) and projects them with ``B``."""

    dora_variant = variants.EmbeddingDoRA
    token_features = 0  # token ids: (1, T) in a packed batch

    def add_adapter(self, name: str, rank: int, alpha: float, dropout: float = 0.0, **settings) -> None:
        # Dropout on token ids has no meaning; PEFT ignores it for embeddings too.
        super().add_adapter(name, rank, alpha, 0.0, **settings)

    def _init_containers(self) -> None:
        self.lora_embedding_A = nn.ParameterDict()
        self.lora_embedding_B = nn.ParameterDict()

    def _containers(self) -> list[nn.ParameterDict]:
        return [self.lora_embedding_A, self.lora_embedding_B]

    def _create(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        num_embeddings, dim = self.base_layer.weight.shape
        self.lora_embedding_A[name] = nn.Parameter(torch.empty(rank, num_embeddings, device=device, dtype=dtype))
        self.lora_embedding_B[name] = nn.Parameter(torch.empty(dim, rank, device=device, dtype=dtype))

    def _parameters_of(self, name: str) -> dict[str, nn.Parameter]:
        return {f"lora_embedding_A.{name}": self.lora_embedding_A[name],
                f"lora_embedding_B.{name}": self.lora_embedding_B[name]}

    def _factor_refs(self, name: str) -> tuple[tuple[dict, str], tuple[dict, str]]:
        return (self.lora_embedding_A._parameters, name), (self.lora_embedding_B._parameters, name)

    @torch.no_grad()
    def _reset(self, name: str, init: Init) -> None:
        # "kaiming" is PEFT's convention for embeddings: A = 0, B ~ N(0, 1). "gaussian" mirrors the linear
        # layers: A ~ N(0, 1/r), B = 0. The update starts at zero either way.
        a, b = self.lora_embedding_A[name], self.lora_embedding_B[name]
        if init == "gaussian":
            nn.init.normal_(a, std=1 / self.specs[name].rank)
            nn.init.zeros_(b)
        else:
            nn.init.zeros_(a)
            nn.init.normal_(b)

    def _delta(self, name: str) -> Tensor:
        a, b = self.lora_embedding_A[name], self.lora_embedding_B[name]
        dtype = compute_dtype(a.dtype)
        return (b.to(dtype) @ a.to(dtype)).t() * self.specs[name].scaling  # (V, d)

    def _lookup(self, x: Tensor, table: Tensor) -> Tensor:
        base = self.base_layer
        # The base's options apply to the adapter's lookup too, as in PEFT, except ``sparse``: a sparse gradient
        # cannot flow back through the transpose of A (PEFT fails there), and A is small, so it gets a dense
        # gradient, which every optimizer takes.
        return F.embedding(
            x, table, padding_idx=base.padding_idx, max_norm=base.max_norm, norm_type=base.norm_type,
            scale_grad_by_freq=base.scale_grad_by_freq,
        )

    def _single(self, x: Tensor, result: Tensor, name: str) -> Tensor:
        hidden = self._lookup(x, self.lora_embedding_A[name].t())  # (..., r)
        return self._add_update(result, hidden, self.lora_embedding_B[name], self.specs[name].scaling)

    def _routed(self, x: Tensor, result: Tensor, names: list[str], slots: Tensor, host: list[int]) -> Tensor:
        if self.base_layer.max_norm is not None:  # max_norm renormalises the looked-up rows in place
            return super()._routed(x, result, names, slots, host)
        a_rows, b_cols = self._padded(names)  # each A (r, V) and B (d, r), the last pair all zero
        table = torch.cat(a_rows, dim=1).t()  # ((k+1) V, r): adapter k's rows at [k V, (k+1) V)
        ids = x + (slots * a_rows[0].shape[1]).view(-1, *([1] * (x.dim() - 1)))  # (B, ...)
        hidden = F.embedding(ids, table, scale_grad_by_freq=self.base_layer.scale_grad_by_freq)  # (B, ..., r)
        padding = self.base_layer.padding_idx
        if padding is not None:  # as padding_idx does: the row is read, but gets no gradient
            hidden = torch.where((x == padding).unsqueeze(-1), hidden.detach(), hidden)
        b_t = torch.stack(b_cols).index_select(0, slots).transpose(1, 2)  # (B, r, d)
        hidden = hidden.reshape(x.shape[0], -1, hidden.shape[-1])  # (B, T, r)
        return self._add_batched(result, hidden, b_t, self._plan(names, host)[2])


#: LoRA layer classes by base module type, beside Linear / Conv1D (the default) and Embedding; each layer module
#: adds its own when the package is imported (`lightning_peft.peft.lora.conv`: ``nn.Conv1d``, ``Conv2d``, ``Conv3d``;
#: `lightning_peft.peft.lora.mha`: ``nn.MultiheadAttention``).
LAYER_TYPES: dict[type, type[LoRALayer]] = {}


def make_layer(module: nn.Module, adapter_name: str, **settings) -> LoRALayer:
    """The LoRA layer for ``module`` with adapter ``adapter_name`` (``settings``: `LoRALayer.add_adapter`'s, as
    ``LoRAConfig.layer_settings`` gives them)."""
    if isinstance(module, nn.Embedding):
        return LoRAEmbedding(module, adapter_name=adapter_name, **settings)
    layer_type = next((t for base, t in LAYER_TYPES.items() if isinstance(module, base)), LoRALinear)
    return layer_type(module, adapter_name=adapter_name, **settings)
