"""What the multi-process strategy tests share: a free port, and the small causal-LM example run from the CLI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_lm_example(config_name: str, cwd: Path) -> str:
    """``lightning-peft fit --config examples/configs/<config_name> --trainer.devices 2`` on a tiny decoder and a
    few articles (2 steps, one validation and test batch); returns stdout + stderr, asserting the run passed."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_peft.cli", "fit", "--config", str(ROOT / "examples" / "configs" / config_name),
         "--trainer.devices", "2", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
         "--trainer.limit_test_batches", "1", "--trainer.num_sanity_val_steps", "0",
         "--data.init_args.limit_per_class", "6", "--data.init_args.block_size", "16", "--data.init_args.batch_size", "4",
         "--model.init_args.decoder.hidden_size", "32", "--model.init_args.decoder.num_layers", "2"],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


def exit_worker() -> None:
    """Ends a multi-process worker whose work (and teardown) is done: gloo's worker threads can abort interpreter
    finalisation after a passing run (exit 134, "terminate called without an active exception"), so it skips it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
