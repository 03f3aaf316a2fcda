"""LoRA layers: a frozen base module plus trainable low-rank updates, one per named adapter.

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
| DoRA (Linear, Conv1D) | as above | and ``lora_magnitude_vector.n`` (out,) (`lora_dora`) |
| ``nn.Embedding(V, d)`` | (V, d) | ``lora_embedding_A.n`` (r, V), ``lora_embedding_B.n`` (d, r) |
| ``nn.Conv2d(in, out, k)`` | (out, in, kh, kw) | ``lora_A.n``: Conv2d(in, r, k), ``lora_B.n``: Conv2d(r, out, 1) |

Which adapter runs is decided by one [`Routing`][lightning_peft.peft.Routing] object shared by every LoRA layer of a
model (one adapter for all samples, none, or one per sample: see `lightning_peft.peft.lora_routing`).

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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import lora_dora
from ._common import dense_weight
from .adapter import attached, unwrap
from .lora_layer import AdapterSpec, Init, LoRALayer, _compute_dtype  # noqa: F401 (re-exported)
from .lora_routing import DEFAULT, Routing  # noqa: F401 (re-exported: lightning_peft.peft.layers.Routing)

__all__ = ["DEFAULT", "AdapterSpec", "Init", "LoRAConv2d", "LoRAEmbedding", "LoRALayer", "LoRALinear", "Routing",
           "conv1d_type", "lora_layers", "lora_spec", "make_layer", "require_spec"]


def conv1d_type() -> type | None:
    """The ``transformers`` ``Conv1D`` class if ``transformers`` is already imported, else None.

    A model can only contain a ``Conv1D`` once ``transformers`` is imported, so this never imports it.
    """
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def lora_layers(model: nn.Module) -> dict[str, LoRALayer]:
    """All LoRA layers of ``model`` by full module name."""
    return {name: m for name, m in unwrap(model).named_modules() if isinstance(m, LoRALayer)}


def lora_spec(model: nn.Module):
    """The [`LoRAAdapter`][lightning_peft.peft.LoRAAdapter] [`inject_lora`][lightning_peft.peft.inject_lora] left on
    ``model``, or None."""
    return attached(model).get("lora")


def require_spec(model: nn.Module, who: str):
    """`lora_spec`, raising if ``model`` has no LoRA adapter."""
    spec = lora_spec(model)
    if spec is None:
        raise RuntimeError(
            f"{who}: {type(unwrap(model)).__name__} has no LoRA adapter; call inject_lora(model, ...) first."
        )
    return spec


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
    """LoRA for ``nn.Linear`` and for ``transformers``' ``Conv1D`` (``fan_in_fan_out=True``: weight is (in, out)),
    and DoRA for both (an adapter added with ``use_dora=True``: `lightning_peft.peft.lora_dora`)."""

    supports_dora = True

    # A column-wise base (output dim split): B (out, r) splits with it, A replicated; a row-wise base (input dim
    # split): A (r, in) splits with it, B replicated (lightning_peft.parallel.tensor_parallel).
    tensor_parallel_split = {"colwise": "lora_B", "rowwise": "lora_A"}

    def __init__(self, base_layer: nn.Module, *args, **kwargs) -> None:
        self.fan_in_fan_out = not isinstance(base_layer, nn.Linear)
        self._dora_norms: dict[str, Tensor] = {}
        super().__init__(base_layer, *args, **kwargs)

    def _create_factors(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        base = self.base_layer
        if isinstance(base, nn.Linear):  # (a bitsandbytes Linear4bit packs its weight: its shape is not (out, in))
            in_features, out_features = base.in_features, base.out_features
        else:
            in_features, out_features = base.weight.shape
        self.lora_A[name] = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B[name] = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)

    def _delta(self, name: str) -> Tensor:
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        dtype = _compute_dtype(a.dtype)
        delta = (b.to(dtype) @ a.to(dtype)) * self.specs[name].scaling  # (out, in)
        return delta.t() if self.fan_in_fan_out else delta

    # --- DoRA (lightning_peft.peft.lora_dora): a magnitude (out,) per DoRA adapter --------------------------------

    def _init_containers(self) -> None:
        super()._init_containers()
        self.lora_magnitude_vector = nn.ParameterDict()

    def _create(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self._create_factors(name, rank, device, dtype)
        if self.specs[name].use_dora:
            out_features = self.lora_B[name].weight.shape[0]
            self.lora_magnitude_vector[name] = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))

    def _parameters_of(self, name: str) -> dict[str, nn.Parameter]:
        params = super()._parameters_of(name)
        if name in self.lora_magnitude_vector:
            params[f"lora_magnitude_vector.{name}"] = self.lora_magnitude_vector[name]
        return params

    @torch.no_grad()
    def _reset(self, name: str, init: Init) -> None:
        super()._reset(name, init)
        if name in self.lora_magnitude_vector:  # ||W + s B A|| = ||W||: the layer starts equal to its base
            a, b = self.factors(name)
            weight = dense_weight(self.base_layer.weight, self.base_layer)
            norm = lora_dora.row_norm(weight, a, b, self.specs[name].scaling, self.fan_in_fan_out)
            self.lora_magnitude_vector[name].copy_(norm)

    def delete_adapter(self, name: str) -> None:
        super().delete_adapter(name)
        if name in self.lora_magnitude_vector:
            del self.lora_magnitude_vector[name]

    def _with_update(self, weight: Tensor, name: str) -> Tensor:
        if not self.specs[name].use_dora:
            return super()._with_update(weight, name)
        merged, norm = lora_dora.merged(weight, self.delta_weight(name), self.lora_magnitude_vector[name],
                                        self.fan_in_fan_out)
        self._dora_norms[name] = norm  # unmerging needs the n of the unmerged weight (PEFT records it too)
        return merged

    def _without_update(self, weight: Tensor, name: str) -> Tensor:
        if not self.specs[name].use_dora:
            return super()._without_update(weight, name)
        return lora_dora.unmerged(weight, self.delta_weight(name), self.lora_magnitude_vector[name],
                                  self._dora_norms[name], self.fan_in_fan_out)

    def _single(self, x: Tensor, result: Tensor, name: str) -> Tensor:
        if self.specs[name].use_dora:
            return lora_dora.dora_forward(self, x, result, name)
        lora_a, lora_b = self.factors(name)  # (r, in), (out, r)
        hidden = F.linear(self.lora_dropout[name](x).to(lora_a.dtype), lora_a)  # (..., r)
        return self._add_update(result, hidden, lora_b, self.specs[name].scaling)

    def _routed(self, x: Tensor, result: Tensor, names: list[str], slots: Tensor, host: list[int]) -> Tensor:
        lora_dora.refuse_routing([n for n in names if n is not None and self.specs[n].use_dora])
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


def make_layer(module: nn.Module, name: str, config, adapter_name: str) -> LoRALayer:
    """The LoRA layer for ``module`` (named ``name`` in the model) with ``config``'s settings (a ``LoRAConfig``)."""
    kwargs = {
        "rank": config.rank_for(name),
        "alpha": config.alpha_for(name),
        "dropout": config.dropout,
        "use_rslora": config.use_rslora,
        "init": config.init,
        "adapter_name": adapter_name,
        "use_dora": config.use_dora,
    }
    if isinstance(module, nn.Embedding):
        return LoRAEmbedding(module, **kwargs)
    if isinstance(module, nn.Conv2d):
        return LoRAConv2d(module, **kwargs)
    return LoRALinear(module, **kwargs)
