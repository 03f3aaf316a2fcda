"""``TokenPruning`` callback: dynamic token pruning in a ``TransformerEncoder``, annealed during fine-tuning.

The rule lives in `lightning_peft.nn.token_pruning` ([`TokenPruner`][lightning_peft.nn.TokenPruner]); the encoder
applies it; the annealing and the kept-share count are in `lightning_peft.training.token_pruning`. This callback only
decides *where* and *how much*:

- ``setup`` (every stage) finds the ``TransformerEncoder`` modules inside the LightningModule (or under
  ``model_attribute``) and installs a ``TokenPruner`` on each (``encoder.token_pruner``); a LightningModule
  without one is refused there, before any step. The pruner stays installed after ``fit``, so ``test`` and
  ``predict`` (and plain inference with the same module object afterwards) prune with the scale training reached.
  The pruner is not part of the model's weights: a module rebuilt with ``load_from_checkpoint`` does not prune
  until a Trainer with this callback runs it (its checkpointed scale is restored) or ``encoder.token_pruner`` is
  set by hand.
- During ``fit`` the pruner's ``scale`` grows linearly from 0 (no pruning) to 1 (the configured keep ratios)
  over the first ``anneal_fraction`` of the optimizer steps (``trainer.estimated_stepping_batches``), set
  before every training batch from ``trainer.global_step``:

  ```text
  scale(t) = min(1, t / (anneal_fraction * total_steps))        (1 throughout when anneal_fraction = 0)
  effective keep ratio of layer i = 1 - scale(t) * (1 - r_i)
  ```

- The checkpoint holds the settings, the scale reached and the annealing length, so a resumed run anneals
  exactly as the straight run did (even if it is resumed with a longer ``max_epochs``) and ``test(ckpt_path=...)``
  prunes as the checkpointed model did. Resuming with other settings is refused.

Logged: ``token_pruning_scale`` and ``kept_token_share`` every training step, ``val_kept_token_share`` and
``test_kept_token_share`` per epoch. The kept share is the share of the token-layer work left: the real tokens
leaving each layer, summed over layers and samples, over ``num_layers`` times the real tokens entering the encoder
(1.0 without pruning; MiniLM at ``keep_ratio=0.5, start_layer=1`` on full 128-token inputs: about 0.33).

YAML:

```yaml
- class_path: lightning_peft.callbacks.TokenPruning
  init_args: {keep_ratio: 0.7, start_layer: 1, importance: mean, anneal_fraction: 0.3}
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_peft._checks import real
from lightning_peft._seams import refuse, tensor_parallel_size
from lightning_peft.callbacks._lightning import refuse_changed_settings
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._target import resolve_target
from lightning_peft.nn.token_pruning import TokenPruner
from lightning_peft.nn.transformer import TransformerEncoder
from lightning_peft.peft.adapter import unwrap
from lightning_peft.training.token_pruning import KeptTokenShare, anneal_scale, anneal_steps

__all__ = ["TokenPruning"]

_SETTINGS = ("keep_ratio", "start_layer", "importance", "anneal_fraction")


class TokenPruning(Callback):
    """Install a `TokenPruner` in every ``TransformerEncoder`` and anneal it.

    Args:
        keep_ratio: A float in (0, 1] (each layer from ``start_layer`` on keeps that share of the tokens reaching
            it), or a list of ratios, one per encoder layer.
        start_layer: First pruning layer, for a float ``keep_ratio``.
        importance: ``"mean"`` (attention received: LTP) or ``"cls"`` (attention from the first token: EViT).
        anneal_fraction: Share of the run's optimizer steps over which pruning is phased in linearly, in [0, 1];
            0 prunes at the configured ratios from the first step.
        model_attribute: Dotted path of the submodule to search for encoders (``"encoder"``, ``"model.backbone"``);
            None searches the whole LightningModule.
        log: Log the scale and the kept-token share.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a keep ratio is outside (0, 1], ``start_layer`` is negative, ``importance`` unknown, or
            ``anneal_fraction`` outside [0, 1].
    """

    def __init__(
        self,
        keep_ratio: float | list[float] = 0.5,
        start_layer: int = 1,
        importance: str = "mean",
        anneal_fraction: float = 0.3,
        model_attribute: str | None = None,
        log: bool = True,
    ) -> None:
        TokenPruner(keep_ratio, start_layer, importance)  # checks the pruner's arguments now, not at setup
        real("TokenPruning", "anneal_fraction", anneal_fraction, minimum=0, maximum=1,
             meaning="the share of the optimizer steps over which pruning is phased in; 0: prune fully from step 0")
        if model_attribute is not None and not isinstance(model_attribute, str):
            raise TypeError(f"TokenPruning(model_attribute={model_attribute!r}): give a dotted submodule path or None.")
        self.keep_ratio = list(keep_ratio) if isinstance(keep_ratio, Sequence) else float(keep_ratio)
        self.start_layer, self.importance = start_layer, importance
        self.anneal_fraction = float(anneal_fraction)
        self.model_attribute, self.log_values = model_attribute, log
        self.scale = 1.0  # what eval/test/predict use before any fit: the configured ratios
        self.anneal_steps: float | None = None  # set at the start of training (or restored)
        self.pruners: dict[str, TokenPruner] = {}  # encoder path -> its pruner
        self._encoders: dict[str, TransformerEncoder] = {}
        self._hooks: list[RemovableHandle] = []
        self._counts = KeptTokenShare()  # the real tokens entering each encoder

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer is not None and tensor_parallel_size(trainer.strategy) > 1:
            raise refuse("TokenPruning", trainer.strategy, "a token's importance is the attention it receives, averaged "
                         "over the heads, and tensor parallelism gives each rank a share of the heads, so the ranks "
                         "would keep different tokens", "prune tokens under DDP, ZeRO or one process, or train without "
                         "TokenPruning under tensor parallelism")
        if trainer is not None:
            keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        self._install(pl_module)
        if stage == "fit":
            self.anneal_steps = None  # a new fit anneals anew, unless a checkpoint restores it
            self._set_scale(0.0 if self.anneal_fraction > 0 else 1.0)  # step 0's, for the sanity check

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._counts.clear()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning skips teardown hooks after an exception

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.anneal_steps is None:
            self.anneal_steps = self._anneal_length(trainer)
        self._set_scale(anneal_scale(trainer.global_step, self.anneal_steps))

    def _anneal_length(self, trainer: pl.Trainer) -> float:
        if self.anneal_fraction == 0.0:  # without asking the trainer for its estimate (it may load the data)
            return 0.0
        return anneal_steps(self.anneal_fraction, trainer.estimated_stepping_batches, "TokenPruning")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.anneal_steps is None:  # on_train_start sets it; a loop that skipped it still anneals
            self.anneal_steps = self._anneal_length(trainer)
        self._set_scale(anneal_scale(trainer.global_step, self.anneal_steps))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.log_values:
            pl_module.log("token_pruning_scale", self.scale, on_step=True, on_epoch=False)
            self._log_share(pl_module, "kept_token_share", on_step=True, on_epoch=False)

    # The evaluation hooks log the last forward's share: they read no outputs, batch or index.
    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any, **__: Any) -> None:
        if self.log_values and not trainer.sanity_checking:
            self._log_share(pl_module, "val_kept_token_share", on_step=False, on_epoch=True)

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any, **__: Any) -> None:
        if self.log_values:
            self._log_share(pl_module, "test_kept_token_share", on_step=False, on_epoch=True)

    def kept_token_share(self) -> tuple[Tensor, int] | None:
        """``(share, samples)`` of the encoders' last forward (see the module docstring); None before any forward."""
        return self._counts.share(self._encoders.values())

    def _log_share(self, pl_module: pl.LightningModule, name: str, on_step: bool, on_epoch: bool) -> None:
        share = self.kept_token_share()
        if share is not None:
            pl_module.log(name, share[0], on_step=on_step, on_epoch=on_epoch, batch_size=share[1])

    def _install(self, pl_module: pl.LightningModule) -> None:
        """Finds the encoders, installs (or keeps) this callback's pruner on each, hooks their input count."""
        self.teardown(None, pl_module, "")  # type: ignore[arg-type]  # hooks of an earlier stage
        encoders = find_encoders(pl_module, self.model_attribute)
        mine = {id(p) for p in self.pruners.values()}
        pruners = {}
        for name, encoder in encoders.items():
            current = encoder.token_pruner
            if current is not None and id(current) not in mine:
                raise ValueError(
                    f"TokenPruning: the TransformerEncoder at {name or type(pl_module).__name__!r} already has a "
                    f"token_pruner ({current.extra_repr()}). Use one of the two: drop token_pruner from the encoder's "
                    "arguments, or the TokenPruning callback."
                )
            pruner = current if current is not None else TokenPruner(self.keep_ratio, self.start_layer, self.importance)
            pruner.check_num_layers(len(encoder.layers))
            pruner.scale = self.scale
            encoder.token_pruner = pruner
            pruners[name] = pruner
            self._hooks.append(encoder.register_forward_pre_hook(self._counts.hook, with_kwargs=True))
        self.pruners, self._encoders = pruners, encoders

    def _set_scale(self, scale: float) -> None:
        self.scale = scale
        for pruner in self.pruners.values():
            pruner.scale = scale

    def _settings(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SETTINGS}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**self._settings(), "scale": self.scale, "anneal_steps": self.anneal_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_settings("TokenPruning", {name: state_dict.get(name) for name in _SETTINGS}, self._settings())
        self.anneal_steps = state_dict.get("anneal_steps")
        self._set_scale(float(state_dict["scale"]))


def find_encoders(pl_module: nn.Module, model_attribute: str | None = None) -> dict[str, TransformerEncoder]:
    """The ``TransformerEncoder`` modules inside ``pl_module`` (or under ``model_attribute``), by dotted path.

    Raises:
        ValueError: If ``model_attribute`` names no submodule, or there is no ``TransformerEncoder`` there.
    """
    name, root = resolve_target(pl_module, model_attribute if model_attribute is not None else "", "TokenPruning")
    found: dict[str, TransformerEncoder] = {}
    for path, module in root.named_modules():
        module = unwrap(module)
        if isinstance(module, TransformerEncoder) and all(id(module) != id(m) for m in found.values()):
            found[".".join(p for p in (name, path) if p)] = module
    if not found:
        where = f"{type(pl_module).__name__}.{name} ({type(root).__name__})" if name else type(pl_module).__name__
        raise ValueError(
            f"TokenPruning: {where} holds no lightning_peft.nn.TransformerEncoder, and token pruning runs "
            "inside that encoder (Hugging Face models are not supported). Use a model built on it, such as "
            "lightning_peft.modules.EncoderClassifier, or remove the TokenPruning callback."
        )
    return found
