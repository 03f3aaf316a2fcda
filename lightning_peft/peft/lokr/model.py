"""LoKr on a whole model: inject, merge, disable, unload, and LoKr's side of the adapter protocol (with Hugging Face
PEFT's file format). The machinery is the one LyCORIS methods share (`lightning_peft.peft.lycoris`); LoKr supplies its
config, its layer and its names.

Paper: Yeh et al., "Navigating Text-To-Image Customization: From LyCORIS Fine-Tuning to Model Evaluation",
arXiv:2309.14859 (LoKr, after KronA, arXiv:2212.10650). The frozen weight ``W`` (out, in) gets a Kronecker-structured
update from a small factor ``W1`` (a, c) and a larger ``W2`` (b, d), ``out = a * b``, ``in = c * d``; ``W2`` (and with
``decompose_both`` also ``W1``) is itself low-rank when ``r`` is small against its sides:

```text
y = W x + ΔW x        ΔW = alpha / r * kron(W1, W2)        kron(W1, W2)[i b + p, j d + q] = W1[i, j] W2[p, q]
```

``W1`` starts at zero (``init_weights="lycoris"``: ``W2``), so the adapted model starts equal to the base. Merged,
``ΔW`` is added to ``W``. The factorization, the full or low-rank choice, the convolution forms (Conv1d, Conv2d,
grouped, and ``use_effective_conv2d``'s Tucker core): `lightning_peft.peft.lokr.kron` and `lightning_peft.peft.lokr.layer`.

Equal to Hugging Face PEFT 0.21.2's LoKr (``peft_type: "LOKR"``): the same targets for a config, the same factors,
outputs, merged weights, files (``<module>.lokr_w1``, ...) and training step (its dropout draws too). Deliberate
differences: a ``rank_dropout`` draw that drops every row gives a zero update (PEFT's, with ``rank_dropout_scale``,
divides 0 by 0: NaN); ``rank_dropout_scale`` rescales in the update's dtype (PEFT's LoKr in float32); a Tucker
``W2`` at ``r = 1`` whose ``torch.kron`` PEFT cannot compute (it raises) works here; a convolution with a
``padding_mode`` other than zeros pads the update as it pads the base (PEFT pads it with zeros).

Examples:
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_lokr, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> sorted(inject_lokr(model, target_modules=["0"], r=1))  # 16 = 4 * 4, 8 = 2 * 4
    ['0']
    >>> trainable_parameters(model).trainable  # lokr_w1 (4, 2) + lokr_w2_a (4, 1) + lokr_w2_b (1, 4)
    16
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import nn

from ..adapter import register, unwrap
from ..lycoris import model as lycoris
from .config import PEFT_TYPE, LoKrConfig
from .layer import LoKrLayer


@register
class LoKrAdapter(lycoris.LycorisAdapter):
    """LoKr's side of the adapter protocol: what [`inject_lokr`][lightning_peft.peft.inject_lokr] did to a model
    (the arguments are `lightning_peft.peft.lycoris.LycorisAdapter`'s)."""

    kind: ClassVar[str] = "lokr"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = LoKrConfig.peft_fields()
    config_class: ClassVar[type[LoKrConfig]] = LoKrConfig
    layer_class: ClassVar[type[LoKrLayer]] = LoKrLayer
    shape_fields: ClassVar[tuple[str, ...]] = ("use_effective_conv2d", "decompose_both", "decompose_factor")


def lokr_layers(model: nn.Module) -> dict[str, LoKrLayer]:
    """All LoKr layers of ``model`` by full module name."""
    return lycoris.layers_of(unwrap(model), LoKrLayer)


def inject_lokr(model: nn.Module, config: LoKrConfig | None = None, **kwargs: Any) -> dict[str, LoKrLayer]:
    """Wrap the ``target_modules`` of ``model`` in `LoKrLayer`s (`lightning_peft.peft.lokr.layer`), in place, and
    freeze everything but their factors (and ``modules_to_save``).

    Args:
        model: Any ``nn.Module`` (a Hugging Face model, the ``PreTrainedModel`` itself).
        config: A [`LoKrConfig`][lightning_peft.peft.LoKrConfig] (``LoKrConfig.from_peft(peft_config)`` reads
            PEFT's); or its fields as keyword arguments.

    Returns:
        The new layers by module name.

    Raises:
        RuntimeError: If ``model`` already has LoKr.
        ValueError: If a name matches nothing, a target is wrapped by another technique, or a setting is invalid.
        TypeError: If a target is a layer LoKr cannot adapt, or an argument has the wrong type.
    """
    return lycoris.inject(model, LoKrConfig.of(config, kwargs, "inject_lokr"), LoKrAdapter)


def merge_lokr(model: nn.Module) -> list[str]:
    """Add every layer's ``ΔW`` to its base weight in place (`unmerge_lokr` subtracts it again); layers already
    merged are left alone. All or nothing.

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no LoKr, a weight is tied to another module or quantized, or a merged weight
            is not finite (the layers merged by this call are unmerged again).
    """
    return lycoris.merge(model, LoKrAdapter)


def unmerge_lokr(model: nn.Module) -> list[str]:
    """Subtract the merged updates from the base weights, in place (exact up to one rounding in the weight's dtype).

    Raises:
        RuntimeError: If no LoKr layer is merged.
    """
    return lycoris.unmerge(model, LoKrAdapter)


@contextlib.contextmanager
def disable_lokr(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it every LoKr layer computes its base layer's output, and every ``modules_to_save``
    wrapper its original module's.

    Raises:
        RuntimeError: If ``model`` has no LoKr, or a layer is merged.
    """
    with lycoris.disable(model, LoKrAdapter):
        yield


def unload_lokr(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove LoKr from ``model`` in place and return the plain model: with ``merge``, the updates added to the base
    weights and the trained ``modules_to_save`` copies kept; without, the base as it was. Other techniques stay.

    Raises:
        RuntimeError: If ``model`` has no LoKr, or (``merge``) a merged weight would be quantized or not finite.
    """
    return lycoris.unload(model, LoKrAdapter, merge)
