"""convert_checkpoint reads a stranger's checkpoint without running its code (real DeepSpeed and torch distributed
checkpoints, one process), and refuses a crafted one unless told to trust it."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
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


def convert_without_running(crafted: Path, output: Path, marker: Path, **kwargs) -> Path:
    """``convert_checkpoint``, checking (whether it returns or raises) that the crafted code did not run."""
    try:
        return convert_checkpoint(crafted, output, **kwargs)
    finally:
        assert not marker.exists(), "reading the crafted checkpoint ran its code"


def add_evil(states: Path, marker: Path) -> None:
    torch.save({**torch.load(states, weights_only=False), "extra": Evil(marker)}, states)


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
    add_evil(states, tmp_path / "ran.txt")
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


# --- a hostile directory: every route by which reading it could run code ----------------------------------------


def good_files(deepspeed_run) -> Path:
    return deepspeed_run[0] / "checkpoint"  # DeepSpeed's tag folder, as ZeROStrategy names it


@pytest.mark.parametrize("tag", ["*", "step[12]"])
def test_a_glob_as_tag_reads_only_the_folder_of_that_name(deepspeed_run, tag, tmp_path):
    """DeepSpeed's reader globbed ``<dir>/<tag>/*_model_states.pt``: beside a folder literally named ``*`` (which the
    old check read), it unpickled another folder's files unrestricted."""
    crafted, marker = tmp_path / "crafted.ckpt", tmp_path / "ran.txt"
    shutil.copytree(good_files(deepspeed_run), crafted / tag)
    (crafted / "latest").write_text(tag)
    for other in ("step1", "step2"):  # what the glob matches: the first file read (with the check) is a good one
        shutil.copytree(good_files(deepspeed_run), crafted / other)
    add_evil(crafted / "step2" / "mp_rank_00_model_states.pt", marker)
    for trust in (False, True):  # trusted or not, the tag names one folder
        state = torch.load(convert_without_running(crafted, tmp_path / "one.ckpt", marker, trust=trust),
                           weights_only=True)
        expected = torch.load(convert_checkpoint(deepspeed_run[0], tmp_path / "expected.ckpt"), weights_only=True)
        assert state["state_dict"].keys() == expected["state_dict"].keys()
        assert all(torch.equal(v, expected["state_dict"][k]) for k, v in state["state_dict"].items())


@pytest.mark.parametrize("tag", ["../outside", "/tmp", "a/checkpoint", "..", ""])
def test_a_tag_that_is_not_a_folder_name_is_refused(deepspeed_run, tag, tmp_path):
    shutil.copytree(good_files(deepspeed_run), tmp_path / "outside")  # what ../outside would read: converted before
    crafted = shutil.copytree(deepspeed_run[0], tmp_path / "crafted.ckpt")
    (crafted / "latest").write_text(tag)
    with pytest.raises(ValueError, match=rf"crafted\.ckpt/latest' names the tag '{re.escape(tag)}', which is not the "
                                         r"name of a folder in .*Write the name of the checkpoint's tag folder into it"):
        convert_checkpoint(crafted, tmp_path / "one.ckpt", trust=True)


def test_a_tag_folder_that_links_outside_is_refused_unless_trusted(deepspeed_run, tmp_path):
    outside = shutil.copytree(good_files(deepspeed_run), tmp_path / "outside")
    crafted = tmp_path / "crafted.ckpt"
    crafted.mkdir()
    (crafted / "latest").write_text("global_step2")
    (crafted / "global_step2").symlink_to(outside)
    with pytest.raises(ValueError, match=r"global_step2' is a link to '.*outside', outside the checkpoint .* pass "
                                         r"convert_checkpoint\(\.\.\., trust=True\)"):
        convert_checkpoint(crafted, tmp_path / "one.ckpt")
    assert convert_checkpoint(crafted, tmp_path / "one.ckpt", trust=True).is_file()  # a link you trust is followed


def global_then_call(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle that calls ``module``'s attribute ``name`` (dotted: reached through the module) on
    ``argument``, written opcode by opcode."""

    def text(value: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(value.encode())]) + value.encode()

    return (pickle.PROTO + b"\x04" + text(module) + text(name) + pickle.STACK_GLOBAL + text(argument)
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


def test_metadata_reaching_os_system_through_an_allowed_module_is_refused(native_run, tmp_path):
    """``torch.distributed.checkpoint.metadata`` imports ``os``: allowing the module let ``os.system`` through."""
    module = "torch.distributed.checkpoint.metadata"
    pickle.loads(global_then_call(module, "os.system", f"touch {tmp_path / 'live.txt'}"))
    assert (tmp_path / "live.txt").exists()  # the payload runs when unpickled unrestricted
    crafted, marker = shutil.copytree(native_run[0], tmp_path / "crafted.ckpt"), tmp_path / "ran.txt"
    (crafted / ".metadata").write_bytes(global_then_call(module, "os.system", f"touch {marker}"))
    with pytest.raises(ValueError, match=r"crafted\.ckpt/\.metadata' holds objects a distributed checkpoint's metadata "
                                         r"does not \(torch\.distributed\.checkpoint\.metadata\.os\.system\); .* pass "
                                         r"convert_checkpoint\(\.\.\., trust=True\)"):
        convert_without_running(crafted, tmp_path / "one.ckpt", marker)


def test_metadata_naming_a_data_file_outside_is_refused(native_run, tmp_path):
    crafted = shutil.copytree(native_run[0], tmp_path / "crafted.ckpt")
    metadata = pickle.loads((crafted / ".metadata").read_bytes())  # our own file: trusted
    for info in metadata.storage_data.values():
        info.relative_path = "../__0_0.distcp"
    (crafted / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match=r"\.metadata' names the data file '\.\./__0_0\.distcp', which is not a file "
                                         r"name in .*crafted\.ckpt'"):
        convert_checkpoint(crafted, tmp_path / "one.ckpt")


def test_a_non_tensor_entry_is_read_with_weights_only(native_run, tmp_path):
    """torch's planner unpickles a distributed checkpoint's non-tensor entries unrestricted (``load_bytes``)."""
    import torch.distributed.checkpoint as dcp

    weights = native_run[1]
    plain = tmp_path / "plain.ckpt"  # a plain non-tensor entry reads as it was saved
    dcp.save({"state_dict": {**weights, "note": {"epochs": 3, "name": "run"}}}, checkpoint_id=plain, no_dist=True)
    shutil.copy(native_run[0] / "meta.pt", plain / "meta.pt")
    state = torch.load(convert_checkpoint(plain, tmp_path / "one.ckpt"), weights_only=True)["state_dict"]
    assert state["note"] == {"epochs": 3, "name": "run"} and torch.equal(state["model.classifier.weight"],
                                                                        weights["model.classifier.weight"])
    crafted, marker = tmp_path / "crafted.ckpt", tmp_path / "ran.txt"
    dcp.save({"state_dict": {**weights, "extra": Evil(marker)}}, checkpoint_id=crafted, no_dist=True)
    shutil.copy(native_run[0] / "meta.pt", crafted / "meta.pt")
    with pytest.raises(ValueError, match=r"crafted\.ckpt/__0_0\.distcp' holds the entry 'state_dict\.extra', an object "
                                         r"that torch\.load\(weights_only=True\) does not read \(exec\); .* pass "
                                         r"convert_checkpoint\(\.\.\., trust=True\)"):
        convert_without_running(crafted, tmp_path / "two.ckpt", marker)
    with pytest.raises(ValueError, match=r"holds the entry 'state_dict\.extra'"):  # the same through load_from_checkpoint
        load_from_checkpoint(Classifier, crafted, lora=False)
    assert not marker.exists() and not (tmp_path / "two.ckpt").exists()


# --- a torn file, a full disk: the message names the file and the cause ------------------------------------------


def damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    file.write_bytes(b"" if how == "empty" else data[: len(data) // 2])


TORN = {"empty": r"is empty \(0 bytes\), not a checkpoint: its save was cut off before it wrote anything\. Save the "
                 r"checkpoint again, or use another one\.",
        "truncated": r"is truncated: a checkpoint of \d+ bytes that stops before its end \(a save, copy or download cut "
                     r"off part-way\)\. Save the checkpoint again, or use another one\."}


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_a_torn_single_file_is_named_not_sent_to_be_loaded_directly(how, tmp_path):
    """It was told "this is one file already ... load it directly", and loading it then failed with torch's noise."""
    single = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"weight": torch.ones(64)}}, single)
    damage(single, how)
    with pytest.raises(ValueError, match=rf"convert_checkpoint: '.*last\.ckpt' {TORN[how]}"):
        convert_checkpoint(single, tmp_path / "one.ckpt")


@pytest.mark.parametrize("how", ["empty", "truncated"])
@pytest.mark.parametrize(("layout", "name"), [("pipeline", "stage-1.ckpt"), ("native_run", "meta.pt"),
                                              ("deepspeed_run", "checkpoint/mp_rank_00_model_states.pt")])
def test_a_torn_file_is_named_with_its_cause(layout, name, how, request, tmp_path):
    crafted = tmp_path / "crafted.ckpt"
    if layout == "pipeline":
        crafted.mkdir()
        for rank in (0, 1):
            torch.save({"state_dict": {f"layer{rank}.weight": torch.ones(2)}, "epoch": 0}, crafted / f"stage-{rank}.ckpt")
    else:
        shutil.copytree(request.getfixturevalue(layout)[0], crafted)
    damage(crafted / name, how)
    with pytest.raises(ValueError, match=rf"convert_checkpoint: '.*crafted\.ckpt/{re.escape(name)}' {TORN[how]}"):
        convert_checkpoint(crafted, tmp_path / "one.ckpt")


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_a_torn_metadata_file_is_named(native_run, how, tmp_path):
    crafted = shutil.copytree(native_run[0], tmp_path / "crafted.ckpt")
    damage(crafted / ".metadata", how)
    with pytest.raises(ValueError, match=r"crafted\.ckpt/\.metadata' is empty, truncated or not a distributed "
                                         r"checkpoint's metadata \((EOFError|UnpicklingError): .*\)\. Save the checkpoint"):
        convert_checkpoint(crafted, tmp_path / "one.ckpt")


def test_pipeline_stage_files_convert_and_a_missing_or_crafted_one_is_refused(tmp_path):
    from lightning_peft.parallel import consolidate_checkpoint

    for rank in (0, 1):
        torch.save({"state_dict": {f"layer{rank}.weight": torch.full((2,), rank)}, "epoch": 3},
                   tmp_path / f"stage-{rank}.ckpt")
    converted = torch.load(convert_checkpoint(tmp_path, tmp_path / "one.ckpt"), weights_only=True)
    assert converted["epoch"] == 3 and converted["state_dict"].keys() == {"layer0.weight", "layer1.weight"}
    assert torch.equal(converted["state_dict"]["layer1.weight"], torch.full((2,), 1))
    add_evil(tmp_path / "stage-1.ckpt", tmp_path / "ran.txt")
    with pytest.raises(ValueError, match=r"consolidate_checkpoint: '.*stage-1\.ckpt' holds objects that torch\.load\("
                                         r"weights_only=True\) does not read \(exec\); .* pass consolidate_checkpoint\("
                                         r"\.\.\., weights_only=False\)"):
        consolidate_checkpoint(tmp_path)
    assert not (tmp_path / "ran.txt").exists()
    (tmp_path / "stage-1.ckpt").rename(tmp_path / "stage-2.ckpt")
    with pytest.raises(ValueError, match=r"a pipeline checkpoint of 3 ranks lacks stage-1\.ckpt"):
        convert_checkpoint(tmp_path, tmp_path / "one.ckpt")


DISK_FULL = """
import json, sys
from pathlib import Path
from lightning_peft.parallel.checkpoint import convert_checkpoint  # pure torch: a quick start
source, disk = sys.argv[1], Path(sys.argv[2])
(disk / "one.ckpt").write_bytes(b"previous" * 1000)
try:
    convert_checkpoint(source, disk / "one.ckpt")
except OSError as error:
    print(json.dumps({"errno": error.errno, "message": str(error), "files": sorted(p.name for p in disk.iterdir()),
                      "kept": (disk / "one.ckpt").read_bytes() == b"previous" * 1000}))
"""


def test_a_full_disk_names_the_output_and_replaces_nothing(native_run, tmp_path):
    """A real full disk: a 64 KiB tmpfs mounted in a user and mount namespace of its own (no privileges needed)."""
    namespaces = shutil.which("unshare") and subprocess.run(["unshare", "-rm", "true"], check=False).returncode == 0
    if not namespaces:
        pytest.skip("needs unshare and user namespaces to mount a small filesystem")
    disk = tmp_path / "disk"
    disk.mkdir()
    command = 'mount -t tmpfs -o size=64k tmpfs "$1" && exec "$2" -c "$3" "$4" "$1"'
    result = subprocess.run(["unshare", "-rm", "sh", "-c", command, "sh", str(disk), sys.executable, DISK_FULL,
                             str(native_run[0])], check=False, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert result.returncode == 0 and result.stdout, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["errno"] == errno.ENOSPC
    assert re.fullmatch(r"\[Errno 28\] convert_checkpoint: could not write '.*/disk/one\.ckpt': the disk is full \(No "
                        r"space left on device\); nothing was replaced \('.*/disk/one\.ckpt' is as it was, the "
                        r"temporary file removed\)\. Free space there, or write the output to another disk\.",
                        outcome["message"]), outcome["message"]
    assert outcome["kept"] and outcome["files"] == ["one.ckpt"]


def test_the_command_line_prints_the_output_or_the_refusal(native_run, tmp_path, capsys):
    from lightning_peft.strategies.checkpoint import main

    main([str(native_run[0]), str(tmp_path / "one.ckpt")])
    assert capsys.readouterr().out == f"{tmp_path / 'one.ckpt'}\n"
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "missing"), str(tmp_path / "two.ckpt")])
    assert exited.value.code == 1
    assert re.fullmatch(r"error: convert_checkpoint: '.*missing' does not exist\.\n", capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main([str(native_run[0])])
    assert "the following arguments are required: output" in capsys.readouterr().err
