"""LoKr (LyCORIS' low-rank Kronecker product; Yeh et al., arXiv:2309.14859): a weight update that is the Kronecker
product of a small and a larger (low-rank) factor. The technique in `model`, the settings in `config`, the factors in
`layer`, the math as pure functions in `kron`; what LoKr shares with LoHa in `lightning_peft.peft.lycoris`."""

from .config import LoKrConfig
from .kron import factor_shapes, factorization, init_factors, kron_weight
from .layer import LoKrLayer
from .model import LoKrAdapter, disable_lokr, inject_lokr, lokr_layers, merge_lokr, unload_lokr, unmerge_lokr

__all__ = ["LoKrAdapter", "LoKrConfig", "LoKrLayer", "disable_lokr", "factor_shapes", "factorization",
           "init_factors", "inject_lokr", "kron_weight", "lokr_layers", "merge_lokr", "unload_lokr", "unmerge_lokr"]
