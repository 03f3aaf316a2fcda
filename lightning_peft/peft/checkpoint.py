"""Adapters in training checkpoints, without Lightning: the record a checkpoint carries, adapter-only state dicts,
completing them from a model, and re-applying the recorded adapters to a fresh model.

Every checkpoint written while a PEFT callback runs carries ``checkpoint["lightning_peft"]``:

```text
{"format": 1, "adapter_only": bool, "dropped": [keys left out], "models": {"<path of the adapted model>":
 {"<kind>": <config_dict>}}, "load_with": "<how to load it, in words>"}
```

(the path is ``""`` for the module itself). ``load_with`` is for a person who opens the file: a plain
``MyModule.load_from_checkpoint(path)`` builds the module without adapters and fails with torch's missing or
unexpected keys, so the entry says what to call instead. Everything here speaks to techniques through the adapter
protocol only (``config_dict``, ``state``, ``resume_fields``, ``inject``); the Lightning hooks that call it are in
`lightning_peft.callbacks._adapter` and `lightning_peft.callbacks._checkpoint`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .._grads import full_shape
from .adapter import ADAPTERS_ATTRIBUTE, adapter_tensors, attached, technique, unwrap
from .quantize import flatten_quantized

KEY = "lightning_peft"
FORMAT = 1
LOAD_WITH = (
    "This checkpoint holds lightning-peft adapters: its state dict has the adapted model's keys (an adapter-only one "
    "lacks the frozen base). Load it with lightning_peft.callbacks.load_from_checkpoint(MyModule, path), which "
    "re-applies the adapters first; MyModule.load_from_checkpoint(path) alone fails with missing or unexpected keys."
)

# Config fields that are rules for choosing modules (spelled one way by the user, another by PEFT's file): what they
# chose is compared instead (the records' targets, feedforward and modules_to_save entries).
RULES = frozenset({"target_modules", "exclude_modules", "modules_to_save", "feedforward_modules",
                   "layers_to_transform", "layers_pattern"})


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
    flatten_quantized(checkpoint["state_dict"])  # plain tensors only: Lightning can load the file again
    checkpoint[KEY] = checkpoint_entry(pl_module, dropped=sorted(dropped) if dropped or adapter_only else None)


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


def check_shapes(pl_module: nn.Module, state_dict: dict[str, Any], who: str) -> None:
    """Raise if a tensor of ``state_dict`` has another shape than ``pl_module``'s tensor of the same key.

    Adapters that agree in their settings (`check_same_adapters`) can still sit on a model of another size (another
    hidden size: every ``lora_A`` has other columns); torch would list every mismatched key without the cause.
    """
    own = dict(pl_module.named_parameters(remove_duplicate=False))
    own.update(pl_module.named_buffers(remove_duplicate=False))
    wrong = [(key, tuple(value.shape), tuple(full_shape(own[key]))) for key, value in state_dict.items()
             if key in own and isinstance(value, Tensor) and not _fits(value, own[key])]
    if wrong:
        key, saved, now = wrong[0]
        more = f" (and {len(wrong) - 1} more tensors)" if len(wrong) > 1 else ""
        raise ValueError(
            f"{who}: the checkpoint's {key!r} has shape {saved}, but this {type(pl_module).__name__} has {now} there"
            f"{more}: the checkpoint was written for a model of another size (another config: hidden size, vocabulary, "
            "number of labels, ...). Build the module with the config it was trained with."
        )


def _fits(saved: Tensor, own: Tensor) -> bool:
    """Whether ``saved`` can load into the model's ``own``: the same full shape, or the same placeholder (DeepSpeed
    stage 3 writes and loads its partitioned parameters as the empty tensors the module holds), or ``own`` is still
    uninitialised (a lazy module)."""
    if isinstance(own, nn.parameter.UninitializedTensorMixin):
        return True
    return tuple(saved.shape) in (tuple(full_shape(own)), tuple(own.shape))


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
            cls = technique(kind)  # what must agree: its resume_fields (training-only settings may change)
            saved_fields, now_fields = cls.resume_fields(config), cls.resume_fields(now)
            # (a run that trained on from PEFT's folder recorded the file's spellings of the rules; this run's
            # callback built the same adapter from the user's)
            if saved_fields != now_fields and resolved(config) != resolved(now):
                raise ValueError(
                    f"{who}: the checkpoint's {kind} adapter on {path or 'the LightningModule'!r} was trained with "
                    f"{_differences(saved_fields, now_fields)}. Resume with the checkpoint's settings, or start a new run "
                    "without ckpt_path."
                )


def resolved(record: dict[str, Any], first_only: bool = False) -> dict[str, Any]:
    """An adapter's ``config_dict`` flattened to ``{"<path>": value}`` without the rule fields of its configs (`RULES`)
    and the active adapter, its lists of names sorted; ``first_only``: of named adapters, the first one, unnamed."""
    if first_only and record.get("adapters"):
        record = {**record, "adapters": {"first": next(iter(record["adapters"].values()))}}
    flat: dict[str, Any] = {}

    def walk(value: Any, path: str, in_config: bool) -> None:
        if hasattr(value, "to_dict") and not isinstance(value, dict):
            value = value.to_dict()
        if isinstance(value, dict):
            for key, item in value.items():
                if (key == "active" and not path) or (in_config and key in RULES):
                    continue
                walk(item, f"{path}.{key}" if path else str(key), in_config or key == "config")
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value) and not in_config:
            flat[path] = sorted(value)
        else:
            flat[path] = list(value) if isinstance(value, tuple) else value

    walk(record, "", False)
    return flat


def _where(models: dict) -> str:
    return ", ".join(f"{kind} on {path or 'the LightningModule'!r}" for path, a in models.items() for kind in a) or "none"


def _differences(saved: dict, now: dict) -> str:
    keys = [k for k in dict.fromkeys([*saved, *now]) if saved.get(k) != now.get(k)]
    return (", ".join(f"{k}={saved.get(k)!r}" for k in keys) + "; this run has "
            + ", ".join(f"{k}={now.get(k)!r}" for k in keys))


def restore_adapters(pl_module: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Re-apply the adapters a checkpoint records, then complete an adapter-only state dict from the model.

    Call it from ``LightningModule.on_load_checkpoint`` (before Lightning loads the weights). Adapters the
    module already has must match the recorded ones. Idempotent.

    Raises:
        ValueError: If an adapter the module already has differs from the checkpoint's, or a tensor's shape differs
            from the module's.
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
    if "state_dict" in checkpoint:
        check_shapes(pl_module, checkpoint["state_dict"], "restore_adapters")
        if entry.get("adapter_only"):
            fill_frozen(pl_module, checkpoint["state_dict"], entry.get("dropped", []))
