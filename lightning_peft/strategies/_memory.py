"""``rank_bytes`` at the path the benchmarks use; it is pure torch: :mod:`lightning_peft.parallel.memory`."""

from lightning_peft.parallel.memory import rank_bytes

__all__ = ["rank_bytes"]
