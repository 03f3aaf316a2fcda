"""``convert_checkpoint`` at its documented path, and ``python -m lightning_peft.strategies.checkpoint SHARDED_DIR
OUTPUT_FILE [--trust]``. The conversion is pure torch: `lightning_peft.parallel.checkpoint`."""

from __future__ import annotations

import sys

from lightning_peft.parallel.checkpoint import convert_checkpoint

__all__ = ["convert_checkpoint"]

if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if a != "--trust"]
    if len(arguments) != 2:
        sys.exit("usage: python -m lightning_peft.strategies.checkpoint SHARDED_CHECKPOINT_DIR OUTPUT_FILE [--trust]")
    print(convert_checkpoint(arguments[0], arguments[1], trust="--trust" in sys.argv[1:]))
