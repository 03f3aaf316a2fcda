"""One launch of 2 gloo ranks for all the multi-process work of a test session.

A launch costs two new interpreters (torch, Lightning, transformers and DeepSpeed imported twice: about 12 CPU
seconds) before any test work; the suite used to pay it once per test module. Now each module names a job here,
and the session fixture ``two_ranks`` (``tests/conftest.py``) starts 2 ranks once, running the jobs of the modules
that the session collected (a ``-k`` or a single file runs just its own), one after another in one process group.

A job is a worker script's ``run(out)``; it writes its results under ``OUT/<job>/`` for its tests to read.
Each rank marks a finished job with ``done-rank<r>``; a job that raises writes ``error-rank<r>.txt`` and ends its
rank at once (the other rank then fails in its next collective), so the jobs after it do not run and their tests
fail naming the job that failed first.

Usage (what the fixture runs on each rank): ``python -m tests._two_ranks OUT JOB [JOB ...]`` with MASTER_ADDR,
MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK and NODE_RANK set as torchrun sets them.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: job -> (the test module that reads its results, relative to the repository root; "module:function" it runs)
JOBS = {  # pp_script and accumulation_script silence warnings when imported: they go last
    "lora_ddp": ("tests/callbacks/test_lora_ddp.py", "tests.callbacks.ddp_lora_script:run"),
    "curriculum_ddp": ("tests/callbacks/test_curriculum_ddp.py", "tests.callbacks.ddp_curriculum_script:run"),
    "checkpointing": ("tests/callbacks/test_activation_checkpointing.py", "tests.callbacks.checkpointing_script:main"),
    "hf_causal_lm": ("tests/modules/test_hf_causal_lm_ddp.py", "tests.modules.hf_causal_lm_script:run"),
    "sft_ddp": ("tests/data/test_sft_ddp.py", "tests.data.sft_ddp_script:run"),
    "quantize": ("tests/strategies/test_quantize.py", "tests.strategies.quantize_script:every_case"),
    "zero": ("tests/strategies/test_zero.py", "tests.strategies.zero_script:run"),
    "matrix": ("tests/matrix/test_matrix.py", "tests.matrix.matrix_script:run"),
    "tensor_parallel": ("tests/strategies/test_tensor_parallel.py", "tests.strategies.tp_script:run"),
    "accumulation": ("tests/callbacks/test_gradient_accumulation.py", "tests.callbacks.accumulation_script:main"),
    "pipeline": ("tests/strategies/test_pipeline.py", "tests.strategies.pp_script:run"),
}


def jobs_for(test_files: set[Path]) -> list[str]:
    """The jobs whose test module is among ``test_files``, in the order of ``JOBS``."""
    files = {path.resolve() for path in test_files}
    return [job for job, (user, _) in JOBS.items() if (ROOT / user).resolve() in files]


class Runs:
    """Where each job left its results; :meth:`path` fails the calling test if its job did not finish."""

    def __init__(self, out: Path, jobs: list[str], logs: list[str]) -> None:
        self.out, self.jobs, self.logs = out, jobs, logs

    def path(self, job: str) -> Path:
        import pytest

        if job not in self.jobs:
            pytest.fail(f"two_ranks: job {job!r} was not launched in this session (jobs: {self.jobs})")
        here = self.out / job
        if all((here / f"done-rank{r}").exists() for r in (0, 1)):
            return here
        errors = sorted(self.out.glob("*/error-rank*.txt"))
        first = errors[0].read_text()[-4000:] if errors else "(no job raised: see the logs)"
        failed = errors[0].parent.name if errors else "?"
        tails = "\n".join(f"--- rank {r} ---\n{log[-3000:]}" for r, log in enumerate(self.logs))
        pytest.fail(f"two_ranks: job {job!r} did not finish; job {failed!r} failed first:\n{first}\n{tails}")


def launch(out: Path, jobs: list[str], timeout: float = 1800) -> Runs:
    """Start 2 ranks on this machine (as torchrun would) running ``jobs``; wait for both."""
    from tests.strategies._launch import free_port

    port, procs, paths = free_port(), [], [out / f"rank{rank}.log" for rank in (0, 1)]
    # Output goes to files: a rank blocked on a full pipe that nobody reads would hang the other in a collective.
    for rank, path in enumerate(paths):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": str(ROOT)}
        env.pop("PL_GLOBAL_SEED", None)  # a CLI test's seed_everything would reseed the workers' fits
        with path.open("w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "tests._two_ranks", str(out), *jobs], cwd=ROOT,
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass  # the tests of the jobs left unfinished fail, with the logs
    finally:
        for p in procs:
            p.kill()
    return Runs(out, jobs, [path.read_text(errors="replace") for path in paths])


def main(out: Path, jobs: list[str]) -> None:
    from tests.strategies._launch import exit_worker

    rank = int(os.environ["RANK"])
    for job in jobs:
        module, function = JOBS[job][1].split(":")
        here = out / job
        here.mkdir(parents=True, exist_ok=True)
        start, environment = time.perf_counter(), dict(os.environ)
        try:
            getattr(importlib.import_module(module), function)(here)
            os.environ.clear()  # what a job sets (seed_everything's PL_GLOBAL_SEED) does not reach the next
            os.environ.update(environment)
        except BaseException:  # noqa: BLE001 - reported to the tests through the file, then this rank ends
            (here / f"error-rank{rank}.txt").write_text(traceback.format_exc())
            print(f"[two_ranks] {job} FAILED on rank {rank}", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        (here / f"done-rank{rank}").touch()
        print(f"[two_ranks] {job} done in {time.perf_counter() - start:.1f} s", flush=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    exit_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
