"""OFT on a whole model: inject, merge, disable, unload, and OFT's side of the adapter protocol (with Hugging Face
PEFT's file format).

Papers: Qiu et al., "Controlling Text-to-Image Diffusion by Orthogonal Finetuning", arXiv:2306.07280; Qiu et al.,
"Orthogonal Finetuning Made Scalable", arXiv:2506.19847 (the input-centric form and the Cayley-Neumann series PEFT
0.21 uses). A frozen weight ``W`` is multiplied by a learned orthogonal matrix, which keeps the angles between its
neurons (the "hyperspherical energy"); the matrix is block diagonal, each block the Cayley transform of a
skew-symmetric ``Q_i``:

```text
y = W (x M) + b,    M = diag(R_1, ..., R_r),    R_i = (I - Q_i)(I + Q_i)^-1    (or a truncated Neumann series)
```

``Q = 0`` at the start, so the adapted model starts equal to the base. Merged: ``W' = W M^T`` (an embedding:
``E' = E M``). Shapes, the layer types and the Cayley variants: `lightning_peft.peft.oft.layer`.

Equal to Hugging Face PEFT 0.21.2's OFT (``peft_type: "OFT"``): the same targets for a config, the same outputs,
merged weights and files (``<module>.oft_R.weight``; an embedding's ``oft_embedding_R.weight``). Deliberate
differences: a size the blocks do not divide is refused (PEFT picks another ``r`` with a warning; the file then
says the ``r`` asked for); ``module_dropout`` drops blocks in training (PEFT 0.21.2 builds its dropout layer and never
calls it); a ``Conv2d`` rotates its weight, which is what PEFT's merge computes (PEFT's unmerged forward folds
rotated patches back and differs from its merge whenever patches overlap). PEFT's OFT has no transformers
``Conv1D``, grouped, dilated or non-square convolution: refused.

Examples:
    >>> from torch import nn
    >>> from lightning_peft.peft import inject_oft, trainable_parameters
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> sorted(inject_oft(model, target_modules=["0", "2"], oft_block_size=4))
    ['0', '2']
    >>> trainable_parameters(model).trainable  # 2 blocks of 4x4 (6 each) + 4 blocks of 4x4
    36
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import Tensor, nn

from .. import _wrapping as wrapping
from .._block_adapter import BlockAdapter
from ..adapter import register
from .config import PEFT_FIELDS, PEFT_TYPE, WHO, OFTConfig, as_config
from .layer import OFTLayer, rotated_size

PEFT_VERSION = "0.21.2"  # the PEFT whose OFT (its Cayley-Neumann series of 0.18 on) ours equals; written to our files
TARGETING = wrapping.Targeting(
    WHO, "OFT", "rotate", "nn.Linear, nn.Conv2d, nn.Embedding",
    lambda m: isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding)), "model.layers.0.self_attn.q_proj",
    note="; it has none for transformers Conv1D either")


def oft_layers(model: nn.Module) -> dict[str, OFTLayer]:
    """All OFT layers of ``model`` by full module name."""
    return wrapping.layers_of(model, OFTLayer)


def inject_oft(model: nn.Module, config: OFTConfig | None = None, **kwargs: Any) -> dict[str, OFTLayer]:
    """Wrap the ``target_modules`` of ``model`` in `OFTLayer`s (`lightning_peft.peft.oft.layer`), in place, and
    freeze everything but the rotations (and ``modules_to_save``, and the biases ``bias`` names).

    Args:
        model: Any ``nn.Module`` (a Hugging Face model, the ``PreTrainedModel`` itself).
        config: An [`OFTConfig`][lightning_peft.peft.OFTConfig]; or its fields as keyword arguments.

    Returns:
        The new layers by module name.

    Raises:
        RuntimeError: If ``model`` already has OFT.
        ValueError: If a name matches nothing, a target's size is not divisible into blocks, a convolution is of a
            kind PEFT's OFT has no format for, a target is wrapped by another technique, or a setting is invalid.
        TypeError: If a target is a layer OFT cannot rotate, or an argument has the wrong type.
    """
    return OFTAdapter.place(model, as_config(config, kwargs, "inject_oft"))


def block_size(name: str, module: nn.Module, config: OFTConfig) -> int:
    """The block size of target ``name``; raises, with the sizes that fit, if ``r`` / ``oft_block_size`` does not
    divide its rotated size (PEFT would pick another one, with a warning, and save the one asked for)."""
    size = rotated_size(module)
    given, asked = ("r", config.r) if config.r else ("oft_block_size", config.oft_block_size)
    if size % asked or asked > size:
        fits = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(f"{WHO}({given}={asked}): {name!r} ({type(module).__name__}) rotates {size} features, which "
                         f"{given}={asked} does not divide into blocks. Give {given} among {fits} (r * oft_block_size "
                         f"= {size}), or leave this module out of target_modules.")
    size_of_block = size // asked if config.r else asked
    if size_of_block < 2:
        raise ValueError(f"{WHO}({given}={asked}): {name!r} would get blocks of size 1, which cannot rotate anything. "
                         f"Give a smaller r (at most {size // 2}) or oft_block_size >= 2.")
    return size_of_block


def unload_oft(model: nn.Module, merge: bool = True) -> nn.Module:
    """Remove OFT from ``model`` in place and return the plain model: with ``merge``, the rotations folded into the
    base weights and the trained ``modules_to_save`` copies kept; without, the base as it was. Other techniques stay.

    Raises:
        RuntimeError: If ``model`` has no OFT, or (``merge``) a merged weight would be quantized or not finite.
    """
    return wrapping.unload(model, OFTAdapter, merge)


def merge_oft(model: nn.Module) -> list[str]:
    """Fold every rotation into its base weight in place (`unmerge_oft` undoes it); layers already merged are left
    alone. All or nothing.

    Returns:
        The names of the layers this call merged.

    Raises:
        RuntimeError: If ``model`` has no OFT, a weight is tied to another module or quantized, or a merged weight is
            not finite (the layers merged by this call are unmerged again).
    """
    return wrapping.merge(model, OFTAdapter)


def unmerge_oft(model: nn.Module) -> list[str]:
    """Take the merged rotations out of the base weights, in place (exact up to rounding).

    Raises:
        RuntimeError: If no OFT layer is merged.
    """
    return wrapping.unmerge(model, OFTAdapter)


@contextlib.contextmanager
def disable_oft(model: nn.Module) -> Iterator[None]:
    """Context manager: inside it every OFT layer computes its base layer's output, and every ``modules_to_save``
    wrapper its original module's (trained biases stay trained, as in PEFT).

    Raises:
        RuntimeError: If ``model`` has no OFT, or a layer is merged (the base output is then not available).
    """
    with wrapping.disable(model, OFTAdapter, "rotations"):
        yield


# --- the adapter protocol ------------------------------------------------------------------------------------


@register
class OFTAdapter(BlockAdapter):
    """OFT's side of the adapter protocol: what [`inject_oft`][lightning_peft.peft.inject_oft] did to a model
    (`lightning_peft.peft._block_adapter.BlockAdapter`: targets with their block sizes, trained biases,
    ``modules_to_save``)."""

    kind: ClassVar[str] = "oft"
    peft_type: ClassVar[str] = PEFT_TYPE
    peft_fields: ClassVar[frozenset[str]] = PEFT_FIELDS
    training_only: ClassVar[tuple[str, ...]] = ("init_weights", "module_dropout")
    config_class, layer_class, targeting = OFTConfig, OFTLayer, TARGETING
    block_size = staticmethod(block_size)
    compared = ("r", "oft_block_size", "coft", "eps", "block_share", "use_cayley_neumann", "num_cayley_neumann_terms",
                "bias")
    written = ("r", "oft_block_size", "module_dropout", "bias", "coft", "eps", "block_share", "use_cayley_neumann",
               "num_cayley_neumann_terms", "init_weights")

    def own(self, layer: nn.Module, name: str) -> dict[str, Tensor]:
        return {f"{name}.{layer.key}.weight": layer.rotation.weight}

    def peft_config(self, model: nn.Module) -> dict[str, Any]:
        # PEFT reads a Cayley-Neumann file without peft_version as one of its old series
        return {**super().peft_config(model), "peft_version": PEFT_VERSION}
