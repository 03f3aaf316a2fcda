"""Hostile and broken adapter directories (:mod:`lightning_peft.peft._adapter_files`, through ``load_adapter``).

Every file is small and written here; every refusal names the file and the cause, and leaves the model exactly as it
was (its module tree, its values, ``requires_grad``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from lightning_peft.peft import (
    add_adapter,
    inject_bottleneck_adapters,
    inject_lora,
    load_adapter,
    save_adapter,
)
from tests._models import bert_model
from tests.peft.test_io import (
    CONFIG,
    PREFIX,
    WEIGHTS,
    _assert_unchanged,
    _base,
    _edit_config,
    _fresh,
    _randomise_ours,
    _read_weights,
    _snapshot,
    _write_adapter,
)

QUERY_A = "bert.encoder.layer.0.attention.self.query.lora_A.weight"


def _model():
    model = _fresh(_base("bert"), "bert")
    model.bert.embeddings.requires_grad_(False)  # a non-uniform pattern that must survive exactly
    return model


def _refused(directory: Path, exc: type, match: str) -> None:
    """``load_adapter`` raises ``exc`` matching ``match`` and leaves a fresh model exactly as it was."""
    model = _model()
    snapshot = _snapshot(model)
    with pytest.raises(exc, match=match):
        load_adapter(model, directory)
    _assert_unchanged(model, snapshot)


def _with_tensor(directory: Path, key: str, value: torch.Tensor) -> None:
    tensors = _read_weights(directory / WEIGHTS)
    tensors[PREFIX + key] = value
    save_file(tensors, directory / WEIGHTS)


# ------------------------------------------------------------------------------- all or nothing (subfolders)


def _with_named(directory: Path, folder: str, hidden: int = 16) -> None:
    """A good ``default`` adapter at ``directory`` and a named one in ``directory/<folder>`` (trained on a model
    ``hidden`` wide)."""
    _write_adapter(directory)
    model = bert_model(hidden_size=hidden).double()
    inject_lora(model, rank=4, alpha=8, target_modules=["query"])
    add_adapter(model, "b", rank=2, target_modules=["value"])
    _randomise_ours(model)
    save_adapter(model, directory / "other", adapter_names=["b"])
    (directory / "other" / "b").rename(directory / folder)
    shutil.rmtree(directory / "other")


@pytest.mark.parametrize("folder, hidden, match", [
    ("a-b", 16, r"subfolder .*a-b would load as adapter 'a-b', which is not a usable adapter name"),
    ("..x", 16, r"subfolder .*\.\.x would load as adapter '\.\.x'"),
    ("b", 24, r"key base_model\.model\..*value\.lora_A\.weight has shape \(2, 24\), but the model needs \(2, 16\)"),
])
def test_a_bad_named_subfolder_leaves_the_model_as_it_was(folder, hidden, match, tmp_path):
    _with_named(tmp_path, folder, hidden)
    _refused(tmp_path, ValueError, match)


def test_a_good_directory_with_named_subfolders_still_loads_all(tmp_path):
    _with_named(tmp_path, "b")
    model = load_adapter(_model(), tmp_path)
    assert sorted(model._lightning_peft_adapters["lora"].names) == ["b", "default"]


# ------------------------------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype, name", [
    (torch.int64, "int64"), (torch.int8, "int8"), (torch.uint8, "uint8"), (torch.bool, "bool"),
])
def test_integer_and_boolean_tensors_are_refused_naming_file_key_and_dtype(dtype, name, tmp_path):
    _write_adapter(tmp_path)
    _with_tensor(tmp_path, QUERY_A, torch.ones(4, 16, dtype=dtype))
    _refused(tmp_path, ValueError, rf"{WEIGHTS} key {PREFIX}{QUERY_A} has dtype {name}; adapter weights are "
                                   "floating point, and loading it would cast it to float silently")


def test_a_float8_tensor_is_widened_exactly_to_float32(tmp_path):
    _write_adapter(tmp_path)
    stored = (torch.randn(4, 16, generator=torch.Generator().manual_seed(3))).to(torch.float8_e4m3fn)
    _with_tensor(tmp_path, QUERY_A, stored)

    model = load_adapter(_model(), tmp_path)

    loaded = model.get_submodule("bert.encoder.layer.0.attention.self.query").lora_A["default"].weight
    assert torch.equal(loaded, stored.to(loaded.dtype))


# ----------------------------------------------------------------------------------------- modules_to_save


@pytest.mark.parametrize("entry", ["../x", "", "bert..pooler", "bert/pooler"])
def test_a_modules_to_save_entry_that_cannot_be_a_module_path_is_refused(entry, tmp_path):
    _write_adapter(tmp_path)
    _edit_config(tmp_path, modules_to_save=["classifier", entry])
    _refused(tmp_path, ValueError, rf"{CONFIG} lists modules_to_save entry {entry!r}, which cannot be a module path")


def test_a_modules_to_save_entry_that_matches_nothing_is_named_in_a_warning(tmp_path):
    _write_adapter(tmp_path, modules_to_save=["classifier"])
    _edit_config(tmp_path, modules_to_save=["classifier", "score", "classifer"])  # PEFT's head names, and a typo
    with pytest.warns(UserWarning, match=r"lists modules_to_save \['classifer'\] that match no module") as record:
        load_adapter(_model(), tmp_path)
    assert not [w for w in record if "'score'" in str(w.message)]


# ------------------------------------------------------------------------------------------- symbolic links


def test_a_symlinked_subfolder_outside_the_directory_is_refused(tmp_path):
    _with_named(tmp_path / "outside", "b")
    _write_adapter(tmp_path / "adapter")
    os.symlink(tmp_path / "outside" / "b", tmp_path / "adapter" / "b")
    _refused(tmp_path / "adapter", ValueError, r"adapter/b resolves to .*outside/b, outside the adapter directory")


@pytest.mark.parametrize("name", [CONFIG, WEIGHTS])
def test_a_symlinked_adapter_file_outside_the_directory_is_refused(name, tmp_path):
    _write_adapter(tmp_path / "outside")
    _write_adapter(tmp_path / "adapter")
    (tmp_path / "adapter" / name).unlink()
    os.symlink(tmp_path / "outside" / name, tmp_path / "adapter" / name)
    _refused(tmp_path / "adapter", ValueError, rf"adapter/{name} resolves to .*outside/{name}, outside the adapter")


def test_the_hugging_face_hub_cache_layout_of_links_into_blobs_loads(tmp_path):
    repo = tmp_path / "models--someone--adapter"
    _write_adapter(tmp_path / "written")
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, name in enumerate([CONFIG, WEIGHTS]):
        (tmp_path / "written" / name).rename(repo / "blobs" / f"blob{i}")
        os.symlink(Path("..", "..", "blobs", f"blob{i}"), snapshot / name)
    load_adapter(_model(), snapshot)


# ------------------------------------------------------------------------- shapes against the file's own config


def test_a_huge_rank_with_tiny_weights_is_refused_before_anything_is_allocated(tmp_path):
    _write_adapter(tmp_path)
    _edit_config(tmp_path, r=16777216)  # 2**24: injecting it first would allocate gigabytes
    _refused(tmp_path, ValueError, rf"{WEIGHTS} key {PREFIX}bert\..*\.lora_[AB]\.weight has shape \((4, 16|16, 4)\) "
                                   rf"\(size 4 along dimension [01]\), but its own config .*{CONFIG} says r=16777216")


def test_a_huge_rank_with_no_weights_is_refused_before_anything_is_allocated(tmp_path):
    _write_adapter(tmp_path)
    _edit_config(tmp_path, r=16777216)
    save_file({}, tmp_path / WEIGHTS)
    key = rf"{PREFIX}bert\.encoder\.layer\.0\.attention\.self\.query\.lora_A\.weight"
    _refused(tmp_path, ValueError, rf"lacks key {key} \(and 7 more\) that its adapter config asks for")


def test_a_torn_save_says_the_file_disagrees_with_its_own_config(tmp_path):
    _write_adapter(tmp_path, rank=8)
    _edit_config(tmp_path, r=4)  # the config of another save
    _refused(tmp_path, ValueError, rf"{WEIGHTS} key {PREFIX}bert\..*\.lora_[AB]\.weight has shape \((8, 16|16, 8)\) "
                                   r".*says r=4: the file's tensors disagree with its config, so the save is probably "
                                   "torn or mixed")


def test_a_torn_rank_pattern_is_named(tmp_path):
    _write_adapter(tmp_path, rank_pattern={"value": 2})
    _edit_config(tmp_path, rank_pattern={"value": 3})
    _refused(tmp_path, ValueError, r"value\.lora_[AB]\.weight has shape .* says rank_pattern\['value'\]=3")


# ------------------------------------------------------------------------------------ malformed adapter_config.json


@pytest.mark.parametrize("text, match", [
    ("[" * 100_000 + "]" * 100_000, r"nests JSON arrays or objects deeper than Python's parser can follow"),
    ('{"peft_type": "LORA", "r": ' + "9" * 5000 + "}", r"holds a number Python refuses to read \(.*digits"),
])
def test_a_config_python_cannot_parse_is_refused_naming_the_file_and_cause(text, match, tmp_path):
    _write_adapter(tmp_path)
    (tmp_path / CONFIG).write_text(text)
    _refused(tmp_path, ValueError, rf"load_adapter: .*{CONFIG} {match}")


# ---------------------------------------------------------------------------------- regular expressions from a file


@contextlib.contextmanager
def _deadline(seconds: float):
    """Fail (rather than hang) if the block runs longer than ``seconds``: ``re`` checks for signals while it
    backtracks, so the alarm interrupts a pattern that is being matched (a thread could not: ``re`` holds the GIL)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: the pattern was matched, not refused")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("field, value, named", [
    ("target_modules", "(.|.)*Z", r"target_modules='\(\.\|\.\)\*Z'\): target_modules"),
    ("rank_pattern", {"(.|.)*Z": 2}, r"rank_pattern=\{'\(\.\|\.\)\*Z': 2\}\): rank_pattern key='\(\.\|\.\)\*Z'"),
    ("alpha_pattern", {"(a+)+Z": 2}, r"alpha_pattern=\{'\(a\+\)\+Z': 2\}\): alpha_pattern key='\(a\+\)\+Z'"),
])
def test_a_backtracking_pattern_is_refused_before_it_is_matched(field, value, named, tmp_path):
    _write_adapter(tmp_path)
    _edit_config(tmp_path, **{field: value})
    model = _model()
    snapshot = _snapshot(model)
    match = (rf"{CONFIG} holds a value LoRA refuses: LoRA\({named} has .*\(catastrophic backtracking\).*Write it so each part of a "
             "name can be matched one way only")
    with _deadline(5), pytest.raises(ValueError, match=match):
        load_adapter(model, tmp_path)
    _assert_unchanged(model, snapshot)



def test_a_several_technique_save_whose_second_part_does_not_fit_leaves_the_model_as_it_was(tmp_path):
    model = _fresh(_base("bert"), "bert")
    inject_lora(model, rank=4, alpha=8, target_modules=["query"], modules_to_save=[])
    inject_bottleneck_adapters(model, placement="pfeiffer", modules_to_save=[])
    save_adapter(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bottleneck", "lora"]
    # bottleneck/ loads first; lora/ is read and checked alone (its ranks agree with its config) and fits no model
    tensors = _read_weights(tmp_path / "lora" / WEIGHTS)
    tensors[PREFIX + QUERY_A] = torch.zeros(4, 24)
    save_file(tensors, tmp_path / "lora" / WEIGHTS)
    _refused(tmp_path, ValueError, rf"key {PREFIX}{QUERY_A} has shape \(4, 24\), but the model needs \(4, 16\)")
