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

from .._packed import check_bounds, row_of_token, runs, token_layout
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

    def runs(self, adapters: Sequence[str]) -> list[tuple[str | None, int]] | None:
        """For a layer holding ``adapters``, in a packed batch: ``(adapter, tokens)`` of each run of consecutive rows
        that use the same adapter here (None: none here), in order; None when no row uses an adapter here. Computed
        once per ``route_to`` and layer signature, as `select`."""
        key = ("runs", tuple(adapters))
        if key not in self._cache:
            here = [n if n in adapters else None for n in self.names]
            self._cache[key] = runs(here, self.cu_seqlens) if any(here) else None
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

        Rows are contiguous, so each run of rows that share an adapter (`Routing.runs`) is a slice of the tokens: it
        takes that adapter's single-adapter update (`_single`: its own dropout, scale, bias) on views of the input
        and the base output, and the runs are concatenated back. No gather, no per-token copy of the factors: the
        cost is the single-adapter update plus one copy of the output.
        """
        lead = token_layout(x, routing.cu_seqlens, self.token_features, f"{type(self).__name__} ({self.base_layer})")
        parts = routing.runs(self.adapter_names)
        if parts is None:
            return result
        variants.refuse_routing([n for n, _ in parts if n is not None and self.specs[n].variant is not None])
        if len(parts) == 1:  # every token uses one adapter here
            return self._single(x, result, parts[0][0])
        if self.token_features is None:
            raise ValueError(
                f"route_adapters(cu_seqlens=...): the packed rows go to adapters "
                f"{sorted({n for n, _ in parts if n is not None})} at {type(self).__name__} ({self.base_layer}), whose input "
                "is not one entry per token (a convolution mixes neighbouring positions, across row boundaries too), "
                "so it cannot take an adapter per token. Route the packed batch to one adapter here, leave "
                "convolutions out of the adapters' target_modules, or route padded batches (one adapter per sample, "
                "without cu_seqlens)."
            )
        tokens, lengths = routing.cu_seqlens[-1], [n for _, n in parts]
        x2, r2 = x.reshape(tokens, *x.shape[lead:]), result.reshape(tokens, *result.shape[lead:])  # (T, ...)
        out = [rk if n is None else self._single(xk, rk, n)
               for (n, _), xk, rk in zip(parts, x2.split(lengths), r2.split(lengths))]
        return torch.cat(out).view(result.shape)

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

        Built every forward (see `_gathered`): only the adapters the batch uses.
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

        One fused ``baddbmm`` when dtypes agree and autocast is off (as `_add_update` fuses ``addmm``).
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
