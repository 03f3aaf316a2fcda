"""What overflows the dtype an adapter computes in: a scale or factor values beyond its largest finite value.

A LoRA update is ``s * B @ A`` with ``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), a Python float, added to the
base layer's output in the base weight's dtype. ``alpha = 1e39`` is a finite Python float, but above float32's
largest value (3.4e38): every output is then inf or NaN, and so it is with factors of 3e38, whose product overflows.
Such adapters are refused where they enter (inject, load) and where they leave (save), with the field, the value and
the dtype's limit in the message.

Bounds, all in Python floats (float64, so the check itself does not overflow):

- a scale: ``s <= finfo(dtype).max`` of the adapted layer's base weight (float32 3.4e38, bfloat16 3.39e38, float16
  65504);
- a factor pair: every entry of ``B @ A`` is a sum of ``r`` products, so ``|s * B @ A| <= s * r * max|A| * max|B|``,
  which must stay within the same limit (a trained adapter is many orders of magnitude below it);
- any adapter tensor read from a file: within the limit of the dtype of the parameter it is copied into.

>>> largest(torch.float16)
65504.0
>>> scale_problem("q", alpha=16, rank=8, use_rslora=False, dtype=torch.float16) is None
True
>>> scale_problem("q", alpha=1e6, rank=4, use_rslora=False, dtype=torch.float16)
"module 'q' has the scale alpha/r = 1e+06/4 = 2.5e+05, above float16's largest value 6.55e+04, the dtype its base weight computes in"
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def largest(dtype: torch.dtype) -> float:
    """The largest finite value of floating-point ``dtype`` (float32's for any other dtype)."""
    return float(torch.finfo(dtype).max) if dtype.is_floating_point else FLOAT32_MAX


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """LoRA's scale: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (the one formula: the layer's too)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def scale_problem(name: str, alpha: float, rank: int, use_rslora: bool, dtype: torch.dtype) -> str | None:
    """Why module ``name``'s scale overflows ``dtype`` (None: it does not)."""
    value = scale(alpha, rank, use_rslora)
    if value <= largest(dtype):
        return None
    how = f"alpha/sqrt(r) = {alpha:.4g}/sqrt({rank})" if use_rslora else f"alpha/r = {alpha:.4g}/{rank}"
    return (f"module {name!r} has the scale {how} = {value:.4g}, above {dtype_name(dtype)}'s largest value "
            f"{largest(dtype):.4g}, the dtype its base weight computes in")


def factor_problem(name: str, a: Tensor, b: Tensor, factor_scale: float, dtype: torch.dtype) -> str | None:
    """Why module ``name``'s factors ``a`` (r, ...) and ``b`` (..., r, ...) can overflow ``dtype`` (None: they
    cannot): the bound ``s * r * max|A| * max|B|`` on the update's entries above its limit. Non-finite values were
    refused before (``save_adapter``'s and ``load_adapter``'s own checks); here they make the bound NaN or inf, so
    they are refused too."""
    if a.is_meta or b.is_meta:  # no values yet (a model built on the meta device): nothing to check
        return None
    if not a.numel() or not b.numel():
        return None
    max_a, max_b = float(a.detach().abs().max()), float(b.detach().abs().max())
    bound = factor_scale * a.shape[0] * max_a * max_b
    if bound <= largest(dtype):
        return None
    return (f"module {name!r}: max|lora_A| = {max_a:.4g}, max|lora_B| = {max_b:.4g}, so with the scale "
            f"{factor_scale:.4g} and rank {a.shape[0]} the update's entries can reach {bound:.4g}, above "
            f"{dtype_name(dtype)}'s largest value {largest(dtype):.4g}")


def refuse_out_of_range(tensors: dict[str, Tensor], targets: dict[str, Tensor], source: object, prefix: str) -> None:
    """Raise if a file tensor holds values beyond the largest value of the dtype of the parameter it is copied into
    (``targets``, same keys): the copy would turn them into inf."""
    for key, value in tensors.items():
        if not value.is_floating_point() or not value.numel() or not targets[key].is_floating_point():
            continue
        dtype, peak = targets[key].dtype, float(value.detach().abs().max())
        if peak > largest(dtype):
            raise ValueError(
                f"load_adapter: {source} key {prefix}{key} holds {peak:.4g}, above the largest value of "
                f"{dtype_name(dtype)} ({largest(dtype):.4g}), the dtype the model keeps it in: it would load as inf "
                "and make every output non-finite. Nothing was loaded. The adapter was saved from a diverged "
                "training run; retrain it, or load an earlier checkpoint."
            )


def refuse_overflow(problems: list[str], who: str, tail: str) -> None:
    """Raise a ``ValueError`` for the first of ``problems`` (and say how many more), if any."""
    if problems:
        more = f" (and {len(problems) - 1} more module{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise ValueError(f"{who}: {problems[0]}{more}: every output of the adapted model would be inf or NaN. {tail}")


def check_loaded_values(model, adapter, tensors: dict[str, Tensor], targets: dict[str, Tensor], directory: object,
                        named: dict) -> None:
    """Raise, before anything is copied, if the tensors read from ``directory`` would overflow where they go: a
    value beyond its parameter's dtype, or (the technique's `value_problems`) a scale or factor pair beyond the
    dtype its layer computes in."""
    refuse_out_of_range(tensors, targets, directory, adapter.peft_key_prefix)
    refuse_overflow(adapter.value_problems(model, tensors, **named), f"load_adapter: {directory}",
                    "Nothing was loaded. The adapter holds values no float32 training produces (a diverged run, or "
                    "an edited file): retrain it, load an earlier checkpoint, or load it into a wider dtype "
                    "(model.float()) if it was trained in one.")


def refuse_overflowing_scales(model: nn.Module, config, targets: list[str]) -> None:
    """Raise, before anything changes, if the scale a LoRA ``config`` gives one of ``targets`` (module names of
    ``model``) overflows the dtype of that module's weight."""
    for name in targets:
        weight = getattr(model.get_submodule(name), "weight", None)
        if not isinstance(weight, Tensor):
            continue
        alpha = config.alpha_for(name)
        problem = scale_problem(name, alpha, config.rank_for(name), config.use_rslora, weight.dtype)
        if problem:
            raise ValueError(
                f"LoRA(alpha={alpha!r}): {problem}: every output of the adapted model would be inf or NaN. Lower "
                "alpha (alpha_pattern for single modules; the usual values are rank to 2 * rank), or adapt a "
                "float32 copy of the model."
            )
