"""Adapters in Lightning checkpoints: what they record, how a fresh LightningModule gets them back.

Every checkpoint written while a PEFT callback runs carries ``checkpoint["lightning_peft"]``::

    {"format": 1, "adapter_only": bool, "models": {"<path of the adapted model>": {"<kind>": <config_dict>}},
     "load_with": "<how to load it, in words>"}

(the path is ``""`` for the LightningModule itself). ``load_with`` is for a person who opens the file: a plain
``MyModule.load_from_checkpoint(path)`` builds the module without adapters and fails with torch's missing or
unexpected keys (Lightning gives no hook that a callback could install on a class not yet built), so the entry says
what to call instead. :func:`restore_adapters` re-applies those adapters to a
freshly built LightningModule before its weights are loaded and, for an adapter-only checkpoint, takes the frozen
base weights from the model as built. ``LightningModule.load_from_checkpoint`` builds the module and calls its
``on_load_checkpoint`` before loading the weights, so a module whose ``on_load_checkpoint`` calls
:func:`restore_adapters` (``HFSequenceClassifier`` does) loads its LoRA checkpoints directly; any other module
loads them with :func:`load_from_checkpoint`.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_peft.callbacks._lightning import refuse_changed_settings  # noqa: F401 (callbacks import it from here)
from lightning_peft.callbacks._target import resolve_target

from lightning_peft.peft.adapter import adapter_tensors, attached, technique, unwrap
from lightning_peft.peft.checkpoint import KEY, adapted_models, check_same_adapters, checkpoint_entry
from lightning_peft.peft.checkpoint import TRAINING_ONLY  # noqa: F401 (callbacks import it from here)

_HOOKED = "_lightning_peft_load_hook"
_PATCH_LOCK = threading.Lock()
M = TypeVar("M", bound=pl.LightningModule)


class AdapterCallback(Callback):
    """The hooks every PEFT callback shares: the optimizer check at train start and the adapter record in every
    checkpoint. Subclasses set ``who`` and the attributes ``model_attribute`` and ``adapter_only_checkpoint``."""

    who: ClassVar[str]
    model_attribute: str | None
    adapter_only_checkpoint: bool

    def own_dropout(self) -> float:
        """The dropout probability this callback's adapter uses (the largest, for several adapters)."""
        return float(getattr(getattr(self, "config", None), "dropout", 0.0) or 0.0)

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


def record_adapters(pl_module: nn.Module, checkpoint: dict[str, Any], adapter_only: bool) -> None:
    """Write ``checkpoint["lightning_peft"]``; ``adapter_only`` drops the frozen base parameters from the state dict.

    Every PEFT callback calls it: the entry covers every adapter of ``pl_module`` whichever callback writes it, and
    what an earlier callback already dropped stays recorded (so callbacks can come in any order).
    """
    earlier = checkpoint.get(KEY) or {}
    dropped = set(earlier.get("dropped", []))
    if adapter_only:
        dropped |= {k for k in frozen_base(pl_module) if k in checkpoint["state_dict"]}
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in dropped}
    checkpoint[KEY] = checkpoint_entry(pl_module, dropped=sorted(dropped) if dropped or adapter_only else None)


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
        if entry.get("adapter_only"):
            fill_frozen(module, state_dict, entry.get("dropped", []))
        return
    frozen = frozen_base(module)
    if frozen and not frozen.keys() & state_dict.keys():
        fill_frozen(module, state_dict, list(frozen))


def check_optimizer_holds_adapters(trainer: pl.Trainer, model: nn.Module, who: str) -> None:
    """Raises if the optimizers hold the model's frozen parameters but none that trains.

    That is an optimizer built before the adapters were injected: LightningCLI's ``optimizer:`` section builds it
    over ``model.parameters()`` before the Trainer starts, and such a run would train nothing. (Strategies that
    flatten parameters into their own buffers, as DeepSpeed's ZeRO does, hold none of the model's parameters and are
    not checked.)
    """
    held = {id(p) for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]}
    named = list(model.named_parameters())
    trained = [name for name, p in named if p.requires_grad]
    if not trained or any(id(p) in held for name, p in named if p.requires_grad):
        return
    if any(id(p) in held for _, p in named):
        raise RuntimeError(
            f"{who}: the optimizer holds none of the {len(trained)} parameters that train ({trained[0]}, ...): it was "
            "built before the adapters were injected, so this run would train nothing. LightningCLI's optimizer: "
            "section does that (it builds the optimizer over model.parameters() before the Trainer starts); build the "
            "optimizer in the LightningModule's configure_optimizers instead (HFSequenceClassifier has one: drop the "
            "optimizer: and lr_scheduler: sections)."
        )


def frozen_base(pl_module: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters an adapter-only checkpoint leaves out: inside an adapted model, owned by no adapter, frozen.

    Whatever an adapter owns is kept whatever ``requires_grad`` says (a head trained, then frozen), and so is
    everything outside the adapted models (a head next to the Hugging Face model).
    """
    models = adapted_models(pl_module).values()
    owned = {id(t) for m in models for t in adapter_tensors(m).values()}
    inside = {id(p) for m in models for p in m.parameters()}
    return {k: p for k, p in pl_module.named_parameters(remove_duplicate=False)
            if id(p) in inside and id(p) not in owned and not p.requires_grad}


def fill_frozen(pl_module: nn.Module, state_dict: dict[str, Tensor], keys: list[str]) -> None:
    """Give an adapter-only state dict the parameters ``keys`` it left out, from ``pl_module`` as built."""
    params = dict(pl_module.named_parameters(remove_duplicate=False))
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(
            f"The adapter-only checkpoint left out {missing[0]!r}, which {type(pl_module).__name__} does not have; "
            "it was written for another model."
        )
    for key in keys:
        state_dict.setdefault(key, params[key].detach())


def restore_adapters(pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
    """Re-apply the adapters a checkpoint records, then complete an adapter-only state dict from the model.

    Call it from ``LightningModule.on_load_checkpoint`` (before Lightning loads the weights). Adapters the
    module already has must match the recorded ones. Idempotent.

    Raises:
        ValueError: If an adapter the module already has differs from the checkpoint's.
    """
    entry = checkpoint.get(KEY)
    if not entry:
        return
    for path, adapters in entry.get("models", {}).items():
        model = unwrap(pl_module.get_submodule(path)) if path else pl_module
        for kind, config in adapters.items():
            if kind not in attached(model):
                technique(kind).inject(model, config)
    check_same_adapters(entry, pl_module, "restore_adapters")
    if entry.get("adapter_only") and "state_dict" in checkpoint:
        fill_frozen(pl_module, checkpoint["state_dict"], entry.get("dropped", []))


def load_from_checkpoint(module_class: type[M], checkpoint_path: str | os.PathLike, **kwargs: Any) -> M:
    """``module_class.load_from_checkpoint(checkpoint_path, **kwargs)`` with the checkpoint's adapters re-applied.

    Works for any LightningModule class, full and adapter-only checkpoints alike (for an adapter-only one the
    frozen base comes from the module as its ``__init__`` builds it, e.g. from the pretrained weights), and for
    checkpoints written by LightningCLI in subclass mode. While it runs, ``module_class.on_load_checkpoint`` calls
    :func:`restore_adapters` first (the class is patched under a lock and restored afterwards).

    A sharded checkpoint directory (``ZeROStrategy``, FSDP2, tensor parallelism: one shard per rank) is assembled
    first in a temporary file (:func:`~lightning_peft.strategies.convert_checkpoint`), so one process loads what N
    ranks saved.

    Example:
        ``model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt", map_location="cpu")``
    """
    if Path(checkpoint_path).is_dir():
        from lightning_peft.parallel.checkpoint import convert_checkpoint

        with tempfile.TemporaryDirectory(prefix="lightning-peft-") as scratch:
            single = convert_checkpoint(checkpoint_path, Path(scratch) / "assembled.ckpt")
            return load_from_checkpoint(module_class, single, **kwargs)
    with _PATCH_LOCK:
        own = module_class.__dict__.get("on_load_checkpoint")
        inherited = module_class.on_load_checkpoint

        def on_load_checkpoint(self: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
            restore_adapters(self, checkpoint)
            inherited(self, checkpoint)

        module_class.on_load_checkpoint = on_load_checkpoint
        try:
            return module_class.load_from_checkpoint(checkpoint_path, **kwargs)
        finally:
            if own is None:
                del module_class.on_load_checkpoint
            else:
                module_class.on_load_checkpoint = own
