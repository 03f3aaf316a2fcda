"""`chunked_cross_entropy`: the language-model loss of a linear head without the full ``(tokens, vocab)`` logits.

The idea is Liger Kernel's fused linear cross-entropy (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels
for LLM Training", arXiv:2410.10989), written here in plain PyTorch. The plain loss
``F.cross_entropy(hidden @ weight.T, labels)`` materialises the logits ``(N, V)`` and, in backward, two more tensors
of that size (the log-probabilities autograd keeps and their gradient): at 8k tokens and a 128k vocabulary that is
4 GiB each in float32. Here the rows of ``hidden`` are taken ``chunk_size`` at a time; for each chunk the forward
computes its logits, its loss and, when gradients are needed, at once its share of every gradient, then drops the
logits. The backward only multiplies the stored gradients by the incoming scalar. Memory: ``O(chunk * V)`` for the
logits instead of ``O(N * V)``, plus the gradients themselves (``(N, H)`` for ``hidden``, ``(V, H)`` for a trainable
head); the matrix products are the same as the plain loss's.

Rule, for a chunk ``c`` of rows with targets ``y`` (``w_i = scale`` for a kept row, ``0`` for ``ignore_index``;
``scale = 1 / number of kept rows`` for ``"mean"``, ``1`` for ``"sum"``):

```text
z = hidden[c] @ weight.T + bias                      (c, V), computed in the inputs' dtype, then float32
loss += sum_i w_i * (logsumexp(z_i) - z_i[y_i])
dz = w[:, None] * (softmax(z) - onehot(y))           (c, V)
grad_hidden[c] = dz @ weight                          (c, H)
grad_weight += dz.T @ hidden[c]; grad_bias += dz.sum(0)   accumulated in float32
```

Shapes: ``hidden`` ``(N, H)`` or ``(B, L, H)``, ``labels`` ``hidden.shape[:-1]``, ``weight`` ``(V, H)``, ``bias``
``(V,)``. The caller shifts the labels (position ``t`` predicting token ``t + 1``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_peft._checks import choice, integer

__all__ = ["DEFAULT_CHUNK_SIZE", "chunked_cross_entropy"]

DEFAULT_CHUNK_SIZE = 1024  # rows per chunk; chosen by benchmarks/bench_chunked_loss.py (docs/chunked_loss.md)
_WHO = "chunked_cross_entropy"


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
    reduction: str = "mean",
    bias: Tensor | None = None,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, labels)`` computed ``chunk_size`` rows at a time.

    Never holds more than one chunk's logits ``(chunk_size, V)``: memory ``O(chunk_size * V)`` instead of
    ``O(N * V)``. Gradients of ``hidden``, ``weight`` and ``bias`` are computed in the forward, chunk by chunk, for
    those that require grad (a frozen head costs no weight gradient); the backward scales them.

    Args:
        hidden: ``(N, H)`` or ``(B, L, H)`` hidden states (float32, bfloat16, float16 or float64).
        weight: ``(V, H)`` head weight, the dtype of ``hidden``.
        labels: ``hidden.shape[:-1]`` integer targets in ``[0, V)`` or ``ignore_index``, already shifted.
        chunk_size: Rows per chunk (a positive integer).
        ignore_index: Target value that takes no loss.
        reduction: ``"mean"`` over the kept targets (``F.cross_entropy``'s default: ``nan`` when every target is
            ignored, with zero gradients, as there) or ``"sum"``.
        bias: Optional ``(V,)`` head bias.

    Returns:
        The scalar loss in float32 (float64 for float64 inputs). Logits are the inputs' dtype product, softmax and
        sums in float32; gradients come back in the dtype of each input.

    Raises:
        TypeError: If ``chunk_size`` or ``ignore_index`` is not an integer, a tensor argument has the wrong dtype.
        ValueError: If ``chunk_size < 1``, ``reduction`` is unknown, the shapes disagree or a label is out of range.

    Examples:
        >>> import torch.nn.functional as F
        >>> hidden, weight = torch.randn(10, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
        >>> labels = torch.tensor([1, 2, 3, -100, 0, 6, 5, 4, -100, 2])
        >>> loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=3)
        >>> torch.allclose(loss, F.cross_entropy(hidden @ weight.T, labels))
        True
    """
    chunk_size = integer(_WHO, "chunk_size", chunk_size, minimum=1, example="1024")
    ignore_index = integer(_WHO, "ignore_index", ignore_index, example="-100")
    choice(_WHO, "reduction", reduction, ("mean", "sum"))
    _check_tensors(hidden, weight, labels, bias)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    flat_labels = labels.reshape(-1).long()  # (N,)
    _check_labels(flat_labels, weight.shape[0], ignore_index)
    return _ChunkedCrossEntropy.apply(flat_hidden, weight, bias, flat_labels, chunk_size, ignore_index,
                                      reduction == "sum")


def _shapes(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None) -> str:
    text = f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}"
    return text + (f", bias {tuple(bias.shape)}" if bias is not None else "")


def _check_tensors(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None) -> None:
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels), ("bias", bias)):
        if not isinstance(value, Tensor) and not (name == "bias" and value is None):
            raise TypeError(f"{_WHO}({name}={type(value).__name__}): {name} must be a torch.Tensor.")
    shapes = _shapes(hidden, weight, labels, bias)
    if not hidden.is_floating_point() or weight.dtype != hidden.dtype or (bias is not None and
                                                                           bias.dtype != hidden.dtype):
        dtypes = f"hidden {hidden.dtype}, weight {weight.dtype}" + (f", bias {bias.dtype}" if bias is not None else "")
        raise TypeError(f"{_WHO}({dtypes}): hidden, weight and bias must share one floating dtype; cast them.")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{_WHO}(labels {labels.dtype}): labels must be integer class ids (torch.long).")
    if hidden.dim() not in (2, 3) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{_WHO}({shapes}): hidden must be (N, H) or (B, L, H) and weight (V, H) with the same H.")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{_WHO}({shapes}): labels must have the shape of hidden without its last dimension, "
                         f"{tuple(hidden.shape[:-1])}.")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{_WHO}({shapes}): bias must be (V,) = ({weight.shape[0]},).")
    if len({hidden.device, weight.device, labels.device} | ({bias.device} if bias is not None else set())) > 1:
        raise ValueError(f"{_WHO}: hidden ({hidden.device}), weight ({weight.device}), labels ({labels.device}) "
                         "must be on one device.")


def _check_labels(labels: Tensor, vocab: int, ignore_index: int) -> None:
    """Every label is ``ignore_index`` or in ``[0, vocab)`` (``F.cross_entropy`` raises an IndexError)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))  # (N,)
    if bool(bad.any()):
        where = int(bad.nonzero()[0, 0])
        raise ValueError(f"{_WHO}(labels[{where}]={int(labels[where])}): labels must be in [0, {vocab}) (the "
                         f"vocabulary of weight) or ignore_index={ignore_index}.")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and the (unscaled) gradients chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk_size: int,
                ignore_index: int, total: bool) -> Tensor:
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):  # the products in the inputs' own dtype
            loss, grads = _loss_and_grads(hidden, weight, bias, labels, chunk_size, ignore_index, total,
                                          (need_hidden, need_weight, need_bias and bias is not None))
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):
        grads = ctx.saved_tensors
        if not torch.equal(grad_output, torch.ones_like(grad_output)):  # a scaled or weighted loss
            grads = tuple(None if g is None else g * grad_output.to(g.dtype) for g in grads)
        return (*grads, None, None, None, None)


def _loss_and_grads(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk_size: int,
                    ignore_index: int, total: bool, needs: tuple[bool, bool, bool]
                    ) -> tuple[Tensor, tuple[Tensor | None, Tensor | None, Tensor | None]]:
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for float64 inputs
    device = hidden.device
    kept = labels != ignore_index  # (N,)
    scale = torch.ones((), dtype=acc, device=device) if total else 1.0 / kept.sum().to(acc)  # inf if none kept
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if needs[0] else None  # (N, H)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=device) if needs[1] else None  # (V, H)
    grad_bias = torch.zeros(vocab, dtype=acc, device=device) if needs[2] else None  # (V,)
    any_grad = any(needs)
    loss = torch.zeros((), dtype=acc, device=device)
    weight_t = weight.t()  # (H, V), a view
    buffer = torch.empty(min(chunk_size, n), vocab, dtype=hidden.dtype, device=device)  # reused by every chunk
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        h = hidden[start:stop]  # (c, H)
        logits = buffer[: stop - start]  # (c, V)
        if bias is None:
            torch.mm(h, weight_t, out=logits)
        else:
            torch.addmm(bias, h, weight_t, out=logits)
        logits = logits.to(acc)  # a no-op for float32 / float64; a float32 copy of a bfloat16 chunk
        keep = kept[start:stop]  # (c,)
        target = labels[start:stop].masked_fill(~keep, 0)  # (c,): ignored rows point at class 0, weighted 0
        logits.sub_(logits.amax(dim=1, keepdim=True))  # shifted: the largest logit of each row is 0
        picked = logits.gather(1, target[:, None]).squeeze(1)  # (c,)
        sums = logits.exp_().sum(dim=1)  # (c,); logits now hold exp(z - max)
        loss += torch.where(keep, sums.log() - picked, 0).sum()
        if not any_grad:
            continue
        rows = torch.where(keep, scale, 0)  # (c,): each row's weight in the loss
        logits.mul_((rows / sums)[:, None])  # softmax * row weight
        logits.scatter_add_(1, target[:, None], -rows[:, None])  # minus the one-hot: dz (c, V)
        if grad_hidden is not None:
            torch.mm(logits.to(hidden.dtype), weight, out=grad_hidden[start:stop])  # (c, H)
        if grad_weight is not None:
            grad_weight.addmm_(logits.t(), h.to(acc))  # (V, H) += (V, c) @ (c, H)
        if grad_bias is not None:
            grad_bias += logits.sum(dim=0)
    grads = (grad_hidden,
             None if grad_weight is None else grad_weight.to(weight.dtype),
             None if grad_bias is None else grad_bias.to(bias.dtype))
    return loss * scale, grads
