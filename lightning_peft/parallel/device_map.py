"""The device-map dispatcher: plain model parallelism in one process, consecutive layers on different devices.

[`DeviceMapStrategy`][lightning_peft.strategies.DeviceMapStrategy] is the Lightning glue over `dispatch_model`.

What it does. The model's layers are spread over several devices of **one** process, as Hugging Face's
``from_pretrained(device_map="auto")`` and accelerate's ``dispatch_model`` do: each *unit* (an embedding, one
transformer block, the final norm, the head, ...) is moved to its device, and a forward pre-hook on every unit
moves the unit's tensor inputs (positional and keyword: hidden states, masks, position ids) to that device. The
outputs of the LightningModule's forward (and of ``model_attribute``, if set) are moved back to the first device,
where the batch lives and the loss is computed. Backward crosses devices through the same copies (``Tensor.to`` is
differentiable), so the gradients are those of the unsplit model, and each parameter's gradient and optimizer
state live on the parameter's device. Nothing is replicated: a model that does not fit on one device fits on
several. Only one device works at a time (naive model parallelism: the pipeline bubble of GPipe with one
micro-batch), so it saves memory, not time; `PipelineStrategy` overlaps the devices.

References: Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism",
arXiv:1811.06965 (naive model parallelism and its bubble, Fig. 2b); Hugging Face accelerate, "Big model
inference" (``infer_auto_device_map`` / ``dispatch_model``), whose ``device_map`` format this follows.

The map. ``device_map="auto"`` finds the model's list of layers (the ``nn.ModuleList`` / ``nn.Sequential`` that
holds most of the parameters in modules of one class: ``layers`` of this package's blocks, ``encoder.layer`` of
BERT, ``model.layers`` of Llama) and cuts the sequence of units (the modules before the list, each layer, the
modules after it, in registration order) into ``len(devices)`` consecutive groups with the smallest possible
largest group, counted in parameters (LoRA's included: LoRA is injected at Trainer ``setup``, before the strategy
places the model). A dict ``{module name: device}`` gives the placement by hand: every module with parameters
must be covered by its own name or an ancestor's, names must exist and must not overlap. Modules outside the map
without parameters (dropout, metrics, rotary tables held outside the layers) and parameters held directly by a
module the map splits go to the first device. Tied parameters (a head sharing the embedding matrix) are one tensor
on one device: ``"auto"`` puts the later module on the earlier module's device; a dict that separates them is
refused.

Devices. ``devices`` (or, when neither it nor a dict map is given, ``Trainer(devices=...)``): ``cuda:0``,
``cuda:1``, ...; an integer ``i`` means ``cuda:i``. ``"cpu"`` may repeat: ``Trainer(accelerator="cpu",
devices=2)`` gives ``["cpu", "cpu"]``, two groups on the CPU, which runs every hook and copy (all no-ops) and gives
the unsplit model's numbers exactly: the way to check a split on a machine without GPUs. Maps may mix kinds
(``cpu`` for the embedding, ``cuda`` for the layers); the first device's kind picks Lightning's accelerator and
its autocast.

Shapes: unchanged. A unit receives what the unsplit model would give it (``(B, L, H)`` hidden states, ``(B, L)``
masks, ...) on its own device; the forward's output (``(B, L, V)`` logits, ``(B, C)`` class scores) is returned on
the first device.

Limits. Units must be called as modules (``layer(x)``): a model that calls a layer's methods directly, such as
this package's encoder with a token pruner (``attention_sublayer``) or reversible layers (``attention_branch``),
bypasses the hooks and is refused on a map with more than one distinct device. One process: a data-parallel copy
of a device-mapped model is not supported here (use `PipelineStrategy` or `TensorParallelStrategy` for more
processes).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle

from lightning_peft.parallel.partition import _join, balanced_groups

__all__ = [
    "DeviceMap", "dispatch_model", "infer_device_map", "optimizer_state_to_params", "parse_device", "place_outside",
]


DeviceLike = str | int | torch.device


# ----------------------------------------------------------------------------------------------- devices


def parse_device(value: object, who: str) -> torch.device:
    """``value`` as a ``torch.device`` that exists on this machine (``int`` ``i`` = ``cuda:i``).

    Raises:
        TypeError: If ``value`` is not a string, an integer or a ``torch.device``.
        ValueError: If it names no device type, a device this machine lacks, or one that cannot hold a layer.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise TypeError(
            f"{who}: a device must be a string such as 'cuda:0' or 'cpu', or a CUDA index such as 0; got "
            f"{value!r} ({type(value).__name__})."
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{who}: device {value} is negative; a CUDA index is 0, 1, ...")
        device = torch.device("cuda", value)
    else:
        try:
            device = torch.device(value)
        except RuntimeError:
            raise ValueError(
                f"{who}: {value!r} is not a device; write 'cpu', 'cuda:0', 'cuda:1', ... (or a CUDA index such as 0)."
            ) from None
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise ValueError(f"{who}: {value!r}: a process has one CPU device; write 'cpu' (it may repeat).")
        return torch.device("cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index if device.index is not None else (torch.cuda.current_device() if count else 0)
        if index >= count:
            have = f"cuda:0 to cuda:{count - 1}" if count else "no CUDA device"
            raise ValueError(
                f"{who}: device {str(device)!r} does not exist on this machine ({have}). Give devices it has, or "
                "'cpu' entries to check a split on the CPU."
            )
        return torch.device("cuda", index)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{who}: device 'mps' does not exist on this machine (no Apple GPU).")
        return torch.device("mps")
    raise ValueError(
        f"{who}: {value!r} cannot hold a layer here; use 'cpu', 'cuda:<index>' or 'mps' (offloading to disk or "
        "'meta' is not supported)."
    )


def infer_device_map(model: nn.Module, devices: Sequence[DeviceLike]) -> dict[str, torch.device]:
    """A map of ``model``'s units (see `lightning_peft.parallel.partition.layer_units`) onto ``devices``,
    consecutive, balanced by parameter count.

    Args:
        model: The module to split (its parameters are counted where they are now; nothing moves).
        devices: The devices in order; the first gets the first units (embeddings), the last the head. ``"cpu"`` may
            repeat.

    Returns:
        ``{unit name: device}`` in forward order, ``devices[g]`` for the units of group ``g`` of `balanced_groups`.

    Raises:
        ValueError: If ``devices`` is empty, a device does not exist, the model has no list of layers, or there are
            more devices than layers.

    Examples:
        >>> model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        >>> {name: str(d) for name, d in infer_device_map(model, ["cpu", "cpu"]).items()}
        {'0': 'cpu', '1': 'cpu', '2': 'cpu', '3': 'cpu'}
    """
    who = "DeviceMapStrategy(device_map='auto')"
    if not devices:
        raise ValueError(f"{who}: no devices to spread the model over; give at least one, e.g. devices=['cuda:0'].")
    parsed = [parse_device(device, who) for device in devices]
    return {name: parsed[group] for name, group in balanced_groups(model, len(parsed)).items()}


def _to(value: Any, device: torch.device) -> Any:
    """Every tensor in ``value`` (tuples, lists, dicts, named tuples, Hugging Face outputs) moved to ``device``."""
    return tree_map_only(Tensor, lambda t: t.to(device), value)


def _module_to(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """Moves ``module``'s parameters and buffers (only its own with ``recurse=False``) to ``device``, in place:
    the ``nn.Parameter`` objects stay the same, so an optimizer built before or after sees them."""
    if recurse:
        module.to(device)  # a metric's states go with it (torchmetrics overrides _apply)
    else:
        module._apply(lambda t: t.to(device), recurse=False)


class DeviceMap:
    """A model placed on several devices (what `dispatch_model` returns): the map, the first device, the hooks.

    ``remove()`` takes the hooks off (the parameters stay where they are); a model is dispatched again after that.
    """

    def __init__(self, device_map: dict[str, torch.device], main_device: torch.device) -> None:
        self.device_map = device_map
        self.main_device = main_device
        self.handles: list[RemovableHandle] = []

    @property
    def devices(self) -> list[torch.device]:
        """The distinct devices of the map, in order of first use."""
        return list(dict.fromkeys(self.device_map.values()))

    def remove(self) -> None:
        """Removes the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _check_map(model: nn.Module, device_map: Mapping[str, torch.device], who: str) -> None:
    """Names exist and do not overlap; every parameter is covered; tied parameters share one device."""
    names = dict(model.named_modules(remove_duplicate=False))
    for key in device_map:
        if not isinstance(key, str):
            raise TypeError(f"{who}: device_map keys are module names (strings); got {key!r}.")
        if key not in names:
            close = difflib.get_close_matches(key, [n for n in names if n], n=3)
            hint = f" Close names: {', '.join(close)}." if close else ""
            raise ValueError(
                f"{who}: device_map names {key!r}, which is no module of {type(model).__name__}.{hint} Names are "
                "relative to the split model (model_attribute, or the LightningModule), as model.named_modules() "
                "gives them."
            )
    keys = sorted(device_map)
    for key in keys:
        inside = [k for k in keys if k != key and (key == "" or k.startswith(key + "."))]
        if inside:
            raise ValueError(
                f"{who}: device_map names both {key!r} and {inside[0]!r}, which lies inside it; give each module "
                "one entry (name the children of a module to split it)."
            )

    def covered(name: str) -> bool:
        return any(k == "" or name == k or name.startswith(k + ".") for k in keys)

    missing: list[str] = []
    for name, _ in model.named_parameters(remove_duplicate=False):
        if covered(name):
            continue
        parts = name.split(".")  # report the outermost module with nothing of it in the map
        prefixes = [".".join(parts[:depth]) for depth in range(1, len(parts))]
        outside = next((p for p in prefixes if not any(k.startswith(p + ".") for k in keys)), None)
        if outside is not None and outside not in missing:
            missing.append(outside)
        # else: a parameter held by a module the map splits (no name can place it): it goes to the first device
    if missing:
        shown = ", ".join(repr(m) for m in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ValueError(
            f"{who}: device_map misses {shown}: every module with parameters needs a device. Add "
            f"{missing[0]!r}: '<device>' (a module's name covers its children), or use device_map='auto'."
        )
    first_home: dict[int, tuple[str, torch.device]] = {}
    for key in keys:
        for pname, param in model.get_submodule(key).named_parameters():
            home = first_home.setdefault(id(param), (key, device_map[key]))
            if home[1] != device_map[key]:
                raise ValueError(
                    f"{who}: {_join(key, pname)!r} is tied to a parameter of {home[0]!r} (one tensor), but the map "
                    f"puts {key!r} on {device_map[key]} and {home[0]!r} on {home[1]}; put both on one device."
                )


def _hook_targets(module: nn.Module) -> Iterator[nn.Module]:
    """The modules whose calls run ``module``: itself, or the items of a ModuleList / ModuleDict (never called)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        for child in module.children():
            yield from _hook_targets(child)
    else:
        yield module


def _place_rest(module: nn.Module, prefix: str, keys: list[str], device: torch.device) -> None:
    """Moves what the map does not name to ``device``: whole subtrees outside it, a split module's own tensors."""
    if prefix in keys:
        return
    if not any(prefix == "" or k.startswith(prefix + ".") for k in keys):
        _module_to(module, device)
        return
    _module_to(module, device, recurse=False)
    for name, child in module.named_children():
        _place_rest(child, _join(prefix, name), keys, device)


def _calls_layers_directly(model: nn.Module) -> str | None:
    """A module of this package's that runs its layers without calling them (so hooks would not fire), or None."""
    for name, module in model.named_modules():
        if getattr(module, "reversible", False) is True:
            return f"{name or type(model).__name__} runs reversible layers (reversible=True)"
        if getattr(module, "token_pruner", None) is not None:
            return f"{name or type(model).__name__} prunes tokens (token_pruner)"
    return None


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, DeviceLike],
    main_device: DeviceLike | None = None,
    outputs_of: Sequence[nn.Module] = (),
    who: str = "dispatch_model",
) -> DeviceMap:
    """Moves each module of ``device_map`` to its device and hooks it to receive its inputs there.

    Args:
        model: The module to split; map keys are names inside it (``model.named_modules()``).
        device_map: ``{module name: device}``; every parameter must be covered by its module's name or an ancestor's.
        main_device: Where everything outside the map goes and where outputs return (default: the first entry's).
        outputs_of: Modules whose forward outputs are moved to ``main_device`` (default: ``model`` itself).
        who: Who complains in error messages.

    Returns:
        A `DeviceMap`; ``.remove()`` takes the hooks off.

    Raises:
        ValueError: If the map names a module that does not exist, overlaps itself, misses a module with
            parameters, puts tied parameters on two devices, names a device that does not exist, or the model
            calls its layers in a way the hooks cannot see while the map spans several devices.

    Examples:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> handle = dispatch_model(model, {"0": "cpu", "2": "cpu"})
        >>> model(torch.randn(3, 4)).shape
        torch.Size([3, 2])
        >>> handle.remove()
    """
    if not device_map:
        raise ValueError(f"{who}: device_map is empty; give {{module name: device}} or use device_map='auto'.")
    parsed = {key: parse_device(value, who) for key, value in device_map.items()}
    _check_map(model, parsed, who)
    main = parse_device(main_device, who) if main_device is not None else next(iter(parsed.values()))
    placement = DeviceMap(parsed, main)
    if len(set(parsed.values()) | {main}) > 1:
        reason = _calls_layers_directly(model)
        if reason is not None:
            raise ValueError(
                f"{who}: {reason}: it runs its layers' methods directly, past the hooks that move activations "
                "between devices. Turn that option off, or keep the model on one device."
            )
    keys = list(parsed)
    for key, device in parsed.items():
        _module_to(model.get_submodule(key), device)
    _place_rest(model, "", keys, main)
    for key, device in parsed.items():
        for target in _hook_targets(model.get_submodule(key)):
            placement.handles.append(target.register_forward_pre_hook(_inputs_to(device), with_kwargs=True))
    for module in outputs_of or (model,):
        placement.handles.append(module.register_forward_hook(_outputs_to(main)))
    return placement


def _inputs_to(device: torch.device):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _to((args, kwargs), device)

    return hook


def _outputs_to(device: torch.device):
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return _to(output, device)

    return hook


def optimizer_state_to_params(optimizer: Optimizer) -> None:
    """Each parameter's optimizer state onto that parameter's device (``step`` counters stay where they are)."""
    for param, state in optimizer.state.items():
        if not isinstance(state, dict):
            continue
        for key, value in state.items():
            if isinstance(value, Tensor) and key != "step" and value.device != param.device:
                state[key] = value.to(param.device)


def place_outside(module: nn.Module, target: nn.Module, device: torch.device) -> None:
    """Everything of ``module`` outside ``target`` to ``device`` (``target`` itself is placed by the map)."""
    name = next(n for n, m in module.named_modules() if m is target)
    _place_rest(module, "", [name], device)
