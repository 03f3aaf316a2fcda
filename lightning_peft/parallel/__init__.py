"""Model parallelism without Lightning: what the strategies in [`lightning_peft.strategies`][lightning_peft.strategies]
call.

Pure torch, ``torch.distributed`` and DeepSpeed helpers, usable from a plain training loop; nothing here imports
``lightning``. Modules:

- `partition`: a model's units, cut into consecutive balanced parts;
- `device_map`: the device-map dispatcher (layers on several devices of one process);
- `pipeline`: pipeline pieces, stages and schedules;
- `pipeline_state`: what each pipeline rank holds and exchanges, merging its files;
- `tensor_parallel`: the tensor-parallel plan (automatic, LoRA-aware) and applying it;
- `dtensor`: DTensor shards next to plain tensors: global norm, data-parallel average;
- `zero`: ZeRO's optimizer, FSDP2-unit and DeepSpeed helpers;
- `checkpoint`: sharded checkpoints (DeepSpeed, torch distributed, pipeline) to one file;
- `memory`: the bytes a rank holds, by category (parameters, gradients, optimizer state);
- `adapters`: which modules are adapter wrappers (asked of the PEFT adapter protocol).
"""

from lightning_peft.parallel.adapters import adapter_wrappers
from lightning_peft.parallel.checkpoint import convert_checkpoint
from lightning_peft.parallel.device_map import DeviceMap, dispatch_model, infer_device_map, parse_device
from lightning_peft.parallel.partition import balanced_cuts, balanced_groups, layer_units
from lightning_peft.parallel.pipeline import pipeline_pieces, split_pieces
from lightning_peft.parallel.pipeline_state import consolidate_checkpoint
from lightning_peft.parallel.dtensor import clip_grad_norm
from lightning_peft.parallel.tensor_parallel import auto_plan, parallelize, resolve_plan

__all__ = [
    "DeviceMap", "adapter_wrappers", "auto_plan", "balanced_cuts", "balanced_groups", "clip_grad_norm",
    "consolidate_checkpoint", "convert_checkpoint", "dispatch_model", "infer_device_map", "layer_units", "parallelize",
    "parse_device", "pipeline_pieces", "resolve_plan", "split_pieces",
]
