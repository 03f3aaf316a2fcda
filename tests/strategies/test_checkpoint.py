"""convert_checkpoint reads a stranger's checkpoint without running its code (real DeepSpeed and torch distributed
checkpoints, one process), and refuses a crafted one unless told to trust it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_peft.callbacks import load_from_checkpoint  # noqa: E402
from lightning_peft.strategies import ZeROStrategy, convert_checkpoint  # noqa: E402
from tests.strategies.zero_script import Classifier, data  # noqa: E402


class Evil:
    """Unpickling it writes a file: what a crafted checkpoint could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


class OneProcess(Classifier):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(), batch_size=4)


def sharded(tmp_path_factory, strategy) -> tuple[Path, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("run")
    module = OneProcess(lora=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                         callbacks=[ModelCheckpoint(dirpath=out / "ckpt", filename="last")])
    trainer.fit(module)
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()  # FSDP2: DTensors
               for k, v in module.state_dict().items()}
    return out / "ckpt" / "last.ckpt", weights


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    return sharded(tmp_path_factory, ZeROStrategy(stage=2))


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    return sharded(tmp_path_factory, ZeROStrategy(stage=3, backend="native"))


@pytest.mark.parametrize("run", ["deepspeed_run", "native_run"])
def test_a_real_sharded_checkpoint_converts_with_the_safe_reader(run, request, tmp_path):
    directory, weights = request.getfixturevalue(run)
    module = Classifier.load_from_checkpoint(convert_checkpoint(directory, tmp_path / "one.ckpt"), lora=False)
    assert module.state_dict().keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(module.state_dict()[key], value), key
    trusted = torch.load(convert_checkpoint(directory, tmp_path / "trusted.ckpt", trust=True), weights_only=False)
    assert all(torch.equal(trusted["state_dict"][k], v) for k, v in weights.items())


def test_a_crafted_deepspeed_file_is_refused_and_does_not_run(deepspeed_run, tmp_path):
    directory, _ = deepspeed_run
    crafted = shutil.copytree(directory, tmp_path / "crafted.ckpt")
    (states,) = (crafted / "checkpoint").glob("mp_rank_*_model_states.pt")
    content = torch.load(states, weights_only=False)
    torch.save({**content, "extra": Evil(tmp_path / "ran.txt")}, states)
    with pytest.raises(ValueError, match=r"mp_rank_00_model_states.pt' holds objects that torch.load\(weights_only="
                                         r"True\) does not read \(exec\); .* pass convert_checkpoint\(\.\.\., trust=True\)"):
        convert_checkpoint(crafted, tmp_path / "one.ckpt")
    with pytest.raises(ValueError, match="trust=True"):  # the same through load_from_checkpoint
        load_from_checkpoint(Classifier, crafted, lora=False)
    assert not (tmp_path / "ran.txt").exists()
    assert not (tmp_path / "one.ckpt").exists()


def test_a_crafted_distributed_checkpoint_is_refused_and_does_not_run(native_run, tmp_path):
    directory, _ = native_run
    for name, expected in ((".metadata", r"\.metadata' holds objects a distributed checkpoint's metadata does not"),
                           ("meta.pt", r"meta\.pt' holds objects that torch.load\(weights_only=True\) does not read")):
        crafted = shutil.copytree(directory, tmp_path / name / "crafted.ckpt")
        if name == "meta.pt":
            torch.save({**torch.load(crafted / name, weights_only=False), "x": Evil(tmp_path / "ran.txt")}, crafted / name)
        else:
            import pickle

            (crafted / name).write_bytes(pickle.dumps(Evil(tmp_path / "ran.txt")))
        with pytest.raises(ValueError, match=expected):
            convert_checkpoint(crafted, tmp_path / "one.ckpt")
        assert not (tmp_path / "ran.txt").exists(), name
