"""``LoHa`` callback: LoHa (FedPara's low-rank Hadamard product, arXiv:2108.06098) on a LightningModule's model,
injected before the optimizer exists.

The math lives in `lightning_peft.peft.loha` (on `lightning_peft.peft.lycoris`); `LycorisCallback` calls
[`inject_loha`][lightning_peft.peft.inject_loha]'s machinery at ``setup`` (before ``configure_optimizers``, so the
optimizer sees only what trains). A model that already has LoHa is used as it is if the config agrees.
``adapter_only_checkpoint=True`` keeps what trains (the factors, ``modules_to_save``) and buffers. Resuming with
other settings is refused, naming both values. ``MergeOnSave`` adds ``ΔW`` to the weights and writes the adapter in
Hugging Face PEFT's LoHa format.

YAML (LightningCLI):

```yaml
trainer:
  callbacks:
    - class_path: lightning_peft.callbacks.LoHa
      init_args: {target_modules: [query, value], r: 8, alpha: 16, rank_dropout: 0.1}
```
"""

from __future__ import annotations

from lightning_peft.callbacks._lycoris import LycorisCallback
from lightning_peft.peft.loha import LoHaAdapter, LoHaConfig


class LoHa(LycorisCallback):
    """Inject LoHa into the model at ``setup`` and freeze the rest.

    Args:
        target_modules: The modules adapted: names or dotted suffixes (list), or a regular expression (string).
            ``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d``.
        r: The rank of each of the two factor pairs (``ΔW`` has rank up to ``r²``).
        alpha: ``ΔW`` is scaled by ``alpha / r``.
        rank_dropout: In training, the probability of dropping a row of ``ΔW`` for one step.
        module_dropout: In training, the probability of skipping a layer's update for one step.
        use_effective_conv2d: Factor a convolution's kernel too (a Tucker core).
        exclude_modules: Modules never adapted (the ``target_modules`` rules).
        layers_to_transform: Adapt only the targets in these numbered layers; ``layers_pattern`` names the list.
        layers_pattern: The ``nn.ModuleList`` ``layers_to_transform`` counts in (e.g. ``layers``).
        rank_pattern: Per-module ranks, ``{regex: r}``.
        alpha_pattern: Per-module alphas, ``{regex: alpha}``.
        modules_to_save: Modules trained and saved in full, e.g. ``["classifier"]``. None: the task head of a
            Hugging Face task model; ``[]``: none.
        init_weights: Start with ``ΔW = 0`` (the base model's output).
        adapter_only_checkpoint: Checkpoints keep only the factors, ``modules_to_save`` and buffers.
        model_attribute: Where the model is in the LightningModule (`AdapterCallback`'s rule; ``""``: itself).
    """

    who, kind, what = "LoHa", "loha", "a LoHa adapter"
    adapter_class = LoHaAdapter

    def __init__(
        self,
        target_modules: list[str] | str,
        r: int = 8,
        alpha: float = 8,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        use_effective_conv2d: bool = False,
        exclude_modules: list[str] | str | None = None,
        layers_to_transform: list[int] | int | None = None,
        layers_pattern: list[str] | str | None = None,
        rank_pattern: dict[str, int] | None = None,
        alpha_pattern: dict[str, float] | None = None,
        modules_to_save: list[str] | None = None,
        init_weights: bool = True,
        adapter_only_checkpoint: bool = False,
        model_attribute: str | None = None,
    ) -> None:
        super().__init__(adapter_only_checkpoint, model_attribute)
        self.config = LoHaConfig(
            target_modules=target_modules, r=r, alpha=alpha, rank_dropout=rank_dropout, module_dropout=module_dropout,
            use_effective_conv2d=use_effective_conv2d, exclude_modules=exclude_modules,
            layers_to_transform=layers_to_transform, layers_pattern=layers_pattern, rank_pattern=rank_pattern or {},
            alpha_pattern=alpha_pattern or {}, modules_to_save=modules_to_save, init_weights=init_weights)
