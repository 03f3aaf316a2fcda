"""Lightning strategies over real engines (DeepSpeed, torch.distributed), PEFT-aware.

Importing this package registers the short names in Lightning's strategy registry, so
``Trainer(strategy="zero3")`` and ``--trainer.strategy zero3`` work (the ``lightning-peft`` command imports it).
"""

from lightning_peft.strategies.checkpoint import convert_checkpoint
from lightning_peft.strategies.device_map import DeviceMapStrategy
from lightning_peft.strategies.pipeline import PipelineStrategy
from lightning_peft.strategies.tensor_parallel import TensorParallelStrategy
from lightning_peft.strategies.zero import ZeROStrategy

__all__ = ["DeviceMapStrategy", "PipelineStrategy", "TensorParallelStrategy", "ZeROStrategy", "convert_checkpoint"]
