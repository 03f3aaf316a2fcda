"""LoKr (LyCORIS' low-rank Kronecker product; arXiv:2309.14859). The math as pure functions in `kron`."""

from .kron import factor_shapes, factorization, init_factors, kron_weight

__all__ = ["factor_shapes", "factorization", "init_factors", "kron_weight"]
