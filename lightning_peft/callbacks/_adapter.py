"""``AdapterCallback``: what every PEFT callback does around its technique's inject function, written once.

A technique's callback is its constructor (plain typed keyword arguments for LightningCLI, building a config) and
`AdapterCallback.inject` (one call of the technique's inject function). The rest is here:

- ``setup``: resolve the model inside the LightningModule (``model_attribute``), keep the RNG state across resumes,
  have checkpoints written to a temporary file and renamed (`lightning_peft._checkpoint_io`), then inject the adapter
  if the model has none of this technique, or go on with the model as it is if its adapter
  [`matches`][lightning_peft.peft.Adapter.matches] this callback's config or is what that config resolves to on this
  model (`lightning_peft.callbacks._resolved`: an adapter loaded from PEFT's folder spells its rules otherwise), and
  refuse otherwise (naming both and the first difference); an info
  line gives the trainable-parameter report; checkpoint loads are watched (see below);
- ``on_train_start``: refuse an optimizer built before the adapters existed; warn about dropout left in eval mode;
- ``on_save_checkpoint``: record the adapters (`lightning_peft.peft.checkpoint`), adapter-only if asked;
- loading a checkpoint: before any weight is copied, its adapters are compared with this run's (a changed setting
  is refused, naming both values) and an adapter-only state dict is completed from the model as built;
- ``state_dict`` / ``load_state_dict``: the callback's settings; a resume with other settings is refused, except the
  technique's ``training_only`` ones.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_peft._checkpoint_io import use_atomic_checkpoint_io
from lightning_peft._seams import refuse_together
from lightning_peft.callbacks._lightning import refuse_changed_settings, refuse_earlier_model_copies
from lightning_peft.callbacks._quantize import check_quantized_shards, check_quantized_strategy
from lightning_peft.callbacks._resolved import resolved_difference
from lightning_peft.callbacks._rng import keep_rng
from lightning_peft.callbacks._target import refuse_two_callbacks_on_one_model, resolve_target
from lightning_peft.peft.adapter import Adapter, attached, technique, trainable_parameters
from lightning_peft.peft.checkpoint import (
    KEY,
    check_same_adapters,
    check_shapes,
    fill_frozen,
    frozen_base,
    record_adapters,
)

_HOOKED = "_lightning_peft_load_hook"


class AdapterCallback(Callback):
    """Base class of the PEFT callbacks (see the module docstring).

    A subclass sets ``who`` (its name in messages), ``kind`` (its [`Adapter`][lightning_peft.peft.Adapter]'s) and
    ``what`` (the adapter in words: ``"a LoRA adapter"``), keeps its settings in ``self.config`` (an object with
    ``to_dict()``) or overrides `settings`, and defines `inject`. What else this class asks of a technique, each with
    a default a subclass overrides where its technique differs: `request`, `shown`, `check`, `quantize`,
    `own_dropout`; of its [`Adapter`][lightning_peft.peft.Adapter], ``modules_to_save`` and ``training_only``.
    """

    who: ClassVar[str]
    kind: ClassVar[str]
    what: ClassVar[str] = "an adapter"
    takes_named_adapters: ClassVar[bool] = False  # several named adapters of one technique (MultiLoRA)
    model_attribute: str | None = None
    adapter_only_checkpoint: bool = False

    def __init__(self, adapter_only_checkpoint: bool = False, model_attribute: str | None = None) -> None:
        self.adapter_only_checkpoint = adapter_only_checkpoint
        self.model_attribute = model_attribute

    def inject(self, trainer: pl.Trainer, model: nn.Module) -> str:
        """Inject the adapter into ``model`` (which has none of this kind); return what the info line says."""
        raise NotImplementedError(f"{type(self).__name__} must define inject(trainer, model)")

    def settings(self) -> dict[str, Any]:
        """The callback's settings as saved in its state (default: ``self.config.to_dict()``)."""
        return self.config.to_dict()

    def request(self) -> dict[str, Any]:
        """What [`Adapter.matches`][lightning_peft.peft.Adapter.matches] gets to decide whether the model's adapter is
        this callback's."""
        return self.settings()

    def shown(self, adapter: Adapter) -> Any:
        """The model's adapter as a refusal message shows it (default: its
        [`config_dict`][lightning_peft.peft.Adapter.config_dict])."""
        return adapter.config_dict()

    def check(self, trainer: pl.Trainer) -> None:
        """Refuse a strategy the technique cannot run under (called first in ``setup``; default: none)."""

    @property
    def quantize(self) -> str | None:
        """How the adapted layers' frozen base is quantized (``"nf4"``, ``"int8"``), one setting for all adapters;
        None (the default): full precision. A technique that quantizes its base returns its config's."""
        return None

    def own_dropout(self) -> float:
        """The dropout probability this callback's adapter uses (the largest, for several adapters); default 0.0 (a
        technique without dropout of its own)."""
        return 0.0

    def saving(self, model: nn.Module) -> str:
        """``", saving <modules> in full"`` for the info line (empty if the adapter saves no module in full)."""
        adapter = attached(model).get(self.kind)
        saved = adapter.modules_to_save if adapter is not None else ()
        return f", saving {', '.join(saved)} in full" if saved else ""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_quantized_strategy(self.who, self.quantize, trainer.strategy)
        self.check(trainer)
        keep_rng(trainer)  # resume draws what the straight run drew (dropout)
        use_atomic_checkpoint_io(trainer.strategy)  # a kill while saving keeps the previous checkpoint
        _, model = resolve_target(pl_module, self.model_attribute, self.who)
        refuse_two_callbacks_on_one_model(trainer.callbacks, self, pl_module, model)
        self.adapted_model = model
        adapter = attached(model).get(self.kind)
        if adapter is None:
            refuse_earlier_model_copies(trainer, self, self.who, self.what)
            line = inject_or_explain(self, trainer, pl_module, model)
            check_quantized_shards(f"{self.who}(quantize={self.quantize!r})", model, trainer.strategy)
            rank_zero_info(f"{self.who}: {line}; {trainable_parameters(pl_module)}")
        elif not adapter.matches(self.request()) and (why := resolved_difference(self, trainer, model, adapter)):
            raise RuntimeError(
                f"{self.who}: {type(model).__name__} already has {self.what} with another config "
                f"({self.shown(adapter)}; this callback asks for {self.settings()}; {why}); use one {self.who} "
                "callback per model, with the config the model was adapted with."
            )
        watch_checkpoint_loads(pl_module, self.who)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _, model = resolve_target(pl_module, self.model_attribute, self.who)
        check_optimizer_holds_adapters(trainer, model, self.who)
        warn_about_eval_dropout(model, self.who, self.own_dropout())

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        record_adapters(pl_module, checkpoint, self.adapter_only_checkpoint)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.settings()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse_changed_settings(self.who, state_dict.get("config") or {}, self.settings(),
                                technique(self.kind).training_only)


def inject_or_explain(callback: AdapterCallback, trainer: pl.Trainer, pl_module: pl.LightningModule,
                      model: nn.Module) -> str:
    """``callback.inject``; a failure on a LightningModule that builds layers in ``configure_model`` says that those
    layers do not exist yet (Lightning calls that hook after the callbacks' ``setup``, where adapters go in)."""
    try:
        return callback.inject(trainer, model)
    except (ValueError, TypeError) as err:
        if not is_overridden("configure_model", pl_module):
            raise
        raise type(err)(
            f"{err} Note: {type(pl_module).__name__} overrides configure_model, which Lightning calls after the "
            f"callbacks' setup, where {callback.who} adds {callback.what}: layers built there do not exist yet. Build "
            "the model in __init__ (from_pretrained there, as usual)."
        ) from err


def warn_about_eval_dropout(model: nn.Module, who: str, own: float) -> None:
    """Warn if dropout modules of ``model`` are in eval mode when training starts (every dropout then stays off).

    ``from_pretrained`` returns a model in eval mode, and Lightning 2.6 keeps the modes of submodules, so a model
    built in ``__init__`` trains without dropout, the adapter's own included: a different training than asked for,
    with no error. The modes are the user's to set; this only says so, once, before the first step.
    """
    off = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0 and not m.training]
    if not off:
        return
    ours = f"{who}'s own dropout={own} included" if own > 0 else f"{who}'s adapter has dropout=0"
    rank_zero_warn(
        f"{who}: {len(off)} dropout module(s) of {type(model).__name__} are in eval mode as training starts, so it "
        f"trains with them off ({ours}). from_pretrained returns models in eval mode and Lightning keeps submodules' "
        "modes. If you want dropout, call self.model.train() in your LightningModule's __init__ after from_pretrained "
        "(or in its on_train_start); to train without dropout on purpose, set the model's and the adapter's dropout "
        "probabilities to 0.",
        category=UserWarning,
    )


def watch_checkpoint_loads(pl_module: nn.Module, who: str) -> None:
    """Register (once per LightningModule) the load-state-dict pre-hook that checks and completes checkpoints."""
    if not getattr(pl_module, _HOOKED, False):
        pl_module.register_load_state_dict_pre_hook(functools.partial(_load_hook, who=who))
        setattr(pl_module, _HOOKED, True)


def _load_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors, who: str) -> None:
    """Load-state-dict pre-hook on the LightningModule, run before Lightning copies a checkpoint's weights.

    It refuses a checkpoint whose adapters differ from this run's (naming both values, instead of torch's
    size-mismatch dump), and completes an adapter-only state dict with the parameters it recorded as left out,
    taken from the model as built. Outside a Trainer (a manual ``load_state_dict``) a state dict that holds none
    of the frozen base parameters is taken as adapter-only; a full one with a missing key still fails.
    """
    if prefix:
        return
    # Lightning keeps the checkpoint it is restoring on its checkpoint connector (the trainer is looked up
    # now, not kept: the module may meet another Trainer, and hooks are copied with the module).
    connector = getattr(getattr(module, "_trainer", None), "_checkpoint_connector", None)
    entry = (getattr(connector, "_loaded_checkpoint", None) or {}).get(KEY)
    if entry is not None:
        check_same_adapters(entry, module, who)
    check_shapes(module, state_dict, who)
    if entry is not None:
        if entry.get("adapter_only"):
            fill_frozen(module, state_dict, entry.get("dropped", []))
        return
    frozen = frozen_base(module)
    if frozen and not frozen.keys() & state_dict.keys():
        fill_frozen(module, state_dict, list(frozen))


def check_optimizer_holds_adapters(trainer: pl.Trainer, model: nn.Module, who: str) -> None:
    """Raises, on every rank, if a rank's optimizers hold its frozen parameters but none of those that train.

    That is an optimizer built before the adapters were injected: LightningCLI's ``optimizer:`` section builds it
    over ``model.parameters()`` before the Trainer starts, and such a run would train nothing. Each rank looks at
    the parameters it holds (under a pipeline the other stages' are ``meta`` tensors, and a stage with nothing to
    train is legitimate); the ranks decide together (`refuse_together`). (Strategies that flatten parameters into
    their own buffers, as DeepSpeed's ZeRO does, hold none of the model's parameters and are not checked.)
    """
    held = {id(p) for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]}
    named = [(name, p) for name, p in model.named_parameters() if p.device.type != "meta"]
    trained = [name for name, p in named if p.requires_grad]
    error = None
    if trained and not any(id(p) in held for _, p in named if p.requires_grad) and any(id(p) in held for _, p in named):
        error = RuntimeError(
            f"{who}: the optimizer holds none of the {len(trained)} parameters that train ({trained[0]}, ...): it was "
            "built before the adapters were injected, so this run would train nothing. LightningCLI's optimizer: "
            "section does that (it builds the optimizer over model.parameters() before the Trainer starts); build the "
            "optimizer in the LightningModule's configure_optimizers instead (HFSequenceClassifier has one: drop the "
            "optimizer: and lr_scheduler: sections)."
        )
    refuse_together(error)
