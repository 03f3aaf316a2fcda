"""Many named LoRA adapters on one base model: add, switch, disable, delete, route per sample, combine.

One base model carries any number of LoRA adapters (one per customer, task or domain), each with its own targets, rank
and alpha ([`add_adapter`][lightning_peft.peft.add_adapter]). Switching
([`set_adapter`][lightning_peft.peft.set_adapter]) writes one attribute of the [`Routing`][lightning_peft.peft.Routing]
object that every LoRA layer of the model shares: constant time, no copy of the base. Inside
[`route_adapters`][lightning_peft.peft.route_adapters] each sample of a batch gets its own adapter, in training as in
inference: the low-rank path of the mixed batch is one gather of each sample's ``A`` and ``B`` and two batched matmuls
per layer (Punica's BGMV, arXiv:2310.18547), so the cost does not grow with the number of adapters in the batch or
loaded. Only the adapters a batch uses receive gradients (the others keep ``grad=None``, so optimizers such as AdamW
skip them: no momentum, no weight decay); this relies on gradients being reset to None between steps, which is the
default of ``Optimizer.zero_grad`` and of Lightning.

Shared by all named adapters of a model: ``modules_to_save`` (declared with the first adapter) and trained biases
(``bias`` must be ``"none"`` once a model has several adapters).

[`combine_adapters`][lightning_peft.peft.combine_adapters] builds a new adapter from ``{source: weight}``. Each method's
definition (``s_i`` the source's scale, ``w_i`` its weight; the new adapter has scale 1, i.e. ``alpha = rank``):

| method | new factors, per adapted layer | rank |
| --- | --- | --- |
| linear | ``A = sum_i c_i A_i``, ``B = sum_i sign(w_i) c_i B_i``, ``c_i = sqrt(|w_i| s_i)`` (as Hugging Face PEFT's ``add_weighted_adapter``; not the weighted sum of the deltas) | the sources' (equal) rank |
| cat | ``A = [w_1 s_1 A_1; w_2 s_2 A_2; ...]``, ``B = [B_1, B_2, ...]``: exactly ``delta = sum_i w_i delta_i`` | the sum of the ranks |
| svd | ``U S V^T = sum_i w_i delta_i``; ``B = U_r S_r``, ``A = V_r^T``: the best rank-``r`` approximation of the weighted delta | ``rank`` (default: the largest source rank) |

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_peft.peft import add_adapter, inject_lora, route_adapters, set_adapter, active_adapter
    >>> model = nn.Sequential(nn.Linear(4, 4))
    >>> _ = inject_lora(model, rank=2, target_modules=["0"], adapter_name="a")
    >>> _ = add_adapter(model, "b", rank=4, target_modules=["0"])
    >>> set_adapter(model, "b"); active_adapter(model)
    'b'
    >>> with route_adapters(model, ["a", None, "b"]):
    ...     model(torch.randn(3, 4)).shape
    torch.Size([3, 4])
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from ..._checks import integer
from .._common import exact_choice
from ..adapter import unwrap
from .config import LoRAConfig
from .layer import LoRALayer, Routing, require_spec
from .mha import LoRAMultiheadAttention
from .model import LoRAAdapter, add_adapter
from .targets import adaptable_modules
from .variants import refuse_routing

Method = Literal["linear", "cat", "svd"]


def _known(spec: LoRAAdapter, name: object, who: str) -> str:
    if name not in spec.adapters:
        raise ValueError(f"{who}: no adapter named {name!r}; the model has {list(spec.adapters)}.")
    return name


def _merged(model: nn.Module) -> str | None:
    return require_spec(model, "LoRA").routing.merged_adapter


def set_adapter(model: nn.Module, name: str) -> None:
    """Make ``name`` the adapter every sample uses from now on (constant time: one attribute write).

    Raises:
        ValueError: If ``name`` names no adapter.
        RuntimeError: If another adapter is merged into the base weights.
    """
    spec = require_spec(model, "set_adapter")
    _known(spec, name, "set_adapter")
    merged = _merged(unwrap(model))
    if merged is not None and merged != name:
        raise RuntimeError(f"set_adapter({name!r}): adapter {merged!r} is merged; call unmerge_lora(model) first.")
    spec.routing.active = name


def active_adapter(model: nn.Module) -> str | None:
    """The name of the adapter every sample uses outside [`route_adapters`][lightning_peft.peft.route_adapters]."""
    return require_spec(model, "active_adapter").routing.active


def delete_adapter(model: nn.Module, name: str) -> None:
    """Remove adapter ``name``: its parameters are gone, and layers left without adapters become plain modules.

    Raises:
        ValueError: If ``name`` names no adapter.
        RuntimeError: If it is the active adapter, the only one, or merged.
    """
    require_spec(model, "delete_adapter").remove(model, name)


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it the model computes the exact base output (every LoRA layer skips its adapters).

    Raises:
        RuntimeError: If an adapter is merged into the base weights (the base output is then not available).
    """
    routing, before = switch_off(model, "disable_adapters")
    try:
        yield
    finally:
        routing.disabled = before


def switch_off(model: nn.Module, who: str) -> tuple[Routing, bool]:
    """Turn every adapter of ``model`` off (the base output); returns the routing and whether they were off before.

    Raises:
        RuntimeError: If an adapter is merged into the base weights.
    """
    spec = require_spec(model, who)
    merged = _merged(unwrap(model))
    if merged is not None:
        raise RuntimeError(f"{who}: adapter {merged!r} is merged into the base weights; call unmerge_lora(model) "
                           "first.")
    before = spec.routing.disabled
    spec.routing.disabled = True
    return spec.routing, before


@contextlib.contextmanager
def route_adapters(model: nn.Module, names: Sequence[str | None],
                   cu_seqlens: Tensor | Sequence[int] | None = None) -> Iterator[None]:
    """Context manager: per-sample routing. ``names[i]`` is the adapter of sample ``i`` (None: the base only).

    Forward passes inside it, in training as in inference, give each sample the output (and the gradients) it gets
    alone with its adapter. Every LoRA layer checks that its input's first dimension has ``len(names)`` samples.

    With ``cu_seqlens`` (the ``(N + 1,)`` row boundaries of a packed ``(1, T)`` batch, as ``SFTDataModule`` writes
    them), ``names[i]`` is packed row ``i``'s adapter: every LoRA layer, trainable token and ``modules_to_save``
    module follows it per token, so each row gets what it gets alone where the model keeps rows apart (``docs/sft.md``).

    Raises:
        ValueError: If a name is unknown, ``names`` is not a sequence of names, or ``cu_seqlens`` is not
            ``len(names) + 1`` increasing integers from 0.
        RuntimeError: If an adapter is merged into the base weights.
    """
    spec = require_spec(model, "route_adapters")
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise ValueError(
            f"route_adapters(names={names!r}): give one adapter name (or None) per sample of the batch, as a list."
        )
    unknown = sorted({repr(n) for n in names if n is not None and n not in spec.adapters})
    if unknown:
        raise ValueError(f"route_adapters: unknown adapter name {unknown[0]} in the batch; the model has "
                         f"{list(spec.adapters)} (None means the base model).")
    refuse_routing([n for n in dict.fromkeys(names) if n is not None and spec.adapters[n][0].use_dora])
    whole = [n for n in dict.fromkeys(names) if n is not None and spec.adapters[n][0].target_parameters]
    if whole and len(set(names)) > 1:
        raise ValueError(
            f"route_adapters: adapter {whole[0]!r} adapts parameters (target_parameters), which their module reads "
            f"once for the whole batch, so the batch cannot mix it with {sorted(set(names) - {whole[0]}, key=str)} "
            "(PEFT refuses such mixed batches too). Route the batch to one adapter, or split it by adapter."
        )
    merged = _merged(unwrap(model))
    if merged is not None:
        raise RuntimeError(f"route_adapters: adapter {merged!r} is merged into the base weights; call "
                           "unmerge_lora(model) first.")
    routing = spec.routing
    before = routing.names, routing.cu_seqlens
    routing.route_to(names, cu_seqlens)
    try:
        yield
    finally:
        routing.route_to(*before)


def combine_adapters(
    model: nn.Module,
    weights: Mapping[str, float],
    name: str,
    method: Method = "linear",
    rank: int | None = None,
) -> dict[str, LoRALayer]:
    """Add adapter ``name`` built from ``{source adapter: weight}`` (definitions in the module docstring).

    The new adapter adapts every module any source adapts; it is not made active.

    Raises:
        ValueError: If a source is unknown, ``name`` is taken, the method is unknown, ``rank`` is given for a method
            other than ``"svd"``, or the sources' ranks differ for ``"linear"``.
    """
    spec = require_spec(model, "combine_adapters")
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(f"combine_adapters(weights={weights!r}): give a non-empty dict {{adapter name: weight}}.")
    for source, weight in weights.items():
        _known(spec, source, "combine_adapters")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"combine_adapters: weight {weight!r} of {source!r} must be a finite number.")
    if method not in ("linear", "cat", "svd"):
        raise ValueError(f"combine_adapters(method={method!r}): method must be 'linear', 'cat' or 'svd'.")
    if rank is not None and method != "svd":
        raise ValueError(f"combine_adapters(rank={rank}): rank is chosen by method={method!r}; only 'svd' takes rank.")
    whole = [s for s in weights if spec.adapters[s][0].target_parameters]
    if whole:
        raise ValueError(f"combine_adapters: source {whole[0]!r} adapts parameters (target_parameters); their "
                         "factors hold one update per expert, which this does not combine (PEFT refuses too).")
    dora = [s for s in weights if spec.adapters[s][0].use_dora]
    if dora:
        raise ValueError(f"combine_adapters: source {dora[0]!r} is a DoRA adapter (use_dora=True); its magnitudes do "
                         "not combine linearly, so only LoRA adapters can be combined.")
    tokens = [s for s in weights if spec.adapters[s][0].trainable_token_indices is not None]
    if tokens:
        raise ValueError(f"combine_adapters: source {tokens[0]!r} trains token rows (trainable_token_indices); rows "
                         "replace the base's rather than add to it, so they do not combine. Combine adapters "
                         "without trainable tokens.")
    biased = [s for s in weights if spec.adapters[s][0].lora_bias]
    if biased:
        raise ValueError(f"combine_adapters: source {biased[0]!r} has lora_bias=True; B's biases have no low-rank "
                         "combination, so only adapters without lora_bias can be combined.")
    model = unwrap(model)
    layers = {t: model.get_submodule(t) for t in spec.targets if any(s in model.get_submodule(t).specs for s in weights)}
    attention = [t for t, layer in layers.items() if isinstance(layer, LoRAMultiheadAttention)]
    if attention:
        raise TypeError(f"combine_adapters: {attention[0]!r} is an nn.MultiheadAttention layer, whose two factor pairs "
                        "are not combined; combine adapters that leave the attention modules out.")
    grouped = [t for t, layer in layers.items() if getattr(layer.base_layer, "groups", 1) > 1]
    if grouped and method != "linear":
        raise ValueError(f"combine_adapters(method={method!r}): {grouped[0]!r} is a grouped convolution, whose B "
                         "splits the rank into groups, so the ranks cannot be concatenated or re-factored there; use "
                         "method='linear', or combine adapters that leave it out.")
    ranks = {t: _combined_rank(t, layer, weights, method, rank) for t, layer in layers.items()}
    common = max(set(ranks.values()), key=list(ranks.values()).count)
    pattern = {re.escape(t): r for t, r in ranks.items() if r != common}
    config = LoRAConfig(
        rank=common, alpha=common, rank_pattern=pattern, alpha_pattern=dict(pattern),
        target_modules=exact_choice(list(layers), list(adaptable_modules(model))),
        modules_to_save=list(spec.modules_to_save),
    )
    added = add_adapter(model, name, config)
    with torch.no_grad():
        for target, layer in layers.items():
            a, b = _combined_factors(layer, weights, method, ranks[target])
            _set_factors(layer, name, a, b)
    return added


def _combined_rank(target: str, layer: LoRALayer, weights: Mapping[str, float], method: str, rank: int | None) -> int:
    """The new adapter's rank at ``layer``: alpha is set equal to it, so the new adapter's scale is 1."""
    ranks = {s: layer.specs[s].rank for s in weights if s in layer.specs}
    if method == "linear":
        if len(set(ranks.values())) > 1:
            raise ValueError(
                f"combine_adapters(method='linear'): the sources have different ranks at {target!r} ({ranks}); "
                "'linear' adds the factors, so they need equal ranks. Use method='cat' (ranks add) or 'svd'."
            )
        return next(iter(ranks.values()))
    if method == "cat":
        return sum(ranks.values())
    if rank is None:
        return max(ranks.values())
    return integer("combine_adapters", "rank", rank, minimum=1, example="8")


def _factors(layer: LoRALayer, name: str) -> tuple[Tensor, Tensor]:
    """``A`` (r, in_flat) and ``B`` (out, r) of adapter ``name``, as matrices, in float64."""
    params = list(layer.adapter_parameters(name).values())
    a, b = params[0].double(), params[1].double()
    return a.flatten(1), b.flatten(1)


def _combined_factors(layer: LoRALayer, weights: Mapping[str, float], method: str, rank: int) -> tuple[Tensor, Tensor]:
    sources = [(s, w) for s, w in weights.items() if s in layer.specs]
    if method == "svd":
        delta = sum(w * _delta_matrix(layer, s) for s, w in sources)  # (out, in_flat)
        u, sigma, vh = torch.linalg.svd(delta, full_matrices=False)
        r = min(rank, sigma.numel())
        a = delta.new_zeros(rank, delta.shape[1])
        b = delta.new_zeros(delta.shape[0], rank)
        a[:r], b[:, :r] = vh[:r], u[:, :r] * sigma[:r]
        return a, b
    if method == "linear":
        a = b = 0
        for s, w in sources:
            c = math.sqrt(abs(w) * layer.specs[s].scaling)
            fa, fb = _factors(layer, s)
            a, b = a + c * fa, b + math.copysign(c, w) * fb
        return a, b
    a_blocks, b_blocks = [], []
    for s, w in sources:
        fa, fb = _factors(layer, s)
        a_blocks.append(w * layer.specs[s].scaling * fa)
        b_blocks.append(fb)
    return torch.cat(a_blocks), torch.cat(b_blocks, dim=1)


def _delta_matrix(layer: LoRALayer, name: str) -> Tensor:
    """``s B A`` of adapter ``name`` as an (out, in_flat) matrix in float64."""
    a, b = _factors(layer, name)
    return layer.specs[name].scaling * b @ a


def _set_factors(layer: LoRALayer, name: str, a: Tensor, b: Tensor) -> None:
    """Write (r, in_flat) ``a`` and (out, r) ``b`` into adapter ``name`` of ``layer``, in its own layout
    (Linear and Embedding factors are these matrices; convolutions' are their reshapes)."""
    pa, pb = list(layer.adapter_parameters(name).values())
    pa.copy_(a.reshape(pa.shape).to(pa.dtype))
    pb.copy_(b.reshape(pb.shape).to(pb.dtype))
