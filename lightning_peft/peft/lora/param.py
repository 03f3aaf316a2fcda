"""LoRA on a parameter (``target_parameters``), as Hugging Face PEFT's ``ParamWrapper``.

Some weights sit in no layer LoRA can wrap: transformers 5 stores the experts of a mixture-of-experts model as one 3-D
``nn.Parameter`` per projection (Mixtral: ``experts.gate_up_proj`` (E, 2 I, H), ``experts.down_proj`` (E, H, I)), and
some modules read a 2-D weight in their own forward. [`LoRAParameter`][lightning_peft.peft.lora.param.LoRAParameter]
wraps the module that holds such a parameter; while the module runs, it reads ``W + s B A`` in place of ``W`` (the
parameter itself is only written by a merge). Reading the parameter from outside the module's forward gives ``W``.

Paper: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685. Update rule, ``E`` experts of
rank ``r`` each, scale ``s`` (PEFT's layout, so that its files load as they are):

```text
W'_e = W_e + s * B_e @ A_e      A = lora_A.<n>.weight (E r, in):  A_e = rows e r .. e r + r - 1
                                B = lora_B.<n>.weight (out, r E): B_e = columns e, E + e, ..., (r - 1) E + e
```

| parameter | read by the module as | in, out | delta |
| --- | --- | --- | --- |
| 2-D (d0, d1) | any | d1, d0 | ``s B A`` (d0, d1) |
| 3-D (E, d1, d2), ``is_transposed`` False (Mixtral, Qwen2-MoE) | ``F.linear(x, W_e)`` | d2, d1 | ``s B_e A_e`` |
| 3-D (E, d1, d2), ``is_transposed`` True (gpt-oss) | ``x @ W_e`` | d1, d2 | ``s (B_e A_e)^T`` |

Several parameters of one module: the wrappers nest, the first parameter the module registers innermost, so the
adapter of Mixtral's ``gate_up_proj`` is ``experts.base_layer.lora_A`` and that of ``down_proj`` ``experts.lora_A``
(PEFT's names, in memory and in its files).

Limits, as PEFT's: no dropout and no DoRA (the update is made on the weight, not on an input); every named adapter
that sets ``target_parameters`` adapts the same parameters; a routed batch uses one adapter for all its samples (the
module reads its parameter once per call, for the whole batch); a parameter of the model itself (not of a submodule)
cannot be wrapped.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .._common import compute_dtype
from ..modules_to_save import set_submodule
from .layer import ABLayer

__all__ = ["LoRAParameter", "plan_parameters", "wrap_parameters"]

_BASE = "base_layer."


class LoRAParameter(ABLayer):
    """LoRA on parameter ``parameter_name`` of ``base_layer`` (or of the module a chain of these wraps).

    Args:
        base_layer: The module holding the parameter, or a `LoRAParameter` around it (another of its parameters).
        parameter_name: The parameter's name on its module (``"gate_up_proj"``).
        target_name: The parameter's full name in the model (``"model.layers.0.mlp.experts.gate_up_proj"``), which
            ``rank_pattern`` and ``alpha_pattern`` match, as in PEFT.
        rank, alpha, settings: As [`LoRALayer`][lightning_peft.peft.LoRALayer]'s (``use_rslora``, ``init``,
            ``adapter_name``); the update is formed on the parameter, not on an input, so there is no dropout.
    """

    def __init__(self, base_layer: nn.Module, parameter_name: str, target_name: str, rank: int, alpha: float,
                 dropout: float = 0.0, **settings) -> None:
        self.parameter_name = parameter_name
        self.target_name = target_name
        super().__init__(base_layer, rank, alpha, 0.0, **settings)

    def _holder(self) -> tuple[nn.Module, int]:
        """The module that holds the parameter, and how many wrappers deep it is from this one."""
        module, depth = self.base_layer, 1
        while isinstance(module, LoRAParameter):
            module, depth = module.base_layer, depth + 1
        return module, depth

    @property
    def adapted_key(self) -> str:
        return _BASE * self._holder()[1] + self.parameter_name

    def _adapted(self) -> Tensor:
        return getattr(self._holder()[0], self.parameter_name)

    @property
    def reads_base_weight(self) -> bool:
        return True  # W + s B A is formed here, before the module's forward

    def _transposed(self) -> bool:
        return self._adapted().dim() == 3 and bool(getattr(self._holder()[0], "is_transposed", False))

    def _sizes(self) -> tuple[int, int, int]:
        """``(experts, in, out)`` of the parameter, read as PEFT reads its shape (the table in the module docstring)."""
        shape = self._adapted().shape
        if len(shape) == 2:
            return 1, shape[1], shape[0]
        experts, d1, d2 = shape
        return (experts, d1, d2) if self._transposed() else (experts, d2, d1)

    def _create(self, name: str, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        experts, in_features, out_features = self._sizes()
        self.lora_A[name] = nn.Linear(in_features, rank * experts, bias=False, device=device, dtype=dtype)
        self.lora_B[name] = nn.Linear(rank * experts, out_features, bias=False, device=device, dtype=dtype)

    def _experts(self, name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(A_e, B_e)`` of every expert: (E, r, in) and (out, r, E)."""
        a, b = self.factors(name)  # (E r, in), (out, r E)
        experts = self._sizes()[0]
        return a.to(dtype).reshape(experts, -1, a.shape[-1]), b.to(dtype).reshape(b.shape[0], -1, experts)

    def _delta(self, name: str) -> Tensor:
        """``s B A`` in the parameter's layout, at least float32 (for merging)."""
        scaling = self.specs[name].scaling
        a, b = self.factors(name)
        dtype = compute_dtype(a.dtype)
        if self._adapted().dim() == 2:
            return (b.to(dtype) @ a.to(dtype)) * scaling  # (d0, d1)
        a_e, b_e = self._experts(name, dtype)
        return torch.einsum("ore,eri->eio" if self._transposed() else "ore,eri->eoi", b_e, a_e) * scaling

    def _updated(self, name: str) -> Tensor:
        """``W + s B A`` in the parameter's dtype, differentiable in ``A`` and ``B``: what the module reads."""
        weight = self._adapted()
        scaling = self.specs[name].scaling
        # The parameter keeps its dtype (a module may check it); the sum is formed in it, autocast or not.
        with torch.autocast(weight.device.type, enabled=False):
            if weight.dim() == 2:
                a, b = self.factors(name)
                return weight + ((b @ a.to(b.dtype)) * scaling).to(weight.dtype)
            a_e, b_e = self._experts(name, weight.dtype)
            b_e = b_e.permute(2, 0, 1)  # (E, out, r)
            # W_e + s lhs_e @ rhs_e in one batched kernel: no second (E, d1, d2) tensor is made.
            lhs, rhs = (a_e.transpose(1, 2), b_e.transpose(1, 2)) if self._transposed() else (b_e, a_e)
            return torch.baddbmm(weight, lhs, rhs, alpha=scaling)

    def forward(self, *args, **kwargs):
        name = self._running()
        if name is None:
            return self.base_layer(*args, **kwargs)
        key = self.adapted_key[len(_BASE):]  # the parameter's path from the base layer
        return functional_call(self.base_layer, {key: self._updated(name)}, args, kwargs, tie_weights=False)

    def _running(self) -> str | None:
        """The adapter this call adds (None: the base alone)."""
        routing = self.routing
        if self.merged_adapter is not None:
            self._check_trainable_forward()
            return None
        if routing.disabled:
            return None
        names = {routing.active} if routing.names is None else set(routing.names)
        if len(names) > 1:  # route_adapters refuses such a batch first
            raise ValueError(f"route_adapters: {self.target_name!r} (target_parameters) takes one adapter for the "
                             f"whole batch, and the batch routes to {sorted(names, key=str)}.")
        name = names.pop()
        return name if name in self.specs else None

    def extra_repr(self) -> str:
        return f"parameter_name={self.parameter_name!r}, {super().extra_repr()}"


def _wrapped(module: nn.Module) -> dict[str, LoRAParameter]:
    """The `LoRAParameter` wrappers around a module, by parameter name, outermost first."""
    chain = {}
    while isinstance(module, LoRAParameter):
        chain[module.parameter_name] = module
        module = module.base_layer
    return chain


def plan_parameters(model: nn.Module, pairs: list[tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Where each ``(module, parameter)`` of ``pairs`` has its `LoRAParameter`: ``{layer path: (module, parameter)}``,
    innermost first (the order unloading takes them out). A module already wrapped keeps its nesting."""
    by_module: dict[str, list[str]] = {}
    for module, parameter in pairs:
        by_module.setdefault(module, []).append(parameter)
    planned = {}
    for module, parameters in by_module.items():
        existing = list(_wrapped(model.get_submodule(module)))
        order = existing[::-1] if existing else parameters  # innermost first: the first the module registers
        for depth, parameter in zip(range(len(order) - 1, -1, -1), order):
            if parameter in parameters:
                planned[module + ".base_layer" * depth] = (module, parameter)
    return planned


def wrap_parameters(model: nn.Module, planned: dict[str, tuple[str, str]], config, adapter_name: str,
                    routing) -> dict[str, LoRAParameter]:
    """Add adapter ``adapter_name`` (``config``, a ``LoRAConfig``) to every planned parameter, wrapping those not
    wrapped yet; returns the layers by path."""
    layers = {}
    for path, (module, parameter) in planned.items():
        target = f"{module}.{parameter}"
        settings = config.layer_settings(target)  # (LoRAConfig refuses dropout, DoRA and lora_bias here)
        holder = model.get_submodule(module)
        layer = _wrapped(holder).get(parameter)
        if layer is not None:
            layer.add_adapter(adapter_name, **settings)
        else:
            layer = LoRAParameter(holder, parameter, target, adapter_name=adapter_name, **settings)
            layer.train(holder.training).routing = routing
            set_submodule(model, module, layer)
        layers[path] = layer
    return layers
