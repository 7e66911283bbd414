# `make demo` and `make test` do all set-up on a fresh clone: they create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# the real torchtitan releases the interop tests run against (tests/test_torchtitan_interop.py)
TORCHTITAN_DIR := $(VENV)/torchtitan
TORCHTITAN_STAMP := $(TORCHTITAN_DIR)/.installed-stamp
DEMO_OUT ?= outputs/demo
# `make demo ASYNC_MODE=async` (or async_with_pinned_mem) runs the demo with background saves
ASYNC_MODE ?= disabled
DEMO_ARGS = --config configs/debug_model.toml --job.dump_folder $(DEMO_OUT) --checkpoint.async_mode $(ASYNC_MODE)

# where pip's own sources hold no CPU wheel of torch (PyPI's Linux wheels are CUDA builds):
# make test TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: demo test test-torch-latest bench docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned, so that the test extras pull no other build (TORCH_INDEX: above)
	$(PY) -m pip install --quiet torch==2.13.0 $(TORCH_INDEX)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# each torchtitan release in its own folder (they cannot share one), without its dependencies;
# common/ holds what importing them needs (tests/requirements-torchtitan.txt). Test-only.
# torchtitan 0.3.0 and those pins need Python 3.11: on 3.10 the interop tests skip, saying why.
$(TORCHTITAN_STAMP): tests/requirements-torchtitan.txt $(STAMP)
	rm -rf $(TORCHTITAN_DIR)
	if $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  $(PY) -m pip install --quiet --no-deps --target $(TORCHTITAN_DIR)/0.2.2 torchtitan==0.2.2 && \
	  $(PY) -m pip install --quiet --no-deps --target $(TORCHTITAN_DIR)/0.3.0 torchtitan==0.3.0 spmd_types==0.2.3 && \
	  $(PY) -m pip install --quiet --no-deps --target $(TORCHTITAN_DIR)/common -r tests/requirements-torchtitan.txt; \
	else echo "Python < 3.11: torchtitan and its test pins not installed, the interop tests will skip"; fi
	mkdir -p $(TORCHTITAN_DIR) && touch $(TORCHTITAN_STAMP)

demo: $(STAMP)
	rm -rf $(DEMO_OUT)
	@echo "== run 1: 2 ranks train steps 1-10, then stop as a preemption would"
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 -m torchtitan_ckpt.example.train $(DEMO_ARGS) --training.stop_at_step 10
	@echo "== run 2: a new job resumes from the newest complete step and finishes"
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 -m torchtitan_ckpt.example.train $(DEMO_ARGS)
	@echo "== checkpoints in $(abspath $(DEMO_OUT))/checkpoint"
	$(VENV)/bin/torchtitan-ckpt list $(DEMO_OUT)/checkpoint

test: $(STAMP) $(TORCHTITAN_STAMP)
	$(PY) -m pytest -q

# the suite on the newest torch pip installs here (a CUDA build, about 3 GB with its CUDA
# libraries, that runs on CPU), in a venv of its own
LATEST := .venv-torch-latest
test-torch-latest:
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade torch
	$(LATEST)/bin/python -m pip install --quiet -e '.[test]'
	$(LATEST)/bin/python -c 'import torch; print("torch", torch.__version__)'
	$(LATEST)/bin/python -m pytest -q

# the benchmark suite (about 9 minutes); BENCH_ARGS=--quick for a short run
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m benchmarks $(BENCH_ARGS)

docs: $(STAMP)
	$(PY) -m torchtitan_ckpt.docgen torchtitan_ckpt.example.config:JobConfig > docs/config.md
	$(PY) -m torchtitan_ckpt.apidoc > docs/api.md

clean:
	rm -rf $(VENV) $(LATEST) outputs
