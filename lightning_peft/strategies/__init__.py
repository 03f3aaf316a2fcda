"""Lightning strategies over real engines (DeepSpeed, torch.distributed), PEFT-aware: Lightning glue over
`lightning_peft.parallel`.

Importing this package registers the short names in Lightning's strategy registry, so
``Trainer(strategy="zero3")`` and ``--trainer.strategy zero3`` work (the ``lightning-peft`` command imports it),
and defines the ``ZeROStrategy`` backends (``zero_deepspeed``, ``zero_native``).
"""

from lightning_peft.parallel.checkpoint import convert_checkpoint
from lightning_peft.strategies.device_map import DeviceMapStrategy
from lightning_peft.strategies.pipeline import PipelineStrategy
from lightning_peft.strategies.tensor_parallel import TensorParallelStrategy
from lightning_peft.strategies.zero import ZeROStrategy
import lightning_peft.strategies.zero_deepspeed  # noqa: E402, F401 (defines ZeROStrategy's backends)
import lightning_peft.strategies.zero_native  # noqa: E402, F401

__all__ = ["DeviceMapStrategy", "PipelineStrategy", "TensorParallelStrategy", "ZeROStrategy", "convert_checkpoint"]
