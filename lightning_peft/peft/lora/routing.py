"""The routed path of LoRA layers: which adapter each sample uses, and the per-sample (mixed-batch) update.

Mixed-adapter batches: Chen et al., "Punica: Multi-Tenant LoRA Serving", arXiv:2310.18547 (the gathered batched
matmul); Sheng et al., "S-LoRA: Serving Thousands of Concurrent LoRA Adapters", arXiv:2311.03285.

Which adapter runs is decided by one [`Routing`][lightning_peft.peft.Routing] object shared by every LoRA layer of a
model, so switching is one attribute write, whatever the number of layers:

- ``routing.active``: the adapter every sample uses (a layer without that adapter runs its base only);
- ``routing.disabled``: the base only;
- ``routing.route_to(names)``: one adapter name (or None, the base) per sample of the batch. A mixed batch is
  computed in one pass: the adapters the batch uses are stacked (ranks padded with zeros, the scale folded into
  ``B``), each sample's ``A`` and ``B`` gathered, and the low-rank path run as two batched matmuls, so the cost does
  not grow with the number of adapters in the batch or loaded. Only the adapters the batch uses enter the stack, so
  the others get no gradient (``grad`` stays None) and an optimizer step leaves them untouched.
- ``routing.route_to(names, cu_seqlens)``: a packed ``(1, T)`` batch, ``names[i]`` the adapter of row ``i``: each
  token takes its row's adapter (`RoutedPath._packed`).

`RoutedPath` holds the mixed-batch update that every [`LoRALayer`][lightning_peft.peft.LoRALayer] inherits (shapes as in
`lightning_peft.peft.lora.layer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._packed import check_bounds, row_of_token, sorted_tokens, token_layout
from ..adapter import DEFAULT
from . import variants


class Routing:
    """Which adapter each sample uses; one object shared by every LoRA layer of a model.

    Attributes:
        active: The adapter every sample uses outside a routed batch (None: the base only).
        disabled: Every layer runs its base only.
        names: Inside [`route_to`][lightning_peft.peft.Routing.route_to]: one adapter name (or None) per sample (per
            packed row with ``cu_seqlens``); else None.
        cu_seqlens: A packed batch's row boundaries (N + 1 ints), or None.
    """

    def __init__(self, active: str | None = DEFAULT) -> None:
        self.active = active
        self.disabled = False
        self.names: tuple[str | None, ...] | None = None
        self._used: tuple[str, ...] = ()
        self._slots: Tensor | None = None  # (B,) position of each sample's adapter in _used; len(_used) = none
        self._positions: list[int] = []  # the same as a list
        self._cache: dict[tuple, object] = {}
        self.merged: dict[str, int] = {}  # adapter name -> number of layers holding it merged
        self.cu_seqlens: tuple[int, ...] | None = None  # a packed batch's row boundaries (N + 1,): names are rows

    @property
    def merged_adapter(self) -> str | None:
        """The adapter merged into base weights somewhere in the model, if any (one at a time)."""
        return next((name for name, count in self.merged.items() if count > 0), None)

    def route_to(self, names: Sequence[str | None] | None, cu_seqlens: Tensor | Sequence[int] | None = None) -> None:
        """Give sample ``i`` of the next batches adapter ``names[i]`` (None: the base); ``None`` ends routing. With
        ``cu_seqlens`` (the ``(N + 1,)`` row boundaries of a packed ``(1, T)`` batch), ``names[i]`` is packed row
        ``i``'s adapter, and layers route per token. Bad boundaries raise ``ValueError`` before anything changes.
        """
        bounds = None if cu_seqlens is None else check_bounds(cu_seqlens, None if names is None else len(names))
        self._cache = {}
        self.cu_seqlens = bounds
        if names is None:
            self.names, self._used, self._slots, self._positions = None, (), None, []
            return
        self.names = tuple(names)
        self._used = tuple(dict.fromkeys(n for n in self.names if n is not None))
        position = {n: i for i, n in enumerate(self._used)}
        self._positions = [position.get(n, len(self._used)) for n in self.names]  # (B,) as a list
        self._slots = torch.tensor(self._positions, dtype=torch.long)

    def base_samples(self) -> bool | list[bool] | Tensor:
        """`modules_to_save.BaseSamples`: disabled, every sample gets the base output; routed, those routed to None
        (in a packed batch: a (T,) flag per token, the flag of its row)."""
        if self.disabled or self.names is None or None not in self.names:
            return self.disabled
        flags = [n is None for n in self.names]
        return flags if self.cu_seqlens is None else self.per_token(flags, torch.device("cpu"))

    def per_token(self, values: Sequence, device: torch.device) -> Tensor:
        """``values`` (one per packed row) repeated for every token of its row: (T,) on ``device``."""
        key = ("rows", device)
        if key not in self._cache:
            self._cache[key] = row_of_token(self.cu_seqlens).to(device)
        return torch.tensor(values, device=device)[self._cache[key]]

    def segments(self, adapters: Sequence[str], device: torch.device) -> tuple[list[str], Tensor | None, list[int]] | None:
        """For a layer holding ``adapters``, in a packed batch: the used adapters it has (``here``), the tokens
        routed to them sorted by adapter (``order`` (T_used,) on ``device``: adapter ``here[k]``'s ``counts[k]``
        tokens after those of ``here[:k]``; None when every token uses ``here[0]``), and ``counts``. None when no
        token uses an adapter here. Computed once per ``route_to`` and layer signature, as `select`.
        """
        key = ("tokens", tuple(adapters), device)
        if key not in self._cache:
            here = [n for n in self._used if n in adapters]
            position = {n: i for i, n in enumerate(here)}
            slots = [position.get(n, len(here)) for n in self.names]  # (N,): len(here) = no adapter here
            order, counts = sorted_tokens(slots, self.cu_seqlens, len(here)) if here else (None, [])
            self._cache[key] = (here, None if order is None else order.to(device), counts) if here else None
        return self._cache[key]

    def select(
        self, adapters: Sequence[str], device: torch.device
    ) -> tuple[list[str], Tensor, list[int]] | None:
        """For a layer holding ``adapters``: the used adapters it has, and each sample's slot among them (a tensor
        on ``device`` and the same as a list, so that layers gather without reading the device back).

        Slot ``len(names)`` stands for "no adapter here" (a None sample, or an adapter this layer lacks). Returns None
        when no sample uses an adapter of this layer. The slots depend only on the routing, so they are computed once
        per [`route_to`][lightning_peft.peft.Routing.route_to] and layer signature.
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


class RoutedPath:
    """The update of a mixed batch (one adapter per sample), for [`LoRALayer`][lightning_peft.peft.LoRALayer].

    It reads the layer's ``specs``, ``factors``, ``lora_dropout`` and ``_single``; its `_may_overwrite` serves the
    layer's single-adapter update (`LoRALayer._add_update`) too.
    """

    #: How many trailing dimensions of an input are features, after its tokens (Linear: 1, Embedding: 0). None: the
    #: input is not one entry per token (a convolution's), so a packed batch can route it to one adapter only.
    token_features: ClassVar[int | None] = 1

    def _packed(self, x: Tensor, result: Tensor, routing: Routing) -> Tensor:
        """The update of a packed batch (`Routing.route_to` with ``cu_seqlens``): every token its row's adapter.

        As S-LoRA's segments: the tokens, sorted by adapter once per ``route_to`` (`Routing.segments`), are gathered
        in one copy, each adapter's contiguous run of them takes its single-adapter update (`_single` on zeros: its
        own dropout, scale, bias), and the updates are added back at their positions in one ``index_add``. The
        factors are read as they are (no per-token copy), and the number of operations does not grow with the rows.
        """
        lead = token_layout(x, routing.cu_seqlens, self.token_features, f"{type(self).__name__} ({self.base_layer})")
        segments = routing.segments(self.adapter_names, x.device)
        if segments is None:
            return result
        names, order, counts = segments
        variants.refuse_routing([n for n in names if self.specs[n].variant is not None])
        if order is None:  # every token uses one adapter here
            return self._single(x, result, names[0])
        if self.token_features is None:
            raise ValueError(f"route_adapters(cu_seqlens=...): the packed rows go to adapters {names} at "
                             f"{type(self).__name__} ({self.base_layer}), whose input is not one entry per token (a "
                             "convolution mixes neighbouring positions, across rows too). Route the packed batch to one "
                             "adapter here, leave convolutions out of the adapters' target_modules, or route padded "
                             "batches (one adapter per sample, without cu_seqlens).")
        tokens = routing.cu_seqlens[-1]
        x2, r2 = x.reshape(tokens, *x.shape[lead:]), result.reshape(tokens, *result.shape[lead:])  # (T, ...)
        xs = x2.index_select(0, order)  # (T_used, ...), sorted by adapter
        updates = torch.cat([self._single(xk, r2.new_zeros(len(xk), *r2.shape[1:]), n)
                             for n, xk in zip(names, xs.split(counts))])
        add = r2.index_add_ if self._may_overwrite(result) else r2.index_add
        return add(0, order, updates).view(result.shape)

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

    # --- the gathered per-sample factors (r32/mixdecode) ----------------------------------------------------------
    def _gathered(self, names: list[str], host: list[int]) -> tuple[Tensor, Tensor, float | Tensor]:
        """Each sample's ``A`` (B, r, in) and ``B`` (B, out, r) (ranks padded to the largest; zeros for a sample
        without an adapter here) and the scale (a number, or (B, 1, 1)). Gathered from the parameters every forward
        (no cache keyed on them sees a fused optimizer step or a write through ``.data``), in their own layout: a
        stack of transposes copies element by element (2-4x the time at decode shapes); matmuls read them transposed."""
        _, direct, scale = self._plan(names, host)
        if direct is None:  # ranks differ, or a sample has no adapter here
            a_rows, b_cols = self._padded(names)
            direct = [(a_rows, s) for s in host], [(b_cols, s) for s in host]
        return torch.stack([h[k] for h, k in direct[0]]), torch.stack([h[k] for h, k in direct[1]]), scale

    def _plan(self, names: list[str], host: list[int]) -> tuple[bool, tuple[list, list] | None, float | Tensor]:
        """``(bias, direct, scale)``: any ``lora_bias`` here; each sample's ``(dict, key)`` of ``A`` and ``B`` (None
        unless ranks are equal and every sample has an adapter here); the common scale, else each sample's (B, 1, 1).
        Once per routing (``host`` is `Routing.select`'s), not per forward: at one token per sample it cost as much
        as the matmuls. Forgotten with the factors (`_forget_cached_tensors`)."""
        if self.__dict__.get("_routed_plan", (None,))[0] is not host:
            specs, refs = [self.specs[n] for n in names], [self._refs(n) for n in names]
            scales = [s.scaling for s in specs] + [0.0]
            weight = self.factors(names[0])[0]  # samples without an adapter have zero factors: any scale fits them
            scale = scales[0] if len(set(scales[:-1])) == 1 else torch.tensor(
                [scales[s] for s in host], dtype=weight.dtype, device=weight.device).view(-1, 1, 1)  # (B, 1, 1)
            equal = len({s.rank for s in specs}) == 1 and len(names) not in host
            direct = ([refs[s][0] for s in host], [refs[s][1] for s in host]) if equal else None
            self.__dict__["_routed_plan"] = (host, (any(s.lora_bias for s in specs), direct, scale))
        return self.__dict__["_routed_plan"][1]

    def _add_batched(self, result: Tensor, hidden: Tensor, b_t: Tensor, scale: float | Tensor = 1.0) -> Tensor:
        """``result + scale * hidden @ b_t`` per sample: ``hidden`` (B, T, r), ``b_t`` (B, r, out), ``result``
        (B, ..., out), ``scale`` a number or (B, 1, 1). One fused ``baddbmm`` when dtypes agree and autocast is off
        (as `_add_update` fuses ``addmm``)."""
        if isinstance(scale, Tensor):
            hidden, scale = hidden * scale, 1.0  # (B, T, r): the smallest tensor the per-sample scale can go on
        if hidden.dtype == result.dtype == b_t.dtype and not torch.is_autocast_enabled(result.device.type):  # fuse
            result3 = result.reshape(hidden.shape[0], -1, result.shape[-1])  # (B, T, out)
            if self._may_overwrite(result):
                return result3.baddbmm_(hidden, b_t, alpha=scale).view(result.shape)
            return torch.baddbmm(result3, hidden, b_t, alpha=scale).view(result.shape)
        return result + (torch.bmm(hidden, b_t) * scale).view(result.shape).to(result.dtype)

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
