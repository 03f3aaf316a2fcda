"""The adapter record of a checkpoint, without Lightning: ``checkpoint["lightning_peft"]``.

Every checkpoint written while a PEFT callback runs carries::

    {"format": 1, "adapter_only": bool, "dropped": [<keys an adapter-only checkpoint left out>],
     "models": {"<path of the adapted model>": {"<kind>": <config_dict>}}, "load_with": "<how to load it, in words>"}

(the path is ``""`` for the model itself). :func:`checkpoint_entry` writes it from the adapters attached to a model
(:mod:`lightning_peft.peft.adapter`); :func:`check_same_adapters` refuses to resume or load into a model whose
adapters differ from the recorded ones, naming the settings that differ. The Lightning hooks that write and
read it are in :mod:`lightning_peft.callbacks._checkpoint`; the strategies check it too.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_peft.peft.adapter import ADAPTERS_ATTRIBUTE, attached

__all__ = ["FORMAT", "KEY", "LOAD_WITH", "TRAINING_ONLY", "adapted_models", "check_same_adapters", "checkpoint_entry"]

KEY = "lightning_peft"


TRAINING_ONLY = ("dropout", "init", "init_scale")  # settings that only steer training: a resume may change them


FORMAT = 1


LOAD_WITH = (
    "This checkpoint holds lightning-peft adapters: its state dict has the adapted model's keys (an adapter-only one "
    "lacks the frozen base). Load it with lightning_peft.callbacks.load_from_checkpoint(MyModule, path), which "
    "re-applies the adapters first; MyModule.load_from_checkpoint(path) alone fails with missing or unexpected keys."
)


def adapted_models(pl_module: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``pl_module`` that carry adapters, by dotted path (torch.compile wrappers looked through)."""
    found = {}
    for name, module in pl_module.named_modules():
        if getattr(module, ADAPTERS_ATTRIBUTE, None):
            path = ".".join(p for p in name.split(".") if p != "_orig_mod")
            found[path] = module
    return found


def checkpoint_entry(pl_module: nn.Module, dropped: list[str] | None = None) -> dict[str, Any]:
    """The ``checkpoint["lightning_peft"]`` entry: ``pl_module``'s adapters and the keys left out (adapter-only)."""
    return {
        "format": FORMAT,
        "adapter_only": dropped is not None,
        "dropped": sorted(dropped or []),
        "models": {path: {kind: a.config_dict() for kind, a in attached(m).items()}
                   for path, m in adapted_models(pl_module).items()},
        "load_with": LOAD_WITH,
    }


def check_same_adapters(saved: dict[str, Any], pl_module: nn.Module, who: str) -> None:
    """Raise if the adapters recorded in a checkpoint differ from the ones ``pl_module`` has now."""
    current = checkpoint_entry(pl_module, False)["models"]
    for path, adapters in saved.get("models", {}).items():
        for kind, config in adapters.items():
            now = current.get(path, {}).get(kind)
            if now is None:
                raise ValueError(
                    f"{who}: the checkpoint has a {kind} adapter on {path or 'the LightningModule'!r}, but this run "
                    f"has none there (adapters now: {_where(current)}). Add the same callback as when it was saved."
                )
            if _meaning(now) != _meaning(config):
                raise ValueError(
                    f"{who}: the checkpoint's {kind} adapter on {path or 'the LightningModule'!r} was trained with "
                    f"{_differences(config, now)}. Resume with the checkpoint's settings, or start a new run "
                    "without ckpt_path."
                )


def _meaning(config: dict) -> dict:
    """What must match to resume: everything but settings that only steer training (LoRA's dropout, init) and
    which named adapter is active."""
    def inner(entry: dict) -> dict:
        return {**entry, "config": {k: v for k, v in entry.get("config", {}).items() if k not in TRAINING_ONLY}}

    meaning = inner(config) if "config" in config else dict(config)
    if "adapters" in config:
        meaning["adapters"] = {name: inner(entry) for name, entry in config["adapters"].items()}
    meaning.pop("active", None)
    return meaning


def _where(models: dict) -> str:
    return ", ".join(f"{kind} on {path or 'the LightningModule'!r}" for path, a in models.items() for kind in a) or "none"


def _fields(config: dict) -> dict:
    """A config_dict as flat fields; a named adapter's fields as ``<name>.<field>`` (``default``'s bare)."""
    fields = {**config.get("config", {}), **{k: v for k, v in config.items() if k not in ("config", "adapters")}}
    for name, entry in config.get("adapters", {}).items():
        prefix = "" if name == "default" else f"{name}."
        fields.update({f"{prefix}{k}": v for k, v in _fields(entry).items()})
    return fields


def _differences(saved: dict, now: dict) -> str:
    saved_fields, now_fields = _fields(_meaning(saved)), _fields(_meaning(now))
    keys = [k for k in dict.fromkeys([*saved_fields, *now_fields]) if saved_fields.get(k) != now_fields.get(k)]
    return (", ".join(f"{k}={saved_fields.get(k)!r}" for k in keys) + "; this run has "
            + ", ".join(f"{k}={now_fields.get(k)!r}" for k in keys))
