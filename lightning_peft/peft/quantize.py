r"""A quantized frozen base (QLoRA): the chosen ``nn.Linear`` layers keep their type, and their frozen weight becomes a
non-trainable ``Parameter`` holding a quantized tensor that ``F.linear`` dequantizes on the fly, in forward and in
backward (the gradient of the input; the weight gets none). Adapters on top stay float32 and train as before.

Paper: Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314.

Methods (both from torchao, imported only when a model is quantized):

- ``"nf4"``: 4-bit NormalFloat with double-quantized scales (torchao's ``NF4Tensor``, as torchtune's QLoRA). The
  flattened weight ``W`` (out, in) is cut into blocks of ``block`` values; each block stores 4-bit codes ``q`` and
  one absmax scale ``c``; the scales are themselves quantized to int8 in groups of ``scaler_block``:

  ```text
  W[i] ~= NF4[q[i]] * c[block(i)]        NF4: the 16 quantiles of N(0, 1), scaled to [-1, 1]
  ```

  ``block`` is 64 (the paper's); ``scaler_block`` is the largest divisor of the block count up to 256 (the paper's)
  that leaves a number of scale groups divisible by 8 (else by 4, 2, 1), so that FSDP2 can shard the weight over up
  to 8 ranks (torchao splits each inner tensor by the shard count). A weight whose size is not a multiple of 64 is
  not quantized.
- ``"int8"``: int8 weight-only, one absmax scale per output channel (torchao's ``Int8Tensor``,
  ``Int8WeightOnlyConfig`` version 2, ``PerRow`` granularity): ``W[o, i] ~= q[o, i] * max_i |W[o, i]| / 127``.
  Its ``F.linear`` runs forward and backward on the CPU; float64 weights are not supported by torchao.

The quantized tensor reports, and dequantizes to, the dtype the base weight had before quantization
(`dense_weight` turns it back into values: merges write that dtype).

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
>>> sorted(quantize_base(model, "nf4", target_modules=["0"]))
['0']
>>> is_quantized(model[0].weight), model[0].weight.requires_grad, model(torch.ones(1, 64)).shape
(True, False, torch.Size([1, 2]))
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ._common import (
    Targets,
    all_linear,
    dense_weight,
    is_quantized,
    name_matches,
    refuse_no_target,
    refuse_unmatched,
    wraps_a_layer,
)
from .modules_to_save import ModulesToSave

__all__ = ["METHODS", "NF4_BLOCK", "is_quantized", "quantize_base", "quantized_layers", "shard_problems"]

METHODS = ("nf4", "int8")
NF4_BLOCK = 64  # values per absmax block (QLoRA's)
NF4_SCALER_BLOCK = 256  # blocks per double-quantization group, at most (QLoRA's)
_NF4_SHARDED = ("quantized_data", "quantized_scalers", "quantization_factor")  # what torchao's split divides
SHARD_ALIGN = (8, 4, 2, 1)  # scale groups divisible by one of these, the first that fits: FSDP2 over that many ranks

# torchao's import prints "Failed to load ..._C_*.so" (CUDA extensions, absent here) and torch warns about an Enum
# torchao registers with pytree: both harmless, neither for a user's log.
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _torchao():
    """torchao's NF4 and int8 pieces, imported on first use (silenced), with their classes registered as safe
    globals so that a full checkpoint holding them loads under ``torch.load(weights_only=True)``."""
    with _quiet():
        from torchao.quantization import Int8Tensor, to_nf4
        from torchao.quantization.granularity import PerRow
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    torch.serialization.add_safe_globals([nf4_tensor.NF4Tensor, nf4_tensor.SubclassTensorArgs, Int8Tensor, PerRow])
    table = nf4_tensor.NF4_OPS_TABLE
    if table.get(torch.ops.aten.clone.default) is not _nf4_clone:
        table[torch.ops.aten.clone.default] = _nf4_clone
        nf4_tensor.NF4Tensor.get_original_weight = _nf4_values
    return to_nf4, Int8Tensor, PerRow


def _nf4_values(self) -> Tensor:
    """An NF4 weight's values, bit for bit torchao's ``get_original_weight`` in three kernels instead of about ten:
    one lookup of each byte's pair of values, one product with the block scales. Runs twice a training step per
    quantized layer (forward, and the input gradient in backward)."""
    codes = torch.arange(256, device=self.nf4.device)
    pairs = torch.stack([self.nf4[codes >> 4], self.nf4[codes & 0b1111]], dim=-1)  # (256, 2): high, low nibble
    scales = self.dequantize_scalers(self.quantized_scalers, self.quantization_factor, self.scaler_block_size)
    values = pairs[self.quantized_data.long()].view(self.n_blocks, self.block_size)  # (blocks, block)
    return (values * scales.unsqueeze(-1)).view(self.shape)  # (out, in)


def _nf4_clone(func, args, kwargs=None):
    """``aten.clone`` of an NF4 tensor as a copy of its inner tensors. torchao 0.18's requantizes the dequantized
    values with its default block sizes: that re-rounds the scales and fails for any other block size, so a
    ``copy.deepcopy`` of a model quantized here would fail."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, construct_nf4_args

    tensor = args[0]
    inner = ("quantized_scalers", "quantization_factor", "scaler_mean", "quantized_data", "nf4")
    return NF4Tensor(*construct_nf4_args(tensor, {k: getattr(tensor, k).clone() for k in inner}))


def register_safe_globals() -> None:
    """Let ``torch.load(weights_only=True)`` rebuild NF4 and int8 weights (done by every quantizing call)."""
    _torchao()


def nf4_blocks(numel: int) -> tuple[int, int] | None:
    """``(block, scaler_block)`` for a weight of ``numel`` values (see the module docstring), or None if it cannot
    be NF4-quantized (``numel`` not a multiple of 64).

    >>> nf4_blocks(384 * 384)  # 2304 blocks: groups of 144, 16 scale groups (torchao's default 256 would give 9)
    (64, 144)
    >>> nf4_blocks(6 * 6) is None
    True
    """
    if numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    divisors = [d for d in range(min(blocks, NF4_SCALER_BLOCK), 0, -1) if blocks % d == 0]
    for align in SHARD_ALIGN:
        fitting = [d for d in divisors if (blocks // d) % align == 0]
        if fitting:
            return NF4_BLOCK, fitting[0]
    return NF4_BLOCK, divisors[0]


def why_not(module: nn.Module, method: str) -> str | None:
    """Why ``module`` cannot be quantized with ``method`` (None: it can)."""
    if type(module) is not nn.Linear:
        return f"it is a {type(module).__name__}; only nn.Linear layers are quantized"
    weight = module.weight
    if is_quantized(weight):
        return None
    if not weight.dtype.is_floating_point:
        return f"its weight is {weight.dtype}, not a floating-point tensor"
    if method == "int8" and weight.dtype == torch.float64:
        return "its weight is torch.float64, which torchao's int8 weight-only tensor does not take (use nf4)"
    if method == "nf4" and nf4_blocks(weight.numel()) is None:
        return (f"its weight {tuple(weight.shape)} has {weight.numel()} values, not a multiple of the NF4 block "
                f"size {NF4_BLOCK} (use int8)")
    return None


def _quantized(weight: Tensor, method: str) -> Tensor:
    to_nf4, int8_tensor, per_row = _torchao()
    with torch.no_grad(), _quiet():
        data = weight.detach().contiguous()
        if method == "nf4":
            return to_nf4(data, *nf4_blocks(data.numel()))  # (out, in), reports the weight's dtype
        return int8_tensor.from_hp(data, granularity=per_row())  # qdata (out, in) int8, scale (out, 1)


def quantized(weight: Tensor, method: str) -> Tensor:
    """``weight`` quantized with ``method`` (as `quantize_layers` stores it), a new tensor."""
    return _quantized(weight, method)


def check_method(method: object, who: str) -> str:
    if method not in METHODS:
        raise ValueError(f"{who}(quantize={method!r}): quantize must be one of {', '.join(map(repr, METHODS))} "
                         "(4-bit NormalFloat, or int8 weight-only), or None for a full-precision base.")
    return method


def quantize_layers(model: nn.Module, names: list[str], method: str | None, who: str, named: bool,
                    keyword: str = "quantize") -> dict[str, nn.Linear]:
    """Quantize the base layers of modules ``names`` of ``model`` (a wrapper's ``base_layer``, else the module);
    ``method`` None: nothing (a full-precision base).

    ``who`` and ``keyword`` name the caller and its argument in messages (``LoRA(quantize='nf4')``).

    ``named``: the caller named the layers one by one, so one that cannot be quantized is an error (nothing changed);
    otherwise such layers are left as they are, with one warning listing them and why. Called before any other
    change to the model, so that a refusal leaves it as it was.
    """
    if method is None:
        return {}
    layers = {}
    for name in names:
        module = model.get_submodule(name)
        layers[name] = module.base_layer if wraps_a_layer(module) else module
    who = f"{who}({keyword}={method!r})"
    refused = {name: reason for name, layer in layers.items() if (reason := why_not(layer, method))}
    if refused and named:
        name, reason = next(iter(refused.items()))
        raise ValueError(f"{who}: layer {name!r} cannot be quantized with method {method!r}: {reason}. Leave it out "
                         "of target_modules, or match layers by a pattern to skip such layers with a warning.")
    if refused:
        listed = "; ".join(f"{n} ({r})" for n, r in refused.items())
        warnings.warn(f"{who}: {len(refused)} matched layer(s) left unquantized (full precision): {listed}.",
                      UserWarning, stacklevel=3)
    done = {}
    for name, layer in layers.items():
        if name in refused:
            continue
        if not is_quantized(layer.weight):
            layer.weight = nn.Parameter(_quantized(layer.weight, method), requires_grad=False)
            layer.register_load_state_dict_pre_hook(_unflatten_weight)  # a checkpoint holds it flattened
        done[name] = layer
    return done


def _layer_view(model: nn.Module) -> dict[str, nn.Module]:
    """Module names as a user sees them: a wrapper stands for its base layer; modules trained in full are hidden."""
    view: dict[str, nn.Module] = {}
    hidden: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(h) for h in hidden):
            continue
        if isinstance(module, ModulesToSave) or wraps_a_layer(module):
            hidden.append(f"{name}.")
        if not isinstance(module, ModulesToSave):
            view[name] = module.base_layer if wraps_a_layer(module) else module
    return view


def quantize_base(
    model: nn.Module, method: str = "nf4", target_modules: Targets = "all-linear",
    exclude_modules: Targets | None = None,
) -> dict[str, nn.Linear]:
    """Store the frozen weights of ``model``'s chosen linear layers quantized, in place (see the module docstring).

    Args:
        model: Any ``nn.Module`` (LoRA and other adapters may be injected already: their base layers are the ones
            quantized; their own layers never are).
        method: ``"nf4"`` or ``"int8"``.
        target_modules: Names or dotted suffixes (list: each layer is named, so one that cannot be quantized is an
            error), a regular expression (string) or ``"all-linear"`` (every ``nn.Linear`` but the output layer);
            layers a pattern matches that cannot be quantized stay as they are, with one warning.
        exclude_modules: Layers never quantized, same rules.

    Returns:
        The quantized layers by full module name (those quantized before included).

    Raises:
        ValueError: If ``method`` is unknown, a list entry matches no module, or a named layer cannot be quantized
            (its shape or dtype; nothing is changed then).
    """
    check_method(method, "quantize_base")
    view = _layer_view(model)
    if target_modules == "all-linear":
        chosen = all_linear(model, view, (nn.Linear,))  # the output layer stays in full precision
    else:
        chosen = [n for n in view if name_matches(n, target_modules)]
        linears = ", ".join(n for n, v in view.items() if isinstance(v, nn.Linear)) or "none"
        refuse_unmatched("quantize_base", target_modules, list(view), model, lambda m: linears)
        if not chosen:  # a regular expression that matches nothing (e.g. 'all_linear') would quantize nothing
            refuse_no_target("quantize_base", target_modules, model, "quantize", linears, linears.split(", ")[0])
    if exclude_modules is not None:
        chosen = [n for n in chosen if not name_matches(n, exclude_modules)]
    named = isinstance(target_modules, list)
    return quantize_layers(model, chosen, method, "quantize_base", named, keyword="method")


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every module of ``model`` whose own ``weight`` is quantized, by full name."""
    return {n: m for n, m in model.named_modules() if is_quantized(m._parameters.get("weight"))}


def shard_problems(model: nn.Module, shards: int) -> list[str]:
    """Why FSDP2 over ``shards`` ranks cannot shard each quantized weight of ``model`` (empty: it can).

    torchao splits every inner tensor of an NF4 weight along its first dimension and asserts that each divides by
    the shard count; an int8 weight-only tensor has no FSDP2 support in torchao 0.18.
    """
    problems = []
    for name, module in quantized_layers(model).items():
        weight = module.weight
        inner = [getattr(weight, k, None) for k in _NF4_SHARDED]
        if any(t is None for t in inner) or not callable(getattr(weight, "fsdp_pre_all_gather", None)):
            problems.append(f"{name}: a {type(weight).__name__} weight, which torchao cannot shard with FSDP2")
            continue
        sizes = {"rows": weight.shape[0], **{k: t.numel() for k, t in zip(_NF4_SHARDED, inner)}}
        bad = [f"{k} {n}" for k, n in sizes.items() if n % shards]
        if bad:
            problems.append(f"{name}: NF4 weight {tuple(weight.shape)} has {', '.join(bad)}, not divisible by "
                            f"{shards} shards")
    return problems



def drop_quantizer_entries(state: dict[str, Tensor], name: str, base: nn.Module) -> None:
    """Remove from ``state`` what a quantizer added beside module ``name``'s ``weight`` and ``bias`` (bitsandbytes'
    scales and quantization state): a merged export of the layer replaces the quantized weight by a plain one."""
    if is_quantized(getattr(base, "weight", None)):
        for key in [k for k in state if k.startswith(f"{name}.") and k[len(name) + 1:] not in ("weight", "bias")]:
            del state[key]


def plain_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with every quantized tensor replaced by its values (an export holds plain tensors)."""
    return {k: dense_weight(v) for k, v in state.items()}


#: The key infix of a quantized weight's inner tensors in a checkpoint: ``<key>.quantized.<inner>``.
FLAT = ".quantized."


def flatten_quantized(state: dict[str, Tensor]) -> None:
    """In place: each quantized tensor of ``state`` becomes its inner plain tensors, ``<key>.quantized.<inner>``
    (NF4: ``quantized_data``, ``quantized_scalers``, ...).

    A checkpoint then holds plain tensors only: Lightning loads every checkpoint with a callable ``map_location``,
    which torch refuses for a wrapper tensor subclass (``_rebuild_wrapper_subclass``), so a file holding NF4 or int8
    tensors themselves could be written but never resumed from or loaded. The quantized layers' load hook
    (`_unflatten_weight`) reassembles them; the bytes stay those of the quantized weight.
    """
    for key in [k for k, v in state.items() if isinstance(v, Tensor) and is_quantized(v)]:
        value = state.pop(key)
        names, _ = value.__tensor_flatten__()
        state.update({f"{key}{FLAT}{name}": getattr(value, name) for name in names})


def _unflatten_weight(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook of a quantized layer: a weight `flatten_quantized` wrote as inner tensors is
    rebuilt as the quantized tensor the layer holds (same type and block sizes: they follow from the shape)."""
    key = f"{prefix}weight"
    if key in state_dict or not any(k.startswith(f"{key}{FLAT}") for k in state_dict):
        return
    current = module.weight.data
    names, context = current.__tensor_flatten__()
    inner = {name: state_dict.pop(f"{key}{FLAT}{name}") for name in names}
    state_dict[key] = type(current).__tensor_unflatten__(inner, context, current.size(), current.stride())
