"""Dynamic token pruning: drop the least important tokens as the forward pass goes deeper.

Papers: Kim et al., "Learned Token Pruning for Transformers" (LTP), KDD 2022, arXiv:2107.00910 (importance of a
token = the attention it receives, averaged over heads and queries); Liang et al., "Not All Patches are What You
Need: Expediting Vision Transformers via Token Reorganizations" (EViT), ICLR 2022, arXiv:2202.07800 (importance =
the attention the classification token pays it); Rao et al., "DynamicViT", NeurIPS 2021, arXiv:2106.02034
(keeping a fixed share of the tokens per layer, a schedule over layers).

Rule. Layer ``i`` of an encoder with ``N`` layers gets ``n`` tokens (``n`` = the sequence length at layer 0, the
tokens kept by layer ``i - 1`` after it). Its attention sublayer runs on all ``n`` and also returns each token's
importance; then only the ``K = ceil(r_i * n)`` most important tokens go through its feed-forward sublayer and on
to layer ``i + 1``. The classification token (index 0) is always kept, padding always ranks below every real token
(so it is dropped first), and the kept tokens keep their order. A dropped token keeps the hidden state it had when
it was dropped (the encoder scatters the kept ones back), so the encoder output keeps shape ``(B, L, hidden)``:

```text
r_i = 1                          i < start_layer                  (a float keep_ratio r)
r_i = r                          i >= start_layer
r_i = keep_ratio[i]                                               (a sequence: one ratio per layer)
effective r_i = 1 - scale * (1 - r_i)                             (scale 1: as configured; 0: no pruning)
```

With a float ``r`` the share of tokens left after layer ``i >= start_layer`` is about ``r ** (i - start_layer +
1)``: MiniLM (6 layers, 128 tokens), ``r = 0.5``, ``start_layer = 1`` keeps 128, 64, 32, 16, 8, 4 tokens. The
``TokenPruning`` callback anneals ``scale`` from 0 to 1 during fine-tuning, so the model learns to work with ever
fewer tokens; at ``r_i = 1`` no token is dropped and the encoder computes exactly what it computes without a pruner.

Shapes (``B`` batch, ``L`` tokens reaching the layer, ``K`` kept):

| tensor | shape | meaning |
| --- | --- | --- |
| ``importance`` | ``(B, L)`` | attention each token receives (any real dtype) |
| ``key_padding_mask`` | ``(B, L)`` | bool, True for real tokens; None: all real |
| return of ``select`` | ``(B, K)`` | long indices into ``L``, ascending, column 0 is index 0 |

Examples:
    >>> import torch
    >>> pruner = TokenPruner(keep_ratio=0.5, start_layer=1)
    >>> [pruner.keep_ratio_at(i, 4) for i in range(4)]
    [1.0, 0.5, 0.5, 0.5]
    >>> importance = torch.tensor([[0.0, 0.3, 0.1, 0.4, 0.2, 0.9]])
    >>> mask = torch.tensor([[True, True, True, True, True, False]])  # the last token is padding
    >>> pruner.select(importance, mask, 0.5)  # ceil(0.5 * 6) = 3: [CLS] and the two best real tokens
    tensor([[0, 1, 3]])
    >>> pruner.token_counts(128, 6)
    [128, 64, 32, 16, 8, 4]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_peft._checks import choice, fraction, integer, real

IMPORTANCES = ("mean", "cls")
_ROUNDING = 1e-9  # ceil(r * n) with a little slack, so that 0.07 * 100 = 7.000000000000001 keeps 7


def kept_count(length: int, keep_ratio: float) -> int:
    """``K = ceil(keep_ratio * length)``, at least 1: how many of ``length`` tokens a layer keeps.

    Examples:
        >>> kept_count(128, 0.7), kept_count(10, 0.01), kept_count(100, 0.07)
        (90, 1, 7)
    """
    return max(1, math.ceil(keep_ratio * length - _ROUNDING))


class TokenPruner(nn.Module):
    """Which tokens each encoder layer keeps: a keep ratio per layer and the selection rule.

    It has no parameters; it is a module so that it shows in ``print(model)`` and travels with the encoder. The encoder
    asks it for [`keep_ratio_at`][lightning_peft.nn.TokenPruner.keep_ratio_at] each layer and, where that is below 1,
    for [`select`][lightning_peft.nn.TokenPruner.select].

    Args:
        keep_ratio: A float ``r`` in (0, 1]: every layer ``i >= start_layer`` keeps ``ceil(r * n)`` of the ``n``
            tokens reaching it. Or a sequence of ratios in (0, 1], one per layer (its length must equal the
            number of layers; ``start_layer`` is then ignored).
        start_layer: First layer that prunes (for a float ``keep_ratio``); layers before it keep every token.
            Layer 0's attention has not mixed the tokens yet, so its importance is least informative.
        importance: ``"mean"``: the attention a token receives, averaged over heads and real queries (LTP);
            ``"cls"``: the attention the first (classification) token pays it (EViT).

    Attributes:
        scale: In [0, 1]; the effective ratio is ``1 - scale * (1 - r_i)``. 1.0 (the default) applies the
            configured ratios, 0.0 turns pruning off. The ``TokenPruning`` callback anneals it.

    Raises:
        ValueError: If a ratio is outside (0, 1], ``start_layer`` is negative, or ``importance`` is unknown.
        TypeError: If an argument has the wrong type.
    """

    def __init__(
        self, keep_ratio: float | Sequence[float] = 0.7, start_layer: int = 1, importance: str = "mean"
    ) -> None:
        super().__init__()
        self.keep_ratio = _check_keep_ratio(keep_ratio)
        self.start_layer = integer("TokenPruner", "start_layer", start_layer, minimum=0,
                                   meaning="0 prunes from the first layer on")
        self.importance = str(choice("TokenPruner", "importance", importance, IMPORTANCES))
        self._scale = 1.0

    @property
    def scale(self) -> float:
        """How much of the configured pruning applies, in [0, 1] (see the class docstring)."""
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = real("TokenPruner", "scale", value, minimum=0, maximum=1,
                           meaning="0: no pruning, 1: the configured keep ratios")

    def configured_ratio(self, layer_index: int, num_layers: int) -> float:
        """The keep ratio of layer ``layer_index`` as configured (before ``scale``)."""
        integer("TokenPruner", "num_layers", num_layers, minimum=1)
        integer("TokenPruner", "layer_index", layer_index, minimum=0, maximum=num_layers - 1,
                meaning=f"a layer of an encoder with {num_layers} layers")
        if isinstance(self.keep_ratio, tuple):
            self.check_num_layers(num_layers)
            return self.keep_ratio[layer_index]
        return self.keep_ratio if layer_index >= self.start_layer else 1.0

    def check_num_layers(self, num_layers: int) -> None:
        """Raises ``ValueError`` if a per-layer schedule does not have ``num_layers`` ratios."""
        if isinstance(self.keep_ratio, tuple) and len(self.keep_ratio) != num_layers:
            raise ValueError(
                f"TokenPruner(keep_ratio={list(self.keep_ratio)}): a schedule of {len(self.keep_ratio)} ratios for "
                f"an encoder of {num_layers} layers; give exactly one ratio per layer ({num_layers}), or one float."
            )

    def keep_ratio_at(self, layer_index: int, num_layers: int) -> float:
        """The effective keep ratio of layer ``layer_index``: ``1 - scale * (1 - r_i)``; 1.0 means no pruning.

        Raises:
            ValueError: If ``layer_index`` is not in ``[0, num_layers)``, or a schedule's length is not ``num_layers``.
        """
        configured = self.configured_ratio(layer_index, num_layers)
        return 1.0 - self._scale * (1.0 - configured)

    def select(self, importance: Tensor, key_padding_mask: Tensor | None, keep_ratio: float) -> Tensor:
        """The indices of the tokens to keep, ``(B, K)`` long, ascending, with ``K = ceil(keep_ratio * L)``.

        Index 0 is always kept; padding (False in ``key_padding_mask``) ranks below every real token, so it is
        kept only when ``K`` exceeds a sample's real tokens. Among real tokens the most important ones are kept.

        Args:
            importance: ``(B, L)`` importance of each token (higher: more important).
            key_padding_mask: ``(B, L)`` bool, True for real tokens; None when there is no padding.
            keep_ratio: In (0, 1].

        Raises:
            ValueError: If ``keep_ratio`` is outside (0, 1] or the shapes do not fit.
            TypeError: If ``key_padding_mask`` is not a bool tensor.
        """
        _check_ratio_value("TokenPruner.select", "keep_ratio", keep_ratio)
        _check_select_inputs(importance, key_padding_mask)
        count = kept_count(importance.shape[1], keep_ratio)
        scores = importance.detach().to(torch.promote_types(importance.dtype, torch.float32)).clone()  # (B, L)
        if key_padding_mask is not None:
            scores = scores.masked_fill(~key_padding_mask, float("-inf"))
        scores[:, 0] = float("inf")
        chosen = scores.topk(count, dim=1, sorted=False).indices  # (B, K)
        return chosen.sort(dim=1).values

    def token_counts(self, length: int, num_layers: int) -> list[int]:
        """Tokens leaving each layer for one unpadded sequence of ``length`` tokens, at the current ``scale``.

        The encoder's work: layer ``i``'s attention runs on the tokens entering it (``length`` for layer 0, else
        entry ``i - 1``), its feed-forward on entry ``i``.
        """
        counts, tokens = [], length
        for layer in range(num_layers):
            ratio = self.keep_ratio_at(layer, num_layers)
            tokens = kept_count(tokens, ratio) if ratio < 1.0 else tokens
            counts.append(tokens)
        return counts

    def extra_repr(self) -> str:
        ratio = list(self.keep_ratio) if isinstance(self.keep_ratio, tuple) else self.keep_ratio
        start = "" if isinstance(self.keep_ratio, tuple) else f", start_layer={self.start_layer}"
        return f"keep_ratio={ratio}{start}, importance={self.importance!r}, scale={self._scale:g}"


def _check_ratio_value(who: str, name: str, value: object) -> float:
    return fraction(who, name, value, example="0.7", meaning="1.0 keeps every token, 0.5 half")


def _check_keep_ratio(keep_ratio: object) -> float | tuple[float, ...]:
    who = f"TokenPruner(keep_ratio={keep_ratio!r})"
    if isinstance(keep_ratio, Sequence) and not isinstance(keep_ratio, str):
        if not keep_ratio:
            raise ValueError(f"{who}: an empty schedule; give one ratio per layer, or one float.")
        return tuple(_check_ratio_value("TokenPruner", f"keep_ratio[{i}]", r) for i, r in enumerate(keep_ratio))
    if isinstance(keep_ratio, Tensor):
        raise TypeError(f"{who}: give a float or a list of floats, not a tensor.")
    return _check_ratio_value("TokenPruner", "keep_ratio", keep_ratio)


def _check_select_inputs(importance: Tensor, key_padding_mask: Tensor | None) -> None:
    if not isinstance(importance, Tensor) or importance.dim() != 2 or importance.shape[1] == 0:
        shape = tuple(importance.shape) if isinstance(importance, Tensor) else type(importance).__name__
        raise ValueError(f"TokenPruner.select: importance has shape {shape}; it must be (batch, tokens) with at "
                         "least one token.")
    if key_padding_mask is None:
        return
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
        got = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
        raise TypeError(f"TokenPruner.select: key_padding_mask is {got}; it must be a bool tensor, True for real "
                        "tokens (e.g. attention_mask.bool()).")
    if key_padding_mask.shape != importance.shape:
        raise ValueError(f"TokenPruner.select: key_padding_mask has shape {tuple(key_padding_mask.shape)}, "
                         f"importance {tuple(importance.shape)}; they must be the same (batch, tokens).")
