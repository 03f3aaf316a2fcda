"""LoRA on ``torch.nn.MultiheadAttention``, as Hugging Face PEFT 0.21 adapts it (``lora.MultiheadAttention``).

Paper: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685. The attention module is
what ViT, CLIP and every ``nn.TransformerEncoderLayer`` use; its forward reads ``in_proj_weight`` (the fused q, k, v
projection, a bare parameter) and ``out_proj.weight`` directly instead of calling layers, so a LoRA update cannot be
added to a layer's output there. One adapter adapts both projections, each with its own factors of the same rank:

```text
in_proj_weight'  = W_in  + s B_in  A_in      W_in (3E, E), A_in (r, E), B_in (3E, r)
out_proj.weight' = W_out + s B_out A_out     W_out (E, E), A_out (r, E), B_out (E, r)
y = MultiheadAttention(query, key, value, ...) computed with the two adapted weights
```

The forward runs the base module with the adapted weights in place of its own (`torch.func.functional_call`): the
base's parameters are never written. Each update counts once, as LoRA defines it; Hugging Face PEFT 0.21 adds the
out-projection's twice (huggingface/peft#3774, `warn_doubled_out_proj`), so its outputs differ. Parameters:
``lora_A.<n>.weight`` / ``lora_B.<n>.weight`` (in-projection) and ``out_proj_lora_A.<n>.weight`` /
``out_proj_lora_B.<n>.weight`` (out-projection); in PEFT's files ``<path>.lora_A.weight`` and
``<path>.base_layer.out_proj.lora_A.weight``, where PEFT keeps the latter.

Limits, as in PEFT: the query, key and value sizes must be equal (``kdim = vdim = embed_dim``: one fused
in-projection); no DoRA; LoRA dropout is not applied (the update enters through the weights, not through a layer
input); no per-sample routing (each sample would need its own attention weights). Trained biases (``bias`` other
than ``"none"``) are refused: PEFT trains and names ``in_proj_bias`` and the out-projection's bias differently.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .._common import compute_dtype
from .layer import LAYER_TYPES, ABLayer, Init

#: PEFT's layer-relative path of our factor containers whose name differs (PEFT wraps ``out_proj`` in a LoRA layer).
PEFT_CONTAINERS = {"out_proj_lora_A": "base_layer.out_proj.lora_A", "out_proj_lora_B": "base_layer.out_proj.lora_B"}
PEFT_OUT_PROJ = ".base_layer.out_proj"  # where PEFT's out-projection factors sit under the module's path


def refuse_unsupported(chosen: list[str], modules: dict[str, nn.Module], config) -> None:
    """Raise, before anything changes, if a chosen ``nn.MultiheadAttention`` cannot be adapted with ``config``."""
    attention = [n for n in chosen if isinstance(modules[n], nn.MultiheadAttention)]
    for name in attention:
        module = modules[name]
        if not module._qkv_same_embed_dim:
            raise TypeError(
                f"LoRA(target_modules={config.target_modules!r}) matched {name!r}, an nn.MultiheadAttention with "
                "separate query, key and value projections "
                f"(embed_dim={module.embed_dim}, kdim={module.kdim}, vdim={module.vdim}); LoRA adapts the fused "
                "in-projection only (kdim = vdim = embed_dim), as Hugging Face PEFT does. Leave it out of "
                "target_modules."
            )
    if attention and config.lora_bias:
        raise ValueError(
            f"LoRA(lora_bias=True) with the nn.MultiheadAttention {attention[0]!r}: PEFT's attention layer has no "
            "lora_bias, so the adapter would have nowhere to live in its files. Use lora_bias=False, or leave the "
            "attention modules out of target_modules (exclude_modules=[...])."
        )
    if attention and config.bias != "none":
        raise ValueError(
            f"LoRA(bias={config.bias!r}) with the nn.MultiheadAttention {attention[0]!r}: its biases (in_proj_bias, "
            "out_proj.bias) are not trained as PEFT trains them, so the adapter would differ. Use bias='none', or "
            "leave the attention modules out of target_modules."
        )


def warn_doubled_out_proj(config: dict, keys: Iterable[str], source: str, adapter_name: str) -> None:
    """Warn, once per file, when a file Hugging Face PEFT wrote (it sets ``peft_version``) adapts an
    ``nn.MultiheadAttention``: PEFT 0.21.2 (and earlier) merges the out-projection's update twice, ``W + 2 s B A``,
    in its forward too (huggingface/peft#3774); this layer adds it once. ``2 B`` here gives PEFT's outputs
    (``s (2B) A = 2 s B A`` exactly, doubling being exact in floating point; PEFT adds ``s B A`` twice, which rounds
    the sum once more)."""
    marker = f"{PEFT_OUT_PROJ}.lora_B"
    layers = sorted({key.partition(marker)[0] for key in keys if marker in key})
    version = config.get("peft_version")
    if version is None or not layers:  # our files have no peft_version, and mean what this layer computes
        return
    warnings.warn(
        f"load_adapter: {source} (peft_version={version!r}) adapts the nn.MultiheadAttention layer(s) "
        f"{', '.join(map(repr, layers))}. Hugging Face PEFT through 0.21.2 applies their out-projection's LoRA update "
        "twice (out_proj.weight + 2*s*B*A, in its forward and merged weights; huggingface/peft#3774); lightning-peft "
        "applies it once, as LoRA defines it (+ s*B*A), so the outputs differ from that PEFT's. To get that PEFT's "
        "outputs, scale each such layer's out-projection B factor by 2 after loading: with torch.no_grad(): "
        f"model.get_submodule(name).out_proj_lora_B[{adapter_name!r}].weight.mul_(2).",
        UserWarning, stacklevel=5,  # load_adapter's caller
    )


def _no_fused_path(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook that does nothing: ``nn.TransformerEncoderLayer`` skips its fused inference kernel when a
    submodule has a hook. That kernel reads ``self_attn.in_proj_weight`` itself and would run without the adapter."""


class LoRAMultiheadAttention(ABLayer):
    """LoRA for ``nn.MultiheadAttention`` (module docstring): ``lora_A`` / ``lora_B`` adapt ``in_proj_weight``,
    ``out_proj_lora_A`` / ``out_proj_lora_B`` adapt ``out_proj.weight``; the forward is the base's, with the adapted
    weights. Attributes (``embed_dim``, ``batch_first``, ``out_proj``, ...) are the base module's."""
    reads_base_weight = True  # W + s B A of both projections is formed here, outside the base module's forward

    def __init__(self, base_layer: nn.MultiheadAttention, rank: int, alpha: float, dropout: float = 0.0,
                 **settings) -> None:
        super().__init__(base_layer, rank, alpha, dropout, **settings)
        self.register_forward_pre_hook(_no_fused_path)

    @property
    def weight(self) -> Tensor:
        """The in-projection weight (3E, E): the base weight adapters take their device and dtype from."""
        return self.base_layer.in_proj_weight

    def _adapted(self) -> Tensor:
        return self.base_layer.in_proj_weight

    def add_adapter(self, name: str, rank: int, alpha: float, dropout: float = 0.0, **settings) -> None:
        if dropout > 0:
            warnings.warn(
                f"LoRA(dropout={dropout}): not applied to nn.MultiheadAttention layers, whose adapter enters the "
                "attention through its weights, not through a layer input (Hugging Face PEFT ignores lora_dropout "
                "there too); it applies to the other adapted layers.", UserWarning, stacklevel=2,
            )
        super().add_adapter(name, rank, alpha, 0.0, **settings)

    def _init_containers(self) -> None:
        super()._init_containers()
        self.out_proj_lora_A = nn.ModuleDict()
        self.out_proj_lora_B = nn.ModuleDict()

    def _containers(self) -> list[nn.ModuleDict]:
        return [*super()._containers(), self.out_proj_lora_A, self.out_proj_lora_B]

    def _create(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        embed_dim = self.base_layer.embed_dim
        self.lora_A[name] = nn.Linear(embed_dim, rank, bias=False, device=device, dtype=dtype)
        self.lora_B[name] = nn.Linear(rank, 3 * embed_dim, bias=False, device=device, dtype=dtype)
        self.out_proj_lora_A[name] = nn.Linear(embed_dim, rank, bias=False, device=device, dtype=dtype)
        self.out_proj_lora_B[name] = nn.Linear(rank, embed_dim, bias=False, device=device, dtype=dtype)

    def _parameters_of(self, name: str) -> dict[str, nn.Parameter]:
        return {**super()._parameters_of(name), f"out_proj_lora_A.{name}.weight": self.out_proj_lora_A[name].weight,
                f"out_proj_lora_B.{name}.weight": self.out_proj_lora_B[name].weight}

    @torch.no_grad()
    def _reset(self, name: str, init: Init) -> None:
        # Both pairs as the Linear layer's: A Kaiming-uniform (or N(0, 1/r)), B zero, so the update starts at zero.
        for a, b in ((self.lora_A[name], self.lora_B[name]), (self.out_proj_lora_A[name], self.out_proj_lora_B[name])):
            if init == "gaussian":
                nn.init.normal_(a.weight, std=1 / self.specs[name].rank)
            else:
                nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
            nn.init.zeros_(b.weight)

    def _delta(self, name: str) -> Tensor:
        return self._deltas(name)["in_proj_weight"]

    def _deltas(self, name: str) -> dict[str, Tensor]:
        """``s B A`` of adapter ``name`` for each adapted base tensor, at least float32, with autograd."""
        pairs = {"in_proj_weight": (self.lora_A[name], self.lora_B[name]),
                 "out_proj.weight": (self.out_proj_lora_A[name], self.out_proj_lora_B[name])}
        scaling = self.specs[name].scaling
        deltas = {}
        for key, (a, b) in pairs.items():
            dtype = compute_dtype(a.weight.dtype)
            deltas[key] = (b.weight.to(dtype) @ a.weight.to(dtype)) * scaling  # (3E, E) and (E, E)
        return deltas

    def _bases(self) -> dict[str, nn.Parameter]:
        """The adapted tensors of the base module, by their name in it."""
        return {"in_proj_weight": self.base_layer.in_proj_weight, "out_proj.weight": self.base_layer.out_proj.weight}

    # --- merging: both projections at once (LoRALayer's merge and unmerge write what these give) ----------------

    def merged_weights(self, name: str | None = None) -> dict[str, Tensor]:
        """``W + s B A`` of both projections (``in_proj_weight``, ``out_proj.weight``), computed in float32 (or
        wider) and cast to the base dtype; raises if non-finite. On a merged layer: the weights as they are."""
        if self.merged:
            if name not in (None, self.merged_adapter):
                raise RuntimeError(f"{type(self).__name__}: adapter {self.merged_adapter!r} is merged, not {name!r}; "
                                   "unmerge_lora(model) first.")
            return {f"base_layer.{key}": w.detach().clone() for key, w in self._bases().items()}
        with torch.no_grad():
            deltas = self._deltas(name or self._active_name())
            merged = {key: w.to(deltas[key].dtype) + deltas[key] for key, w in self._bases().items()}
        if not all(torch.isfinite(w).all() for w in merged.values()):
            raise RuntimeError(
                f"{type(self).__name__}: merging would write inf or NaN into the base weights; the adapter or base "
                "weights hold non-finite or overflowing values. Nothing was merged into this layer."
            )
        return {f"base_layer.{key}": w.to(self._bases()[key].dtype) for key, w in merged.items()}

    def _restored(self) -> dict[str, Tensor]:
        deltas = self._deltas(self.merged_adapter)
        return {f"base_layer.{key}": (w.to(deltas[key].dtype) - deltas[key]).to(w.dtype)
                for key, w in self._bases().items()}

    # --- forward -----------------------------------------------------------------------------------------------

    def forward(self, query: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor | None]:
        """``nn.MultiheadAttention.forward`` (same arguments and outputs) with the active adapter's weights."""
        name = self._forward_adapter(query)
        if name is None:
            return self.base_layer(query, *args, **kwargs)
        deltas = self._deltas(name)
        weights = {key: w + deltas[key].to(w.dtype) for key, w in self._bases().items()}
        return torch.func.functional_call(self.base_layer, weights, (query, *args), kwargs)

    def _forward_adapter(self, query: Tensor) -> str | None:
        """The adapter this forward applies (None: the base weights as they are)."""
        routing = self.routing
        if self.merged:
            self._check_trainable_forward()
            return None
        if routing.disabled:
            return None
        if routing.names is not None:
            if routing.select(self.adapter_names, query.device) is not None:
                raise ValueError(
                    "route_adapters: per-sample adapters are not supported on nn.MultiheadAttention layers (each "
                    f"sample would need its own attention weights; nor does PEFT support it); this layer has "
                    f"{self.adapter_names}. Run one adapter per batch with set_adapter(model, name), or route "
                    "adapters that do not adapt the attention modules."
                )
            return None
        return routing.active if routing.active in self.specs else None


LAYER_TYPES[nn.MultiheadAttention] = LoRAMultiheadAttention
