"""Mixture of experts: a sparse feed-forward that sends every token to ``top_k`` of ``num_experts`` experts.

Papers: Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer"
(arXiv:1701.06538); Lepikhin et al. 2020, "GShard" (arXiv:2006.16668: top-2, expert capacity); Fedus et al. 2021,
"Switch Transformers" (arXiv:2101.03961: top-1, the load-balancing loss); Zoph et al. 2022, "ST-MoE"
(arXiv:2202.08906: the router z-loss); Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088: dropless top-2
over SwiGLU experts, gates renormalised over the chosen two).

Rule. The ``T`` tokens of the input (every leading dimension flattened), ``E`` experts, ``k = top_k``:

    logits = router(x)                          (T, E), float32
    p = softmax(logits)                         router probabilities
    (e_t1 .. e_tk), (g_t1 .. g_tk) = top-k of p_t          chosen experts and their probabilities
    g_tj <- g_tj / sum_j g_tj                   (normalize_gates=True: Mixtral, GShard; False: raw p, Switch)
    y_t = sum_j kept(t, j) * g_tj * expert_{e_tj}(x_t)

Capacity: each expert takes at most ``C = ceil(capacity_factor * T * k / E)`` assignments; the rest are dropped and
contribute 0 (the block's residual carries the token through). Which assignments win a slot: **every token's first
choice before any token's second choice** (and so on down the k ranks), and within one rank **in token order**
(the flattened input order: batch, then position), as GShard and ST-MoE dispatch. ``dropless=True`` keeps every
assignment (Mixtral). The auxiliary loss (Switch's balancing loss plus ST-MoE's z-loss), kept in `MoE.aux_loss`:

    f_i = #{(t, j): e_tj = i} / (T k)          share of the routed assignments (before capacity), no gradient
    P_i = mean_t p_ti                           mean router probability, differentiable
    aux_loss = aux_loss_coef * E * sum_i f_i P_i + z_loss_coef * mean_t logsumexp(logits_t)^2

With a uniform router ``E * sum_i f_i P_i = 1``, its minimum.

Dispatch: the ``T k`` assignments are sorted by expert (a stable sort, so the capacity priority above is the order
inside each expert's run); the kept ones gather their token rows into one ``(A, H)`` tensor, grouped by expert; each
expert runs once on its contiguous slice (an empty one when no token chose it, so every expert parameter always gets
a gradient and DDP needs no ``find_unused_parameters``); its outputs, scaled by their gates, are added into their
tokens' rows with ``index_add_`` (only that expert's rows). No per-expert boolean mask over all tokens.

Shapes:

| tensor | shape | notes |
| --- | --- | --- |
| input / output | (..., H) | H = hidden_size; output in the experts' dtype |
| tokens | (T, H) | T = product of the leading dimensions |
| router logits, p | (T, E) | float32 (float64 if the router weight is float64) |
| top-k experts, gates | (T, k) |  |
| dispatched tokens | (A, H) | A = kept assignments <= T k, grouped by expert |
| aux_loss | () | differentiable with respect to the router |

Not supported: expert parallelism (experts placed on different ranks with all-to-all dispatch); every rank holds
every expert.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_peft._checks import choice, integer, positive, real
from lightning_peft.nn.feed_forward import ACTIVATIONS, FeedForward

__all__ = ["MoE", "moe_aux_loss", "moe_layers"]


class MoE(nn.Module):
    """A sparse mixture-of-experts feed-forward: top-k routing, expert capacity, balancing and z-loss.

    A drop-in for the dense feed-forward of a transformer block (``TransformerBlock(feed_forward=MoE(...))``):
    ``(..., H) -> (..., H)``. The experts are `FeedForward` modules, so LoRA targets them by name
    (``experts.<e>.up_proj``, ``gate_proj``, ``down_proj``).

    Args:
        hidden_size: Model width ``H``.
        ffn_size: Inner width of every expert.
        num_experts: Number of experts ``E``.
        top_k: Experts per token (1: Switch; 2: GShard, Mixtral).
        capacity_factor: Slots per expert as a multiple of a perfectly balanced share ``T * top_k / E``; assignments
            beyond it are dropped (see the module docstring for which win). Ignored when ``dropless``.
        dropless: Keep every assignment (no capacity), as Mixtral does.
        aux_loss_coef: Weight of the load-balancing term of `aux_loss`.
        z_loss_coef: Weight of the router z-loss term of `aux_loss`.
        activation: The experts' activation (``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"relu"``).
        gated: Gated experts (``down(act(gate(x)) * up(x))``; SwiGLU with ``"silu"``).
        bias: Biases on the experts' projections (the router never has one).
        normalize_gates: Renormalise the chosen probabilities to sum to 1 per token. With ``top_k=1`` this makes
            every gate 1, so the router learns from `aux_loss` alone; Switch Transformer's rule is
            ``normalize_gates=False`` (the gate is the raw probability, which the task loss trains).

    Attributes:
        router: ``nn.Linear(hidden_size, num_experts, bias=False)``, computed in float32 (autocast is turned off
            around it; a router weight cast to fp16/bf16 is upcast for the product).
        experts: ``nn.ModuleList`` of ``num_experts`` `FeedForward` modules.
        name: Set by the owner (e.g. ``"layers.3.mlp"``); named in error messages.
        aux_loss: The last forward's auxiliary loss (a 0-dim tensor, differentiable), or None before any forward.
        last_stats: The last forward's routing: ``"tokens_per_expert"`` (E,) long, the assignments each expert
            processed (after capacity); ``"dropped_fraction"``, the share of the ``T * top_k`` assignments dropped
            (0.0 when dropless); ``"load"`` (E,) float, ``f_i``: each expert's share of the routed assignments.

    Raises:
        TypeError: For a size or ``top_k`` that is not an integer, or a factor or loss weight that is not a number.
        ValueError: For a size below 1, ``top_k`` outside ``1..num_experts``, a ``capacity_factor`` that is not a
            positive finite number, a negative or non-finite loss weight, or an unknown activation; in `forward`,
            for an input whose last dimension is not ``hidden_size`` and for non-finite router logits (naming the
            layer by `name`).

    Examples:
        >>> moe = MoE(hidden_size=8, ffn_size=16, num_experts=4, top_k=2)
        >>> moe(torch.randn(2, 5, 8)).shape
        torch.Size([2, 5, 8])
        >>> moe.aux_loss.shape, moe.last_stats["tokens_per_expert"].shape
        (torch.Size([]), torch.Size([4]))
        >>> [name for name, _ in moe.named_modules() if name.endswith("up_proj")]
        ['experts.0.up_proj', 'experts.1.up_proj', 'experts.2.up_proj', 'experts.3.up_proj']
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        dropless: bool = False,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        activation: str = "silu",
        gated: bool = True,
        bias: bool = False,
        normalize_gates: bool = True,
    ) -> None:
        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("ffn_size", ffn_size), ("num_experts", num_experts)):
            integer("MoE", name, size, minimum=1)
        integer("MoE", "top_k", top_k, minimum=1, maximum=num_experts, meaning="1: Switch, 2: GShard / Mixtral")
        positive(
            "MoE", "capacity_factor", capacity_factor, example="1.25",
            meaning="1.0 = a perfectly balanced share per expert; to keep every token use dropless=True",
        )
        real("MoE", "aux_loss_coef", aux_loss_coef, minimum=0, meaning="0 turns the term off")
        real("MoE", "z_loss_coef", z_loss_coef, minimum=0, meaning="0 turns the term off")
        choice("MoE", "activation", activation, ACTIVATIONS)
        self.hidden_size = hidden_size
        self.ffn_size = ffn_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = float(capacity_factor)
        self.dropless = bool(dropless)
        self.aux_loss_coef = float(aux_loss_coef)
        self.z_loss_coef = float(z_loss_coef)
        self.normalize_gates = bool(normalize_gates)
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            FeedForward(hidden_size, ffn_size, activation=activation, gated=gated, bias=bias)
            for _ in range(num_experts)
        )
        self.name: str | None = None
        self.aux_loss: Tensor | None = None
        self.last_stats: dict[str, Any] = {}

    def _who(self) -> str:
        return f"MoE {self.name!r}" if self.name else "MoE"

    def capacity(self, num_tokens: int) -> int | None:
        """Slots per expert for ``num_tokens`` tokens: ``ceil(capacity_factor * T * top_k / E)``; None if dropless."""
        if self.dropless:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def router_logits(self, tokens: Tensor) -> Tensor:
        """``(T, E)`` router logits of ``tokens`` ``(T, H)`` in float32 (float64 for a float64 router), no autocast."""
        weight = self.router.weight
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        device_type = tokens.device.type
        if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return self._linear_router(tokens, weight, dtype)
        return self._linear_router(tokens, weight, dtype)

    def _linear_router(self, tokens: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
        if weight.dtype == dtype:
            return self.router(tokens.to(dtype))  # through the module: its hooks and wrappers run
        return F.linear(tokens.to(dtype), weight.to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        """``(..., H) -> (..., H)``; sets `aux_loss` and `last_stats`."""
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{self._who()}: the input has shape {tuple(x.shape)} but hidden_size={self.hidden_size}; give a "
                f"(..., {self.hidden_size}) tensor."
            )
        num_experts, top_k = self.num_experts, self.top_k
        tokens = x.reshape(-1, self.hidden_size)  # (T, H)
        num_tokens = tokens.shape[0]
        logits = self.router_logits(tokens)  # (T, E)
        finite = torch.isfinite(logits).all(-1)  # (T,)
        if not bool(finite.all()):
            raise ValueError(
                f"{self._who()}: the router logits are not finite (NaN or inf) for {int((~finite).sum())} of "
                f"{num_tokens} tokens; the layer's input holds NaN/inf (an earlier layer overflowed or diverged) or "
                "the router weight does. Lower the learning rate, clip gradients, or train in float32/bf16 rather "
                "than fp16."
            )
        probs = logits.softmax(-1)  # (T, E)
        top_probs, top_experts = probs.topk(top_k, dim=-1)  # (T, k)
        gates = top_probs / top_probs.sum(-1, keepdim=True) if self.normalize_gates else top_probs

        # Assignment a = j * T + t (rank-major): a stable sort by expert keeps, inside every expert's run, first
        # choices before second choices and tokens in order, which is the capacity priority.
        assigned = top_experts.t().reshape(-1)  # (T k,)
        order = torch.argsort(assigned, stable=True)  # (T k,) grouped by expert
        routed = torch.bincount(assigned, minlength=num_experts)  # (E,)
        capacity = self.capacity(num_tokens)
        if capacity is None:
            kept = routed
        else:
            starts = routed.cumsum(0) - routed  # (E,) first sorted position of each expert
            slot = torch.arange(order.numel(), device=order.device) - starts[assigned[order]]  # place in its queue
            order = order[slot < capacity]  # (A,)
            kept = routed.clamp(max=capacity)
        token_index = order % num_tokens  # (A,)
        gate = gates.t().reshape(-1).index_select(0, order)  # (A,)
        dispatched = tokens.index_select(0, token_index)  # (A, H), grouped by expert
        counts = kept.tolist()  # host sync: the slice sizes
        out: Tensor | None = None
        slices = zip(self.experts, dispatched.split(counts), token_index.split(counts), gate.split(counts), strict=True)
        for expert, chunk, index, weight in slices:
            y = expert(chunk)  # (n_e, H)
            if out is None:  # the experts' dtype (autocast may differ from the input's)
                out = y.new_zeros(num_tokens, self.hidden_size)  # (T, H)
            # Added expert by expert: no (A, H) concatenation or product is allocated, which costs more than the
            # adds on a CPU (fresh pages), and each add reads only this expert's rows.
            out.index_add_(0, index, y * weight.to(y.dtype).unsqueeze(-1))

        load = routed.to(probs.dtype) / max(num_tokens * top_k, 1)  # (E,) f_i
        if num_tokens:
            balance = num_experts * (load * probs.mean(0)).sum()
            z_loss = torch.logsumexp(logits, dim=-1).square().mean()
            self.aux_loss = self.aux_loss_coef * balance + self.z_loss_coef * z_loss
        else:  # an empty input: no loss, still a differentiable 0
            self.aux_loss = logits.sum()
        total = num_tokens * top_k
        self.last_stats = {
            "tokens_per_expert": kept.detach(),
            "dropped_fraction": (total - sum(counts)) / total if total else 0.0,
            "load": load.detach(),
        }
        return out.reshape(*x.shape[:-1], self.hidden_size)

    def extra_repr(self) -> str:
        capacity = "dropless=True" if self.dropless else f"capacity_factor={self.capacity_factor}"
        return (
            f"hidden_size={self.hidden_size}, ffn_size={self.ffn_size}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, {capacity}, aux_loss_coef={self.aux_loss_coef}, z_loss_coef={self.z_loss_coef}"
        )


def moe_layers(module: nn.Module) -> dict[str, MoE]:
    """The `MoE` feed-forwards inside ``module`` by name (empty without any).

    Examples:
        >>> model = nn.ModuleDict({"mlp": MoE(hidden_size=4, ffn_size=8, num_experts=2, top_k=1)})
        >>> list(moe_layers(model))
        ['mlp']
    """
    return {name: sub for name, sub in module.named_modules() if isinstance(sub, MoE)}


def moe_aux_loss(module: nn.Module) -> Tensor | None:
    """The sum of the auxiliary losses the `MoE` layers inside ``module`` computed in their last forward, or None."""
    losses = [layer.aux_loss for layer in moe_layers(module).values() if layer.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
