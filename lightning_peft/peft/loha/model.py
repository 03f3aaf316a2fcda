"""LoHa on a whole model: inject, merge, disable, unload, and LoHa's side of the adapter protocol (with Hugging Face
PEFT's file format). The machinery is the one LyCORIS methods share (`lightning_peft.peft.lycoris`); LoHa supplies its
config, its layer and its names.

Paper: Hyeon-Woo, Ye-Bin and Oh, "FedPara: Low-Rank Hadamard Product for Communication-Efficient Federated Learning",
arXiv:2108.06098, as LyCORIS adapts it to fine-tuning. The frozen weight ``W`` gets an update of rank up to ``r²``
from ``2 r (out + in)`` parameters (LoRA's rank ``r`` takes ``r (out + in)``):

```text
y = W x + ΔW x        ΔW = alpha / r * (w1_a w1_b) ⊙ (w2_a w2_b)        (⊙: elementwise)
```

``w2_b`` starts at zero, so the adapted model starts equal to the base. Merged, ``ΔW`` is added to ``W``. Shapes, the
convolution forms (Conv1d, Conv2d, grouped, and ``use_effective_conv2d``'s Tucker core): `lightning_peft.peft.loha.layer`.

Equal to Hugging Face PEFT 0.21.2's LoHa (``peft_type: "LOHA"``): the same targets for a config, the same outputs,
merged weights, files (``<module>.hada_w1_a``, ...) and training step (its dropout draws too). Three deliberate
differences: the Tucker form's gradients of ``hada_w1_a`` / ``hada_w2_a`` are autograd's (PEFT's hand-written backward
gets them wrong), a ``rank_dropout`` draw that drops every row gives a zero update (PEFT's divides 0 by 0: NaN), and a
convolution with a ``padding_mode`` other than zeros pads the update as it pads the base (PEFT pads it with zeros, so
such an adapter is not saved in PEFT's format).

Examples:
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_loha, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> sorted(inject_loha(model, target_modules=["0"], r=2))
    ['0']
    >>> trainable_parameters(model).trainable  # 2 * (16 * 2 + 2 * 8)
    96
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import nn

from ..adapter import register, unwrap
from ..lycoris import model as lycoris
from .config import PEFT_TYPE, LoHaConfig
from .layer import LoHaLayer


@register
class LoHaAdapter(lycoris.LycorisAdapter):
    """LoHa's side of the adapter protocol: what [`inject_loha`][lightning_peft.peft.inject_loha] did to a model
    (the arguments are `lightning_peft.peft.lycoris.LycorisAdapter`'s)."""

    kind: ClassVar[str] = "loha"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = LoHaConfig.peft_fields()
    config_class: ClassVar[type[LoHaConfig]] = LoHaConfig
    layer_class: ClassVar[type[LoHaLayer]] = LoHaLayer


def loha_layers(model: nn.Module) -> dict[str, LoHaLayer]:
    """All LoHa layers of ``model`` by full module name."""
    return lycoris.layers_of(unwrap(model), LoHaLayer)


def inject_loha(model: nn.Module, config: LoHaConfig | None = None, **kwargs: Any) -> dict[str, LoHaLayer]:
    """Wrap the ``target_modules`` of ``model`` in `LoHaLayer`s (`lightning_peft.peft.loha.layer`), in place, and
    freeze everything but their factors (and ``modules_to_save``).

    Args:
        model: Any ``nn.Module`` (a Hugging Face model, the ``PreTrainedModel`` itself).
        config: A [`LoHaConfig`][lightning_peft.peft.LoHaConfig] (``LoHaConfig.from_peft(peft_config)`` reads
            PEFT's); or its fields as keyword arguments.

    Returns:
        The new layers by module name.

    Raises:
        RuntimeError: If ``model`` already has LoHa.
        ValueError: If a name matches nothing, a target is wrapped by another technique, or a setting is invalid.
        TypeError: If a target is a layer LoHa cannot adapt, or an argument has the wrong type.
    """
    return lycoris.inject(model, LoHaConfig.of(config, kwargs, "inject_loha"), LoHaAdapter)


def merge_loha(model: nn.Module) -> list[str]:
    """Add every layer's ``ΔW`` to its base weight in place (`unmerge_loha` subtracts it again); layers already
    merged are left alone. All or nothing.

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no LoHa, a weight is tied to another module or quantized, or a merged weight
            is not finite (the layers merged by this call are unmerged again).
    """
    return lycoris.merge(model, LoHaAdapter)


def unmerge_loha(model: nn.Module) -> list[str]:
    """Subtract the merged updates from the base weights, in place (exact up to one rounding in the weight's dtype).

    Raises:
        RuntimeError: If no LoHa layer is merged.
    """
    return lycoris.unmerge(model, LoHaAdapter)


@contextlib.contextmanager
def disable_loha(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it every LoHa layer computes its base layer's output, and every ``modules_to_save``
    wrapper its original module's.

    Raises:
        RuntimeError: If ``model`` has no LoHa, or a layer is merged.
    """
    with lycoris.disable(model, LoHaAdapter):
        yield


def unload_loha(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove LoHa from ``model`` in place and return the plain model: with ``merge``, the updates added to the base
    weights and the trained ``modules_to_save`` copies kept; without, the base as it was. Other techniques stay.

    Raises:
        RuntimeError: If ``model`` has no LoHa, or (``merge``) a merged weight would be quantized or not finite.
    """
    return lycoris.unload(model, LoHaAdapter, merge)
