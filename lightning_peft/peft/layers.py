"""LoRA layers: a frozen base module plus trainable low-rank updates, one per named adapter.

Paper: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.
rsLoRA scaling: Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", arXiv:2312.03732.
Mixed-adapter batches: Chen et al., "Punica: Multi-Tenant LoRA Serving", arXiv:2310.18547 (the gathered batched
matmul); Sheng et al., "S-LoRA: Serving Thousands of Concurrent LoRA Adapters", arXiv:2311.03285.

Update rule. A frozen weight ``W`` (out, in) is adapted by adapter ``n`` as::

    W' = W + s_n * B_n @ A_n        A_n: (r_n, in), B_n: (out, r_n), s_n = alpha_n / r_n   (alpha_n / sqrt(r_n), rsLoRA)
    y  = W x + s_n * B_n (A_n dropout_n(x))

Only the ``A`` and ``B`` train. ``B`` starts at zero, so a new adapter starts equal to the base model.

Shapes (parameters are named and laid out as Hugging Face PEFT names them in memory, ``lora_A.<adapter>.weight``;
adapter files drop the adapter name, as PEFT's do):

=======================  ======================  ===========================================================
base layer               base weight             parameters of adapter ``n``
=======================  ======================  ===========================================================
``nn.Linear(in, out)``   (out, in)               ``lora_A.n.weight`` (r, in), ``lora_B.n.weight`` (out, r)
``Conv1D`` (transformers) (in, out), transposed  same as Linear; the delta is transposed to merge
``nn.Embedding(V, d)``   (V, d)                  ``lora_embedding_A.n`` (r, V), ``lora_embedding_B.n`` (d, r)
``nn.Conv2d(in, out, k)`` (out, in, kh, kw)      ``lora_A.n``: Conv2d(in, r, k), ``lora_B.n``: Conv2d(r, out, 1)
=======================  ======================  ===========================================================

Which adapter runs is decided by one :class:`Routing` object shared by every LoRA layer of a model, so switching
is one attribute write, whatever the number of layers:

- ``routing.active``: the adapter every sample uses (a layer without that adapter runs its base only);
- ``routing.disabled``: the base only;
- ``routing.route_to(names)``: one adapter name (or None, the base) per sample of the batch. A mixed batch is
  computed in one pass: the adapters the batch uses are stacked (ranks padded with zeros, the scale folded into
  ``B``), each sample's ``A`` and ``B`` gathered, and the low-rank path run as two batched matmuls, so the cost does
  not grow with the number of adapters in the batch or loaded. Only the adapters the batch uses enter the stack, so
  the others get no gradient (``grad`` stays None) and an optimizer step leaves them untouched.

Each layer wraps its base module (``self.base_layer``); nothing is copied, and attributes the layer does not
define (``in_features``, ``padding_idx``, ``kernel_size``, ...) are read from the base. Merging is explicit
(:meth:`LoRALayer.merge` / :meth:`LoRALayer.unmerge`, one adapter at a time), never a side effect of
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Init = Literal["kaiming", "gaussian"]
DEFAULT = "default"


def conv1d_type() -> type | None:
    """The ``transformers`` ``Conv1D`` class if ``transformers`` is already imported, else None.

    A model can only contain a ``Conv1D`` once ``transformers`` is imported, so this never imports it.
    """
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def _adapter_dtype(weight: Tensor) -> torch.dtype:
    # Half-precision bases get float32 adapters (as PEFT does): tiny, and they keep small updates.
    return torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Merges are computed in at least float32 and cast back.
    return torch.promote_types(dtype, torch.float32)


_HALF = (torch.float16, torch.bfloat16)


class Routing:
    """Which adapter each sample uses; one object shared by every LoRA layer of a model.

    Attributes:
        active: The adapter every sample uses outside a routed batch (None: the base only).
        disabled: Every layer runs its base only.
        names: Inside :meth:`route_to`: one adapter name (or None) per sample; else None.
    """

    def __init__(self, active: str | None = DEFAULT) -> None:
        self.active = active
        self.disabled = False
        self.names: tuple[str | None, ...] | None = None
        self._used: tuple[str, ...] = ()
        self._slots: Tensor | None = None  # (B,) position of each sample's adapter in _used; len(_used) = none
        self._positions: list[int] = []  # the same as a list
        self._cache: dict[tuple, tuple[list[str], Tensor]] = {}
        self.merged: dict[str, int] = {}  # adapter name -> number of layers holding it merged

    @property
    def merged_adapter(self) -> str | None:
        """The adapter merged into base weights somewhere in the model, if any (one at a time)."""
        return next((name for name, count in self.merged.items() if count > 0), None)

    def route_to(self, names: Sequence[str | None] | None) -> None:
        """Give sample ``i`` of the next batches adapter ``names[i]`` (None: the base); ``None`` ends routing."""
        self._cache = {}
        if names is None:
            self.names, self._used, self._slots, self._positions = None, (), None, []
            return
        self.names = tuple(names)
        self._used = tuple(dict.fromkeys(n for n in self.names if n is not None))
        position = {n: i for i, n in enumerate(self._used)}
        self._positions = [position.get(n, len(self._used)) for n in self.names]  # (B,) as a list
        self._slots = torch.tensor(self._positions, dtype=torch.long)

    def select(
        self, adapters: Sequence[str], device: torch.device
    ) -> tuple[list[str], Tensor, list[int]] | None:
        """For a layer holding ``adapters``: the used adapters it has, and each sample's slot among them (a tensor
        on ``device`` and the same as a list, so that layers gather without reading the device back).

        Slot ``len(names)`` stands for "no adapter here" (a None sample, or an adapter this layer lacks). Returns
        None when no sample uses an adapter of this layer. The slots depend only on the routing, so they are
        computed once per :meth:`route_to` and layer signature.
        """
        key = (tuple(adapters), device)
        if key not in self._cache:
            here = [n for n in self._used if n in adapters]
            position = {n: i for i, n in enumerate(here)}
            local = [position.get(n, len(here)) for n in self._used] + [len(here)]
            host = [local[s] for s in self._positions]
            self._cache[key] = (here, torch.tensor(host, dtype=torch.long, device=device), host)  # (B,)
        here, slots, host = self._cache[key]
        return (here, slots, host) if here else None


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter's settings on one layer; ``scaling`` is computed once (the forward reads it every call)."""

    rank: int
    alpha: float
    use_rslora: bool
    scaling: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "scaling", self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank
        )


class LoRALayer(nn.Module):
    """Base class: a frozen ``base_layer`` plus low-rank updates of its weight, one per named adapter.

    Subclasses define the adapter parameters (:meth:`_create`), :meth:`delta_weight` and the update paths.

    Args:
        base_layer: The module to adapt. It is kept, not copied.
        rank: ``r``, the rank of the first adapter's update.
        alpha: Scale numerator: the update is multiplied by ``alpha / rank`` (or ``alpha / sqrt(rank)``).
        dropout: Dropout probability on the adapter's input.
        use_rslora: Use the rank-stabilised scale ``alpha / sqrt(rank)``.
        init: Initialisation of ``A`` (``"kaiming"`` or ``"gaussian"``); ``B`` starts at zero.
        adapter_name: The first adapter's name.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        init: Init = "kaiming",
        adapter_name: str = DEFAULT,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.specs: dict[str, AdapterSpec] = {}
        self.lora_dropout = nn.ModuleDict()
        self.routing = Routing(adapter_name)
        self.merged_adapter: str | None = None
        self._remerge_after_load: str | None = None
        self._factor_cache: dict[str, tuple[tuple[dict, str], tuple[dict, str]]] = {}
        self._init_containers()
        self.add_adapter(adapter_name, rank, alpha, dropout, use_rslora, init)
        self.register_state_dict_post_hook(_unmerged_state)
        self.register_load_state_dict_pre_hook(_unmerge_before_load)
        self.register_load_state_dict_post_hook(_remerge_after_load)

    def __getattr__(self, name: str):
        # nn.Module's lookup (parameters, buffers, submodules) first; then the base layer's attributes, so
        # code that reads ``in_features``, ``padding_idx`` or ``kernel_size`` keeps working.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_layer":
                raise
            return getattr(self.base_layer, name)

    def _apply(self, fn, recurse: bool = True):
        # A cast to half precision (model.half(), Trainer(precision="bf16-true")) reaches the base only: the
        # adapter follows device moves but keeps its dtype, so small updates are not lost.
        self._forget_cached_tensors()
        probe = fn(torch.zeros((), dtype=torch.float32))
        if not (isinstance(probe, Tensor) and probe.dtype in _HALF) or not recurse:
            return super()._apply(fn, recurse)
        device = probe.device

        def move(t: Tensor) -> Tensor:
            return t.to(device=device)

        for name, child in self.named_children():
            child._apply(fn if name == "base_layer" else move)
        return super()._apply(move, recurse=False)

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

    @property
    def rank(self) -> int:
        return self._spec().rank

    @property
    def alpha(self) -> float:
        return self._spec().alpha

    @property
    def use_rslora(self) -> bool:
        return self._spec().use_rslora

    @property
    def scaling(self) -> float:
        return self._spec().scaling

    @property
    def merged(self) -> bool:
        return self.merged_adapter is not None

    def add_adapter(
        self, name: str, rank: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
        init: Init = "kaiming",
    ) -> None:
        """Add adapter ``name`` (zero update) to this layer."""
        if name in self.specs:
            raise ValueError(f"{type(self).__name__}: adapter {name!r} already exists on this layer.")
        self.specs[name] = AdapterSpec(rank, alpha, use_rslora)
        self.lora_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        weight = self.base_layer.weight
        self._create(name, rank, device=weight.device, dtype=_adapter_dtype(weight))
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
        with torch.no_grad():
            merged = weight.to(_compute_dtype(weight.dtype)) + self.delta_weight(name)
        if not torch.isfinite(merged).all():
            raise RuntimeError(
                f"{type(self).__name__}: merging would write inf or NaN into the base weight "
                f"(shape {tuple(weight.shape)}); the adapter or base weight holds non-finite or overflowing "
                "values. Nothing was merged into this layer."
            )
        return merged.to(weight.dtype)

    @torch.no_grad()
    def merge(self, name: str | None = None) -> None:
        """Add one adapter's update (default: the active one) into the base weight. Merging the merged adapter
        again changes nothing; merging a second one is refused."""
        name = name or self._active_name()
        if self.merged_adapter == name:
            return
        if self.merged:
            raise RuntimeError(
                f"{type(self).__name__}: adapter {self.merged_adapter!r} is merged; unmerge it before merging {name!r}."
            )
        self.base_layer.weight.copy_(self.merged_weight(name))
        self.merged_adapter = name
        self.routing.merged[name] = self.routing.merged.get(name, 0) + 1

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the merged update from the base weight (exact up to one rounding in the compute dtype).

        Raises:
            RuntimeError: If the layer is not merged.
        """
        if not self.merged:
            raise RuntimeError(f"{type(self).__name__}.unmerge(): the layer is not merged; call merge() first.")
        weight = self.base_layer.weight
        restored = weight.to(_compute_dtype(weight.dtype)) - self.delta_weight(self.merged_adapter)
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
                    "sample (the batch dimension must come first)."
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

    def _routed(self, x: Tensor, result: Tensor, names: list[str], slots: Tensor, host: list[int]) -> Tensor:
        """The update for a mixed batch; default: one segment per adapter (subclasses batch it). ``slots`` (B,)
        and ``host`` (the same on the host) give each sample's position in ``names`` (``len(names)``: none)."""
        update = None
        for position, name in enumerate(names):
            rows = (slots == position).nonzero().squeeze(1)  # (b,)
            part = self._single(x.index_select(0, rows), torch.zeros_like(result.index_select(0, rows)), name)
            update = part.new_zeros(result.shape) if update is None else update
            update = update.index_add(0, rows, part)
        return result + update.to(result.dtype)

    def _padded(self, names: list[str]) -> tuple[list[Tensor], list[Tensor]]:
        """Each adapter's ``A`` (r, in) and ``B`` (out, r) with ranks zero-padded to the largest, and a last,
        all-zero pair for samples without an adapter here."""
        pairs = [self.factors(n) for n in names]  # each (A (r, in), B (out, r))
        ranks = [self.specs[n].rank for n in names]
        rank = max(ranks)
        a_rows = [F.pad(a, (0, 0, 0, rank - r)) if r < rank else a for (a, _), r in zip(pairs, ranks)]
        b_cols = [F.pad(b, (0, rank - r)) if r < rank else b for (_, b), r in zip(pairs, ranks)]
        a_rows.append(a_rows[0].new_zeros(a_rows[0].shape))
        b_cols.append(b_cols[0].new_zeros(b_cols[0].shape))
        return a_rows, b_cols

    def _stacked(self, names: list[str]) -> tuple[Tensor, Tensor]:
        """``A^T`` (k+1, in, r) and ``(s * B)^T`` (k+1, r, out) of ``names``, ranks padded to the largest, and a
        last, all-zero slot for samples without an adapter here.

        Built every forward (see :meth:`_gathered`): only the adapters the batch uses.
        """
        a_rows, b_cols = self._padded(names)
        scale = torch.tensor([self.specs[n].scaling for n in names] + [0.0], dtype=b_cols[0].dtype,
                             device=b_cols[0].device)
        # Stacked straight into the transposed, contiguous layout the batched matmuls read: one copy each.
        stacked_a = torch.stack([a.t() for a in a_rows])  # (k+1, in, r)
        stacked_b = torch.stack([b.t() for b in b_cols]).mul_(scale.view(-1, 1, 1))  # (k+1, r, out)
        return stacked_a, stacked_b

    def _gathered(self, names: list[str], host: list[int]) -> tuple[Tensor, Tensor]:
        """Each sample's ``A^T`` (B, in, r) and ``(s * B)^T`` (B, r, out), gathered straight from the parameters
        (ranks padded to the largest; zeros for a sample without an adapter here).

        Built every forward, in inference too: no cache keyed on the parameters can tell that they changed (a fused
        optimizer step and writes through ``.data`` move neither the version counter nor the storage). One copy
        per sample, as large as the gather from a stack would be, and nothing is stacked for adapters no sample
        uses here.
        """
        a_rows, b_cols = self._padded(names)
        scales = [self.specs[n].scaling for n in names] + [0.0]
        scale = torch.tensor([scales[s] for s in host], dtype=b_cols[0].dtype, device=b_cols[0].device)  # (B,)
        a_t = torch.stack([a_rows[s].t() for s in host])  # (B, in, r)
        b_t = torch.stack([b_cols[s].t() for s in host]).mul_(scale.view(-1, 1, 1))  # (B, r, out)
        return a_t, b_t

    def _add_batched(self, result: Tensor, hidden: Tensor, b_t: Tensor) -> Tensor:
        """``result + hidden @ b_t`` per sample: ``hidden`` (B, T, r), ``b_t`` (B, r, out), ``result`` (B, ..., out).

        One fused ``baddbmm`` when dtypes agree and autocast is off (as :meth:`_add_update` fuses ``addmm``).
        """
        fuse = hidden.dtype == result.dtype == b_t.dtype and not torch.is_autocast_enabled(result.device.type)
        if fuse:
            result3 = result.reshape(hidden.shape[0], -1, result.shape[-1])  # (B, T, out)
            if self._may_overwrite(result):
                return result3.baddbmm_(hidden, b_t).view(result.shape)
            return torch.baddbmm(result3, hidden, b_t).view(result.shape)
        return result + torch.bmm(hidden, b_t).view(result.shape).to(result.dtype)

    def _may_overwrite(self, result: Tensor) -> bool:
        """Whether the base output can take the update in place: without autograd, and when no hook on the base
        layer may have kept a reference to it (a copy of the output then costs as much as the update itself)."""
        return not torch.is_grad_enabled() and not self.base_layer._forward_hooks and result.is_contiguous()

    def _routed_dropout(self, x: Tensor, names: list[str], slots: Tensor) -> Tensor:
        """Each sample's input with its own adapter's dropout (inverted dropout, as ``nn.Dropout``)."""
        if not self.training:
            return x
        probs = [m.p if isinstance(m, nn.Dropout) else 0.0 for m in (self.lora_dropout[n] for n in names)]
        if not any(probs):
            return x
        keep = 1 - torch.tensor([*probs, 0.0], device=x.device, dtype=x.dtype)[slots]  # (B,)
        keep = keep.view(-1, *([1] * (x.dim() - 1)))
        return x * (torch.rand_like(x) < keep) / keep

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
            f"{n}: rank={s.rank}, alpha={s.alpha}, scaling={s.scaling:.4g}" for n, s in self.specs.items()
        )
        return f"{adapters}, merged={self.merged_adapter!r}" if self.merged else f"{adapters}, merged=False"


class _ABLayer(LoRALayer):
    """A layer whose adapters are pairs of modules: ``lora_A[n]`` (input side) and ``lora_B[n]`` (output side)."""

    lora_A: nn.ModuleDict
    lora_B: nn.ModuleDict

    def _init_containers(self) -> None:
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()

    def _containers(self) -> list[nn.ModuleDict]:
        return [self.lora_A, self.lora_B]

    def _parameters_of(self, name: str) -> dict[str, nn.Parameter]:
        return {f"lora_A.{name}.weight": self.lora_A[name].weight, f"lora_B.{name}.weight": self.lora_B[name].weight}

    def _factor_refs(self, name: str) -> tuple[tuple[dict, str], tuple[dict, str]]:
        return (self.lora_A[name]._parameters, "weight"), (self.lora_B[name]._parameters, "weight")

    @torch.no_grad()
    def _reset(self, name: str, init: Init) -> None:
        if init == "gaussian":
            nn.init.normal_(self.lora_A[name].weight, std=1 / self.specs[name].rank)
        else:
            nn.init.kaiming_uniform_(self.lora_A[name].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[name].weight)


class LoRALinear(_ABLayer):
    """LoRA for ``nn.Linear`` and for ``transformers``' ``Conv1D`` (``fan_in_fan_out=True``: weight is (in, out))."""

    def __init__(self, base_layer: nn.Module, *args, **kwargs) -> None:
        self.fan_in_fan_out = not isinstance(base_layer, nn.Linear)
        super().__init__(base_layer, *args, **kwargs)

    def _create(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        weight = self.base_layer.weight
        in_features, out_features = weight.shape if self.fan_in_fan_out else weight.shape[::-1]
        self.lora_A[name] = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B[name] = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)

    def _delta(self, name: str) -> Tensor:
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        dtype = _compute_dtype(a.dtype)
        delta = (b.to(dtype) @ a.to(dtype)) * self.specs[name].scaling  # (out, in)
        return delta.t() if self.fan_in_fan_out else delta

    def _single(self, x: Tensor, result: Tensor, name: str) -> Tensor:
        lora_a, lora_b = self.factors(name)  # (r, in), (out, r)
        hidden = F.linear(self.lora_dropout[name](x).to(lora_a.dtype), lora_a)  # (..., r)
        return self._add_update(result, hidden, lora_b, self.specs[name].scaling)

    def _routed(self, x: Tensor, result: Tensor, names: list[str], slots: Tensor, host: list[int]) -> Tensor:
        a_t, b_t = self._gathered(names, host)  # (B, in, r), (B, r, out)
        x3 = self._routed_dropout(x, names, slots).to(a_t.dtype).reshape(x.shape[0], -1, x.shape[-1])  # (B, T, in)
        hidden = torch.bmm(x3, a_t)  # (B, T, r)
        return self._add_batched(result, hidden, b_t)


class LoRAEmbedding(LoRALayer):
    """LoRA for ``nn.Embedding``: the update looks up rows of ``A^T`` (V, r) and projects them with ``B``."""

    def __init__(self, base_layer: nn.Embedding, rank: int, alpha: float, dropout: float = 0.0, *args, **kwargs) -> None:
        # Dropout on token ids has no meaning; PEFT ignores it for embeddings too.
        super().__init__(base_layer, rank, alpha, 0.0, *args, **kwargs)

    def add_adapter(self, name: str, rank: int, alpha: float, dropout: float = 0.0, *args, **kwargs) -> None:
        super().add_adapter(name, rank, alpha, 0.0, *args, **kwargs)

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
        dtype = _compute_dtype(a.dtype)
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
        a_t, b_t = self._stacked(names)  # (k+1, V, r), (k+1, r, d)
        vocab = a_t.shape[1]
        table = a_t.reshape(-1, a_t.shape[-1])  # ((k+1) V, r): adapter k's rows at [k V, (k+1) V)
        ids = x + (slots * vocab).view(-1, *([1] * (x.dim() - 1)))  # (B, ...)
        hidden = F.embedding(ids, table, scale_grad_by_freq=self.base_layer.scale_grad_by_freq)  # (B, ..., r)
        padding = self.base_layer.padding_idx
        if padding is not None:  # as padding_idx does: the row is read, but gets no gradient
            hidden = torch.where((x == padding).unsqueeze(-1), hidden.detach(), hidden)
        return self._add_batched(result, hidden.reshape(x.shape[0], -1, hidden.shape[-1]), b_t.index_select(0, slots))


class LoRAConv2d(_ABLayer):
    """LoRA for ``nn.Conv2d`` (groups=1): ``A`` has the base kernel, stride and padding; ``B`` is 1x1.

    A mixed batch runs one segment per adapter it uses (convolutions have no batched-weight form in PyTorch).
    """

    def _create(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        base = self.base_layer
        self.lora_A[name] = nn.Conv2d(
            base.in_channels, rank, base.kernel_size, base.stride, base.padding, base.dilation, bias=False,
            padding_mode=base.padding_mode, device=device, dtype=dtype,
        )
        self.lora_B[name] = nn.Conv2d(rank, base.out_channels, 1, bias=False, device=device, dtype=dtype)

    def _delta(self, name: str) -> Tensor:
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        dtype = _compute_dtype(a.dtype)
        a, b = a.to(dtype), b.to(dtype).flatten(1)  # (r, in, kh, kw), (out, r)
        return (b @ a.flatten(1)).view(b.shape[0], *a.shape[1:]) * self.specs[name].scaling  # (out, in, kh, kw)

    def _single(self, x: Tensor, result: Tensor, name: str) -> Tensor:
        lora_a = self.lora_A[name]
        update = self.lora_B[name](lora_a(self.lora_dropout[name](x).to(lora_a.weight.dtype)))  # (B, out, H', W')
        return result + (update * self.specs[name].scaling).to(result.dtype)


def _unmerged_state(module: LoRALayer, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: a merged layer reports its unmerged base weight, so no state holds ``W + delta``."""
    key = f"{prefix}base_layer.weight"
    if module.merged and key in state_dict:
        weight = module.base_layer.weight
        with torch.no_grad():
            restored = weight.to(_compute_dtype(weight.dtype)) - module.delta_weight(module.merged_adapter)
            state_dict[key] = restored.to(weight.dtype)


_LEGACY_KEYS = ("lora_A.weight", "lora_B.weight", "lora_embedding_A", "lora_embedding_B")


def _unmerge_before_load(module: LoRALayer, state_dict: dict, prefix: str, *args) -> None:
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


def _remerge_after_load(module: LoRALayer, incompatible_keys) -> None:
    module._forget_cached_tensors()
    if module._remerge_after_load is not None:
        name, module._remerge_after_load = module._remerge_after_load, None
        module.merge(name)
