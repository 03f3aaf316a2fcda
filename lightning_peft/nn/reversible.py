"""Reversible residual layers: training memory for activations that does not grow with depth.

Papers: Gomez et al. 2017, "The Reversible Residual Network: Backpropagation Without Storing Activations",
arXiv:1707.04585 (the coupling and its inverse); Kitaev et al. 2020, "Reformer: The Efficient Transformer",
arXiv:2001.04451 (attention as ``F``, feed-forward as ``G``, on two copies of the input); Mangalam et al. 2022,
"Reversible Vision Transformers", arXiv:2302.10494 (RevViT: 15.5x less activation memory at about 1.3x the compute,
and the recomputation order used here).

Rule. The input ``x`` is split along its last dimension into halves ``x1, x2``; layer ``i`` computes

    y1 = x1 + F_i(x2)
    y2 = x2 + G_i(y1)                        output: cat([y1, y2], -1)

and its input follows exactly from its output:

    x2 = y2 - G_i(y1)
    x1 = y1 - F_i(x2)

So training keeps only the last layer's output. Backward walks the layers from the last to the first; for layer ``i``
with output gradients ``(dy1, dy2)`` it runs ``G_i(y1)`` again with autograd (``dy1 += (dG/dy1)^T dy2``, ``G_i``'s
parameter gradients from ``dy2``), rebuilds ``x2``, runs ``F_i(x2)`` again (``dx2 = dy2 + (dF/dx2)^T dy1``, ``F_i``'s
parameter gradients from ``dy1``), rebuilds ``x1`` and passes ``(dx1, dx2) = (dy1, dx2)`` on. Each layer's graph
lives only while its gradients are computed. Cost: one more forward of every branch (about 1.3x a normal step).

Randomness: the CPU random state (and the CUDA one of the input's device) is saved before every ``F_i`` and ``G_i``
call in the forward and restored for its recomputation, so dropout drops the same units twice; the caller's random
state after backward is what it was after the forward. Autocast: the recomputation runs under the autocast state
of the forward.

Shapes:

| tensor | shape | notes |
| --- | --- | --- |
| x, output | (..., 2D) | two halves of D; e.g. ``cat([h, h], -1)`` of (B, L, D) |
| F_i, G_i | (..., D) -> (..., D) | each keeps its input's shape |
| f_kwargs | any | passed to every ``F_i``, not differentiated |

Precision: the rebuilt inputs differ from the forward's by rounding (float32: ~1e-7 relative per layer, growing
with depth and with the size of the branch outputs); in float64 gradients equal plain autograd within 1e-9
relative (tested).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = ["ReversibleSequence"]

_WHO = "ReversibleSequence"


class ReversibleSequence(nn.Module):
    """A stack of reversible couplings ``y1 = x1 + F_i(x2); y2 = x2 + G_i(y1)`` that stores no activations.

    In training (grad enabled and the input or a block parameter requiring grad) the stack runs as one autograd
    function that keeps only its output and recomputes each layer in backward from the layer above; gradients
    equal those of the same couplings under plain autograd. Under ``torch.no_grad`` / ``inference_mode``, or when
    nothing requires grad, it is a plain loop. A block's gradients reach the parameters registered in it
    (``block.parameters()``): hold shared modules as submodules, not as plain attributes.

    Args:
        f_blocks: ``F_1 .. F_N``, modules mapping ``(..., D) -> (..., D)``; they also receive ``forward``'s
            keyword arguments (e.g. ``TransformerBlock.attention_branch`` wrapped to return the tensor alone).
        g_blocks: ``G_1 .. G_N``, modules mapping ``(..., D) -> (..., D)`` (e.g. the feed-forward branch).

    Raises:
        ValueError: If the lists are empty or of different lengths.
        TypeError: If a block is not an ``nn.Module``.

    Examples:
        >>> stack = ReversibleSequence([nn.Linear(4, 4) for _ in range(3)],
        ...                            [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
        >>> x = torch.randn(2, 5, 8, requires_grad=True)   # (B, L, 2D), D = 4
        >>> y = stack(x)
        >>> y.shape, type(y.grad_fn).__name__
        (torch.Size([2, 5, 8]), '_ReversibleFunctionBackward')
        >>> y.sum().backward()
        >>> x.grad.shape, stack.f_blocks[0].weight.grad.shape
        (torch.Size([2, 5, 8]), torch.Size([4, 4]))
    """

    def __init__(self, f_blocks: Sequence[nn.Module], g_blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        f_blocks, g_blocks = list(f_blocks), list(g_blocks)
        if not f_blocks or len(f_blocks) != len(g_blocks):
            raise ValueError(
                f"{_WHO}: got {len(f_blocks)} f_blocks and {len(g_blocks)} g_blocks; give one F and one G per "
                "layer, at least one layer."
            )
        for name, blocks in (("f_blocks", f_blocks), ("g_blocks", g_blocks)):
            for i, block in enumerate(blocks):
                if not isinstance(block, nn.Module):
                    raise TypeError(
                        f"{_WHO}: {name}[{i}] is a {type(block).__name__}, not an nn.Module; wrap a function or a "
                        "bound method in a module that holds its owner as a submodule, so its parameters are found "
                        "and get gradients."
                    )
        self.f_blocks = nn.ModuleList(f_blocks)
        self.g_blocks = nn.ModuleList(g_blocks)

    def forward(self, x: Tensor, **f_kwargs: Any) -> Tensor:
        """``(..., 2D) -> (..., 2D)``; ``f_kwargs`` (masks, position ids) go to every ``F_i`` unchanged.

        Raises:
            ValueError: If the last dimension is odd, a block changes the shape of its half (its index and both
                shapes are named), or a keyword argument requires grad.
            TypeError: If a block returns something other than a tensor.
            RuntimeError: In backward, if a block used a tensor requiring grad that is not a parameter registered
                in it (its gradient would be lost).
        """
        if x.dim() == 0 or x.shape[-1] % 2:
            raise ValueError(
                f"{_WHO}: the input has shape {tuple(x.shape)}; its last dimension must be even (two halves of D, "
                "e.g. torch.cat([h, h], dim=-1))."
            )
        for key, value in f_kwargs.items():
            if isinstance(value, Tensor) and value.requires_grad:
                raise ValueError(
                    f"{_WHO}: keyword argument {key!r} requires grad, but keyword arguments of F are not "
                    "differentiated; pass masks and position ids, or detach it."
                )
        params, f_index, g_index = self._trainable_parameters()
        if torch.is_grad_enabled() and (x.requires_grad or params):
            return _ReversibleFunction.apply(x, _Layout(self, f_kwargs, params, f_index, g_index), *params)
        x1, x2 = x.chunk(2, dim=-1)  # (..., D) each
        for i, (f, g) in enumerate(zip(self.f_blocks, self.g_blocks, strict=True)):
            x1 = x1 + _call(f, x2, "f_blocks", i, f_kwargs)
            x2 = x2 + _call(g, x1, "g_blocks", i, {})
        return torch.cat([x1, x2], dim=-1)

    def _trainable_parameters(self) -> tuple[list[Tensor], list[list[int]], list[list[int]]]:
        """The distinct parameters requiring grad, and for each block the indices of its own among them."""
        params: list[Tensor] = []
        index: dict[int, int] = {}

        def own(block: nn.Module) -> list[int]:
            found = []
            for p in block.parameters():
                if p.requires_grad:
                    if id(p) not in index:
                        index[id(p)] = len(params)
                        params.append(p)
                    found.append(index[id(p)])
            return found

        f_index = [own(block) for block in self.f_blocks]
        g_index = [own(block) for block in self.g_blocks]
        return params, f_index, g_index

    def extra_repr(self) -> str:
        return f"layers={len(self.f_blocks)}"


class _Layout:
    """What the autograd function needs besides the input: blocks, F's keyword arguments, parameters per block."""

    def __init__(
        self, stack: ReversibleSequence, f_kwargs: dict[str, Any], params: list[Tensor], f_index: list[list[int]],
        g_index: list[list[int]],
    ) -> None:
        self.f_blocks, self.g_blocks = list(stack.f_blocks), list(stack.g_blocks)
        self.f_kwargs, self.params, self.f_index, self.g_index = f_kwargs, params, f_index, g_index


def _call(block: nn.Module, x: Tensor, name: str, i: int, kwargs: dict[str, Any]) -> Tensor:
    out = block(x, **kwargs)
    if not isinstance(out, Tensor):
        raise TypeError(
            f"{_WHO}: {name}[{i}] ({type(block).__name__}) returned a {type(out).__name__}; each block must return "
            "one tensor (wrap a branch that returns a tuple, e.g. attention_branch(x)[0])."
        )
    if out.shape != x.shape:
        raise ValueError(
            f"{_WHO}: {name}[{i}] ({type(block).__name__}) maps shape {tuple(x.shape)} to {tuple(out.shape)}; "
            f"each block must keep the shape (..., D) of the half it receives (D = {x.shape[-1]}), or the coupling "
            "cannot be inverted."
        )
    return out


class _RngStates:
    """The random states before each of ``count`` calls, in one buffer per generator allocated up front.

    One buffer, not a small tensor per call: long-lived small allocations between a forward's large short-lived
    activations fragment the heap, and peak RSS then grows with depth under glibc malloc.
    """

    def __init__(self, device: torch.device, count: int) -> None:
        self.device = device
        self.cpu = torch.empty((count, torch.get_rng_state().numel()), dtype=torch.uint8)
        self.cuda = None
        if device.type == "cuda":
            self.cuda = torch.empty((count, torch.cuda.get_rng_state(device).numel()), dtype=torch.uint8)

    def save(self, k: int) -> None:
        self.cpu[k].copy_(torch.get_rng_state())
        if self.cuda is not None:
            self.cuda[k].copy_(torch.cuda.get_rng_state(self.device))

    def restore(self, k: int) -> None:
        torch.set_rng_state(self.cpu[k].clone())  # a copy: set_rng_state crashes on a row view (torch 2.13)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda[k].clone(), self.device)


def _foreign_leaves(output: Tensor, allowed: set[int]) -> list[Tensor]:
    """Leaves requiring grad that ``output``'s graph reaches and that are not in ``allowed`` (ids)."""
    found, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf requiring grad
        if variable is not None:
            if id(variable) not in allowed:
                found.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _branch_grads(
    output: Tensor, half: Tensor, grad_output: Tensor, layout: _Layout, indices: list[int], grads: list[Tensor],
    touched: list[bool], name: str, i: int,
) -> Tensor | None:
    """Adds one branch's parameter gradients into ``grads``; returns the gradient of the rebuilt half it read."""
    params = [layout.params[j] for j in indices]
    foreign = _foreign_leaves(output, {id(half), *(id(p) for p in params)})
    if foreign:
        shapes = ", ".join(str(tuple(t.shape)) for t in foreign[:3])
        raise RuntimeError(
            f"{_WHO}: {name}[{i}] used {len(foreign)} tensor(s) requiring grad that are not parameters registered in "
            f"it (shapes {shapes}); their gradients would be lost. Hold the module that owns them as a submodule of "
            "the block (self.block = block, not object.__setattr__), or freeze them."
        )
    if not output.requires_grad:
        return None
    # grad_output in the branch output's dtype (bf16 under autocast), as autograd passes it through the residual sum
    d_half, *d_params = torch.autograd.grad(
        output, [half, *params], grad_output.to(output.dtype), allow_unused=True
    )
    for j, grad in zip(indices, d_params, strict=True):
        if grad is not None:
            grads[j].add_(grad)
            touched[j] = True
    return d_half


class _ReversibleFunction(torch.autograd.Function):
    """Forward without a graph, keeping the output; backward rebuilding every layer's input from its output."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layout: _Layout, *params: Tensor) -> Tensor:
        device = x.device
        states = _RngStates(device, 2 * len(layout.f_blocks))  # before F_i: row 2i, before G_i: row 2i + 1
        x1, x2 = x.chunk(2, dim=-1)  # (..., D) each
        for i, (f, g) in enumerate(zip(layout.f_blocks, layout.g_blocks, strict=True)):
            states.save(2 * i)
            x1 = x1 + _call(f, x2, "f_blocks", i, layout.f_kwargs)
            states.save(2 * i + 1)
            x2 = x2 + _call(g, x1, "g_blocks", i, {})
        y = torch.cat([x1, x2], dim=-1)  # (..., 2D)
        ctx.layout, ctx.rng_states, ctx.device = layout, states, device
        ctx.autocast = (device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        layout, device = ctx.layout, ctx.device
        (y,) = ctx.saved_tensors
        # Every parameter gradient is allocated here, before any recomputation: buffers that live until the end
        # of backward, allocated one by one between short-lived activations, fragment the heap, and peak RSS then
        # grows with depth under glibc malloc (with per-call random states: +57 MB per block at the benchmark's
        # size; with both allocated up front, no more than the parameter gradients themselves).
        grads = [torch.zeros_like(p) for p in layout.params]
        touched = [False] * len(grads)
        y1, y2 = (t.detach() for t in y.chunk(2, dim=-1))  # (..., D) each
        dy1, dy2 = grad_y.chunk(2, dim=-1)
        device_type, autocast_on, autocast_dtype = ctx.autocast
        autocast = torch.autocast(device_type, dtype=autocast_dtype) if autocast_on else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast:
            for i in reversed(range(len(layout.f_blocks))):
                # G_i: y2 = x2 + G_i(y1)  ->  x2, dy1 += (dG/dy1)^T dy2
                with torch.enable_grad():
                    y1 = y1.requires_grad_()
                    ctx.rng_states.restore(2 * i + 1)
                    g_out = _call(layout.g_blocks[i], y1, "g_blocks", i, {})
                d_y1 = _branch_grads(g_out, y1, dy2, layout, layout.g_index[i], grads, touched, "g_blocks", i)
                with torch.no_grad():
                    x2 = y2 - g_out
                    dy1 = dy1 if d_y1 is None else dy1 + d_y1
                del g_out
                # F_i: y1 = x1 + F_i(x2)  ->  x1, dx2 = dy2 + (dF/dx2)^T dy1
                with torch.enable_grad():
                    x2 = x2.requires_grad_()
                    ctx.rng_states.restore(2 * i)
                    f_out = _call(layout.f_blocks[i], x2, "f_blocks", i, layout.f_kwargs)
                d_x2 = _branch_grads(f_out, x2, dy1, layout, layout.f_index[i], grads, touched, "f_blocks", i)
                with torch.no_grad():
                    x1 = y1.detach() - f_out
                    dy2 = dy2 if d_x2 is None else dy2 + d_x2
                del f_out
                y1, y2 = x1, x2.detach()
        grad_x = torch.cat([dy1, dy2], dim=-1) if ctx.needs_input_grad[0] else None
        return (grad_x, None, *(grad if used else None for grad, used in zip(grads, touched, strict=True)))
