"""``LoKr`` callback: LoKr (LyCORIS' low-rank Kronecker product, arXiv:2309.14859) on a LightningModule's model,
injected before the optimizer exists.

The math lives in `lightning_peft.peft.lokr` (on `lightning_peft.peft.lycoris`); `LycorisCallback` calls
[`inject_lokr`][lightning_peft.peft.inject_lokr]'s machinery at ``setup`` (before ``configure_optimizers``, so the
optimizer sees only what trains; refused under tensor parallelism). ``adapter_only_checkpoint=True`` keeps what trains
(the factors, ``modules_to_save``) and buffers; a resume with other settings is refused, naming both; ``MergeOnSave``
adds ``ΔW`` to the weights and writes the adapter in Hugging Face PEFT's LoKr format.

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.LoKr
      init_args: {target_modules: [query, value], r: 4, alpha: 8, decompose_both: true}
```
"""

from __future__ import annotations

from lightning_peft.callbacks._lycoris import LycorisCallback
from lightning_peft.peft.lokr import LoKrAdapter, LoKrConfig


class LoKr(LycorisCallback):
    """Inject LoKr into the model at ``setup`` and freeze the rest. The arguments are
    [`LoKrConfig`][lightning_peft.peft.LoKrConfig]'s (PEFT's names), and:

    Args:
        adapter_only_checkpoint: Checkpoints keep only the factors, ``modules_to_save`` and buffers.
        model_attribute: Where the model is in the LightningModule (`AdapterCallback`'s rule; ``""``: itself).
    """

    who, kind, what = "LoKr", "lokr", "a LoKr adapter"
    adapter_class = LoKrAdapter

    def __init__(
        self,
        target_modules: list[str] | str,
        r: int = 8,
        alpha: float = 8,
        exclude_modules: list[str] | str | None = None,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        use_effective_conv2d: bool = False,
        decompose_both: bool = False,
        decompose_factor: int = -1,
        rank_dropout_scale: bool = False,
        init_weights: bool | str = True,
        layers_to_transform: list[int] | int | None = None,
        layers_pattern: list[str] | str | None = None,
        rank_pattern: dict[str, int] | None = None,
        alpha_pattern: dict[str, float] | None = None,
        modules_to_save: list[str] | None = None,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = LoKrConfig(
            target_modules=target_modules, r=r, alpha=alpha, exclude_modules=exclude_modules,
            rank_dropout=rank_dropout, module_dropout=module_dropout, use_effective_conv2d=use_effective_conv2d,
            decompose_both=decompose_both, decompose_factor=decompose_factor, rank_dropout_scale=rank_dropout_scale,
            init_weights=init_weights, layers_to_transform=layers_to_transform, layers_pattern=layers_pattern,
            rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {}, modules_to_save=modules_to_save)
