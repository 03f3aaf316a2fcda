"""Checkpoint files: a full disk, a failing pickle or a kill while saving leave the previous checkpoint whole."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_peft._checkpoint_io import AtomicCheckpointIO, save_folder
from lightning_peft.callbacks import LoRA
from lightning_peft.strategies import (
    DeviceMapStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeROStrategy,
)
from tests._models import LORA_ARGS, Classifier, bert_config, loader, trainer


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this object")


class OwnIO(TorchCheckpointIO):
    """A user's own plugin: kept as it is."""


def _fitted(tmp_path, **kwargs):
    fitted = trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS)], **kwargs)
    fitted.fit(Classifier(bert_config()), loader())
    return fitted


def test_a_full_disk_keeps_the_previous_checkpoint(small_disk, tmp_path):
    disk = small_disk(512 * 1024)  # Lightning's IO copies from $TMPDIR onto this other filesystem
    fitted = _fitted(tmp_path)
    target = disk / "last.ckpt"
    fitted.save_checkpoint(target)
    before = target.read_bytes()

    with pytest.raises(OSError, match="No space left on device"):
        fitted.strategy.checkpoint_io.save_checkpoint({"weights": torch.zeros(2**20)}, target)  # 4 MiB

    assert target.read_bytes() == before
    assert os.listdir(disk) == ["last.ckpt"]  # no temporary left
    assert fitted.strategy.checkpoint_io.load_checkpoint(target, weights_only=False)["global_step"] == 1


def test_a_pickle_that_fails_part_way_keeps_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"weights": torch.arange(10.0)}, target)
    before = target.read_bytes()

    with pytest.raises(RuntimeError, match="cannot pickle this object"):
        io.save_checkpoint({"weights": torch.zeros(2**18), "extra": Unpicklable()}, target)

    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_the_peft_callbacks_install_it_in_place_of_lightnings_plain_io(tmp_path):
    assert type(_fitted(tmp_path).strategy.checkpoint_io) is AtomicCheckpointIO
    own = OwnIO()
    assert _fitted(tmp_path, plugins=[own]).strategy.checkpoint_io is own


def test_the_librarys_strategies_default_to_it_and_keep_a_given_plugin(tmp_path):
    strategies = [DeviceMapStrategy(), PipelineStrategy(num_stages=2), TensorParallelStrategy(),
                  ZeROStrategy(stage=1, backend="native"), ZeROStrategy(stage=3, backend="native")]
    for strategy in strategies:
        assert type(strategy.checkpoint_io) is AtomicCheckpointIO, type(strategy).__name__
    own = OwnIO()
    given = trainer(tmp_path, strategy=DeviceMapStrategy(), plugins=[own])
    assert given.strategy.checkpoint_io is own


def test_a_folder_checkpoint_is_swapped_in_whole_or_not_at_all(tmp_path):
    strategy = SingleDeviceStrategy(torch.device("cpu"))
    target = tmp_path / "last.ckpt"

    def write(text):
        return lambda folder: (folder / "shard-0").write_text(text)

    save_folder(strategy, target, write("first"))

    def broken(folder):
        (folder / "shard-0").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_folder(strategy, target, broken)
    assert (target / "shard-0").read_text() == "first" and os.listdir(tmp_path) == ["last.ckpt"]
    save_folder(strategy, target, write("second"))
    assert os.listdir(target) == ["shard-0"] and (target / "shard-0").read_text() == "second"


def test_a_folder_checkpoint_replaces_a_file_or_a_link_of_its_name_not_what_the_link_points_to(tmp_path):
    strategy = SingleDeviceStrategy(torch.device("cpu"))
    (tmp_path / "epoch=0.ckpt").mkdir()
    (tmp_path / "epoch=0.ckpt" / "shard-0").write_text("epoch 0")
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "epoch=0.ckpt")  # what ModelCheckpoint(save_last="link") makes
    (tmp_path / "other.ckpt").write_text("a single-file checkpoint")

    for name in ("last.ckpt", "other.ckpt"):
        save_folder(strategy, tmp_path / name, lambda folder: (folder / "shard-0").write_text("new"))
        assert not (tmp_path / name).is_symlink() and (tmp_path / name / "shard-0").read_text() == "new"
    assert (tmp_path / "epoch=0.ckpt" / "shard-0").read_text() == "epoch 0"
    assert sorted(os.listdir(tmp_path)) == ["epoch=0.ckpt", "last.ckpt", "other.ckpt"]


@pytest.mark.parametrize(("how", "expected"), [
    ("empty", r"is empty \(0 bytes\), not a checkpoint"),
    ("truncated", r"is truncated: a checkpoint of 5000 bytes that stops before its end"),
])
def test_resuming_from_a_torn_file_names_it_and_the_cause(tmp_path, how, expected):
    """torch said ``EOFError`` (no message) or ``OSError: [Errno 22] Invalid argument``, naming no file."""
    fitted = _fitted(tmp_path)
    torn = tmp_path / "torn.ckpt"
    fitted.save_checkpoint(torn)
    torn.write_bytes(b"" if how == "empty" else torn.read_bytes()[:5000])
    again = trainer(tmp_path, max_steps=2, callbacks=[LoRA(**LORA_ARGS)])
    with pytest.raises(ValueError, match=rf"AtomicCheckpointIO.load_checkpoint: '.*torn\.ckpt' {expected}.* Save the "
                                         r"checkpoint again, or use another one\."):
        again.fit(Classifier(bert_config()), loader(), ckpt_path=torn)
