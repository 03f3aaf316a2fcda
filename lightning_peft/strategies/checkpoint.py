"""``convert_checkpoint`` at its documented path, and ``python -m lightning_peft.strategies.checkpoint SHARDED_DIR
OUTPUT_FILE [--trust]``. The conversion is pure torch: `lightning_peft.parallel.checkpoint`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_peft.parallel.checkpoint import convert_checkpoint

__all__ = ["convert_checkpoint"]


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: converts, prints the output path; a refusal or a failed write exits with its message."""
    parser = argparse.ArgumentParser(prog="python -m lightning_peft.strategies.checkpoint",
                                     description="Write a sharded checkpoint directory as one Lightning checkpoint.")
    parser.add_argument("checkpoint", help="the sharded checkpoint directory (DeepSpeed, torch distributed, pipeline)")
    parser.add_argument("output", help="the file to write")
    parser.add_argument("--trust", action="store_true",
                        help="read the files unrestricted (they can run code): only for a checkpoint you trust")
    arguments = parser.parse_args(argv)
    try:
        written = convert_checkpoint(arguments.checkpoint, arguments.output, trust=arguments.trust)
    except (ValueError, OSError) as error:  # the message names the file and the fix; a traceback adds nothing
        parser.exit(1, f"error: {error}\n")
    sys.stdout.write(f"{written}\n")


if __name__ == "__main__":
    main()
