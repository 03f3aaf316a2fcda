"""LoKr's math as pure functions: the factorization of a layer's sizes, which factors a layer gets (full or low-rank,
with or without a Tucker core), their initialisation, and the Kronecker delta weight they make.

Paper: Yeh et al., "Navigating Text-To-Image Customization: From LyCORIS Fine-Tuning to Model Evaluation",
arXiv:2309.14859 (LoKr; the Kronecker adapter of KronA, arXiv:2212.10650). The update of a weight ``W`` (out, in,
*kernel) is a scaled Kronecker product of a small and a larger factor:

```text
out = a * b, in = c * d                     (factorization: a <= b, c <= d, near the square root or `decompose_factor`)
W1 = w1                  (a, c)             or w1_a @ w1_b, (a, r) @ (r, c), if decompose_both and r < max(a, c) / 2
W2 = w2                  (b, d, *kernel)    if r >= max(b, d) / 2, else
     w2_a @ w2_b         (b, r) @ (r, d * prod(kernel))                      or, for a convolution with a kernel > 1
     t2 x_0 w2_a x_1 w2_b  (r, r, *kernel) with w2_a (r, b), w2_b (r, d)     and use_effective_conv2d (Tucker core)
ΔW = alpha / r * kron(W1, W2), reshaped to W's shape
```

Equal to Hugging Face PEFT 0.21.2's ``LoKrLayer`` (``peft/tuners/lokr/layer.py``): the same shapes, names, init and
delta weight, including one quirk of PEFT's: for an ``nn.Conv1d`` with a full ``w2`` (b, d, k), ``torch.kron`` of the
2-D ``W1`` and the 3-D ``w2`` gives a (b, a * d, c * k) tensor, which PEFT reshapes to (a * b, c * d, k) as it is; the
update is then a Kronecker product in another index order. We compute the same (a PEFT file means what PEFT computes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

NAMES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")  # PEFT's, in its order


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """Split ``dimension`` into ``(m, n)``, ``m * n == dimension`` and ``m <= n``, as LyCORIS (and PEFT) split it.

    A positive ``factor`` that divides ``dimension`` is taken as ``m``. Otherwise ``m`` grows through the divisors of
    ``dimension`` while ``m + n`` does not grow and ``m`` stays at most ``factor`` (-1: no bound), which stops at the
    divisor pair nearest the square root.

    Examples:
        >>> factorization(256), factorization(128), factorization(127), factorization(128, 4)
        ((16, 16), (8, 16), (1, 127), (4, 32))
    """
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    bound = dimension if factor == -1 else factor
    m, n = 1, dimension
    while m < n:
        step = m + 1
        while dimension % step:
            step += 1
        if step + dimension // step > m + n or step > bound:
            break
        m, n = step, dimension // step
    return (n, m) if m > n else (m, n)


def factor_shapes(weight_shape: tuple[int, ...], r: int, decompose_both: bool = False,
                  decompose_factor: int = -1, use_effective_conv2d: bool = False) -> dict[str, tuple[int, ...]]:
    """The LoKr factors of a layer, by PEFT's parameter names, and their shapes.

    Args:
        weight_shape: The base weight's shape: (out, in) for ``nn.Linear``; (out, in / groups, *kernel) for
            ``nn.Conv1d`` / ``nn.Conv2d`` (the factors cover one group's input channels).
        r: The rank of the low-rank factors.
        decompose_both: Make ``W1`` low-rank too (when ``r < max(a, c) / 2``).
        decompose_factor: Passed to `factorization` (-1: near the square root).
        use_effective_conv2d: A Tucker core ``lokr_t2`` for a convolution whose kernel is not all ones.
    """
    out, per_group_in, *kernel = weight_shape
    (a, b), (c, d) = factorization(out, decompose_factor), factorization(per_group_in, decompose_factor)
    shapes: dict[str, tuple[int, ...]] = {}
    if decompose_both and r < max(a, c) / 2:
        shapes |= {"lokr_w1_a": (a, r), "lokr_w1_b": (r, c)}
    else:
        shapes["lokr_w1"] = (a, c)
    if r >= max(b, d) / 2:
        shapes["lokr_w2"] = (b, d, *kernel)
    elif use_effective_conv2d and kernel and any(k != 1 for k in kernel):
        core = (*kernel, 1) if len(kernel) == 1 else tuple(kernel)  # Conv1d: (r, r, k, 1), as PEFT keeps it
        shapes |= {"lokr_w2_a": (r, b), "lokr_w2_b": (r, d), "lokr_t2": (r, r, *core)}
    else:
        shapes |= {"lokr_w2_a": (b, r), "lokr_w2_b": (r, d * math.prod(kernel))}
    return {name: shapes[name] for name in NAMES if name in shapes}


def init_factors(factors: Mapping[str, Tensor], init_weights: bool | str = True) -> None:
    """Initialise ``factors`` in place as PEFT does, in its order (so one seed draws the same values).

    ``True``: ``W1`` starts at zero (``lokr_w1``, or ``lokr_w1_a`` with ``lokr_w1_b`` drawn), so ``ΔW = 0``;
    ``"lycoris"``: ``W2`` starts at zero instead (``lokr_w2``, or ``lokr_w2_b`` with ``lokr_w2_a`` drawn), as the
    LyCORIS repository does; ``False``: every factor drawn (``ΔW != 0``; for tests). Drawn means Kaiming-uniform with
    ``a = sqrt(5)`` (``nn.Linear``'s default).
    """
    zero = {True: ("lokr_w1", "lokr_w1_a"), "lycoris": ("lokr_w2", "lokr_w2_b"), False: ()}[init_weights]
    with torch.no_grad():
        for name in (n for n in NAMES if n in factors):  # a zero fill draws nothing: PEFT's order of draws
            if name in zero:
                nn.init.zeros_(factors[name])
            else:
                nn.init.kaiming_uniform_(factors[name], a=math.sqrt(5))


def kron_weight(factors: Mapping[str, Tensor], scaling: float, weight_shape: tuple[int, ...] | torch.Size) -> Tensor:
    """``ΔW = scaling * kron(W1, W2)`` in the base weight's shape (see the module docstring for ``W1``, ``W2``).

    Args:
        factors: The layer's factors by PEFT's names (as `factor_shapes` makes them).
        scaling: ``alpha / r``.
        weight_shape: The base weight's shape.
    """
    w1 = factors["lokr_w1"] if "lokr_w1" in factors else factors["lokr_w1_a"] @ factors["lokr_w1_b"]  # (a, c)
    if "lokr_w2" in factors:
        w2 = factors["lokr_w2"]  # (b, d, *kernel)
    elif "lokr_t2" in factors:  # Tucker: (r, r, k1, k2) x_0 (r, b) x_1 (r, d) -> (b, d, k1, k2)
        w2 = torch.einsum("ijkl,ip,jq->pqkl", factors["lokr_t2"], factors["lokr_w2_a"], factors["lokr_w2_b"])
    else:
        w2 = factors["lokr_w2_a"] @ factors["lokr_w2_b"]  # (b, d * prod(kernel))
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]  # (a, c, 1, 1): the kernel comes from W2
    return (kron(w1, w2) * scaling).reshape(weight_shape)


def kron(a: Tensor, b: Tensor) -> Tensor:
    """``torch.kron(a, b)`` (the fewer dimensions padded at the front), built by broadcasting and ``reshape``.

    ``torch.kron`` views its inputs and fails on some strides that a size-1 dimension leaves (a Tucker ``W2`` of a
    Conv1d, or ``w1_a @ w1_b`` at ``r = 1``: "view size is not compatible with input tensor's size and stride"),
    where PEFT's LoKr then raises; each element is the same single product.
    """
    dims = max(a.dim(), b.dim())
    a_shape, b_shape = (1,) * (dims - a.dim()) + tuple(a.shape), (1,) * (dims - b.dim()) + tuple(b.shape)
    pairs = [(x, 1) for x in a_shape], [(1, y) for y in b_shape]
    product = a.reshape([s for pair in pairs[0] for s in pair]) * b.reshape([s for pair in pairs[1] for s in pair])
    return product.reshape([x * y for x, y in zip(a_shape, b_shape)])  # (a0 * b0, a1 * b1, ...)
