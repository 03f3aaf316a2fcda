"""LoHa (FedPara, Hyeon-Woo et al., arXiv:2108.06098; LyCORIS): a weight update that is the Hadamard product of two
low-rank products. The technique in `model`, the settings in `config`, the factors in `layer`; what LoHa shares with
LoKr in `lightning_peft.peft.lycoris`."""

from .config import LoHaConfig
from .layer import LoHaLayer
from .model import LoHaAdapter, disable_loha, inject_loha, loha_layers, merge_loha, unload_loha, unmerge_loha

__all__ = ["LoHaAdapter", "LoHaConfig", "LoHaLayer", "disable_loha", "inject_loha", "loha_layers", "merge_loha",
           "unload_loha", "unmerge_loha"]
