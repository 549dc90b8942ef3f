# Every target sets up its own virtual environment first (a fresh machine needs nothing else
# than python3 with venv). An environment is rebuilt when pyproject.toml or its constraints change.
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints/pinned.txt | sha1sum | cut -c1-12)
TRANSFORMERS_4 := $(VENV)/transformers4
# The newest stack pyproject.toml accepts that installs here (constraints/newest.txt: torch 2.12,
# jax 0.10.2, libtpu 0.0.42; no torch_xla, which needs torch 2.9), for NEWEST_STACK_TESTS
VENV_NEWEST  ?= .venv-newest
STAMP_NEWEST := $(VENV_NEWEST)/.installed-$(shell cat pyproject.toml constraints/newest.txt | sha1sum | cut -c1-12)

.PHONY: setup setup-newest train test test-newest test-torch-xla test-fast bench

# The pinned stack (constraints/pinned.txt: the oldest versions the ranges accept), with torch_xla
$(STAMP): pyproject.toml constraints/pinned.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -c constraints/pinned.txt -e '.[test,torch_xla,aot]'
	# the torch_xla extra's 2.9 wheel also carries an older torchax copy (it imports flax);
	# torchax's own files must win, whatever order pip chose
	$(VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall torchax==0.0.13
	touch $@

$(STAMP_NEWEST): pyproject.toml constraints/newest.txt
	rm -rf $(VENV_NEWEST)
	$(PYTHON) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_NEWEST)/bin/python -m pip install --quiet -c constraints/newest.txt -e '.[test,aot]'
	touch $@

# transformers 4.57 (and the hub client and tokenizers it pins) beside the venv's 5.x, for the
# zoo's second run: PYTHONPATH=$(TRANSFORMERS_4) puts it first
$(TRANSFORMERS_4)/.installed-4.57.6: $(STAMP)
	rm -rf $(TRANSFORMERS_4)
	$(VENV)/bin/python -m pip install --quiet --no-deps --target $(TRANSFORMERS_4) transformers==4.57.6 \
		huggingface_hub==0.36.0 tokenizers==0.22.1
	touch $@

setup: $(STAMP) $(TRANSFORMERS_4)/.installed-4.57.6 $(STAMP_NEWEST)

setup-newest: $(STAMP_NEWEST)

train: $(STAMP)  ## the main job: a small GPT-style LM, ZeRO-2, 8 CPU devices unless a TPU is present
	$(VENV)/bin/python examples/train.py --deepspeed_config examples/configs/zero2.json

# Tests that name no backend run on the default, torchax. These files hold such tests of engine
# behaviour (checkpoints, the batch rule, bad input, monitors); `make test` runs them again with
# torch_xla's runtime holding the devices, where an unnamed backend is torch_xla.
ON_TORCH_XLA_TOO := tests/io/test_checkpoint.py tests/io/test_checkpoint_faults.py tests/io/test_checkpoint_safety.py \
                    tests/io/test_checkpoint_sharing.py tests/train/test_batch_rule.py tests/test_hostile_inputs.py \
                    tests/observe/test_monitor.py

# pytest's worker processes (pytest-xdist), each with its own 8 CPU devices, a whole file to a
# worker (a module's compiled engines are built once): two where the devices are CPU devices,
# none (pytest's own process) on a TPU VM, whose chips serve one process. Two workers once
# aborted XLA:CPU when its thread pool was one thread a device; spmdzero now gives it two
# (docs/troubleshooting.md). TEST_WORKERS=0 runs everything in one process. On this project's
# 2-core machine (2026-11-26) the main run took 18:48 in two workers, 33:06 in one.
TEST_WORKERS ?= $(if $(shell grep -lsx 0x1ae0 /sys/bus/pci/devices/*/vendor),0,2)
PYTEST := $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# -k matches folder names too: tests/backends/torchax/ is left out, but for its two files that
# name no backend (flash attention's and activation checkpointing's), as before the folders.
PYTEST_ON_TORCH_XLA := SPMDZERO_BACKEND=torch_xla $(PYTEST) -k "not torchax or test_flash_attention.py or test_remat.py"

# The default backend's engine tests again on the newest stack (.venv-newest), where torch_xla
# is not installed and its tests are skipped, saying so: the engine, checkpoints, `aot` on libtpu
# 0.0.42 (TPU7x included), jax.distributed across two processes, the lowerings and the example
# job. About 6 minutes in two workers here (2026-11-29); the transformers zoo, the Hugging Face
# integrations and the torch_xla comparisons stay on the pinned stack.
NEWEST_STACK_TESTS := tests/io/test_checkpoint.py tests/tpu/test_aot.py tests/tpu/test_aot_decode.py tests/runtime/test_jax_private.py \
                      tests/test_example.py tests/sharding/test_multihost.py tests/runtime/test_runtime.py \
                      tests/tpu/test_tpu_collectives.py tests/tpu/test_hbm_traffic.py tests/backends/torchax/test_static_cache.py \
                      tests/backends/torchax/test_host_placeholders.py tests/backends/torchax/test_seq2seq_generation.py \
                      $(wildcard tests/backends/torchax/test_torchax_*.py)
PYTEST_NEWEST := $(VENV_NEWEST)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The four pytest runs of `make test` share one JAX compilation cache (tests/conftest.py), made
# empty for the run and removed after it (JAX's cache keys hold its version: the two stacks do
# not share entries). The zoo's file has no shared fixtures: with workers, its tests split one
# by one (--dist load).
test: setup  ## the full suite (what CI runs): the layers contract, every test, the zoo and generation on transformers 4.57, ON_TORCH_XLA_TOO on torch_xla, then NEWEST_STACK_TESTS on the newest stack
	$(VENV)/bin/lint-imports
	cache=$$(mktemp -d -t spmdzero-tests-jax-cache-XXXXXX) && trap 'rm -rf "$$cache"' EXIT && \
	export SPMDZERO_TEST_COMPILE_CACHE="$$cache" && \
	$(PYTEST) && \
	PYTHONPATH=$(TRANSFORMERS_4) $(PYTEST) --dist load tests/test_transformers_zoo.py \
		tests/backends/torchax/test_torchax_generation.py tests/backends/torchax/test_seq2seq_generation.py \
		tests/backends/torchax/test_host_placeholders.py && \
	$(PYTEST_ON_TORCH_XLA) $(ON_TORCH_XLA_TOO) && \
	$(PYTEST_NEWEST) $(sort $(NEWEST_STACK_TESTS))

test-newest: setup-newest  ## NEWEST_STACK_TESTS on the newest stack only (about 6 minutes)
	$(PYTEST_NEWEST) $(sort $(NEWEST_STACK_TESTS))

test-torch-xla: setup  ## every test that names no backend, on torch_xla (about 16 minutes; not in CI)
	$(PYTEST_ON_TORCH_XLA)

test-fast: setup  ## the quick subset for iterating
	$(VENV)/bin/lint-imports
	$(PYTEST) -m "not slow"

bench: setup  ## both backends against one jax.jit step (docs/benchmarks.md), then the torch_xla backend's
	$(VENV)/bin/python benchmarks/trace_overhead.py --sizes 12x64 --configs torchax,torch_xla --steps 3 --repeats 3
	$(VENV)/bin/python benchmarks/step_time.py
	$(VENV)/bin/python benchmarks/first_step.py
	$(VENV)/bin/python benchmarks/transformers_zoo.py
	PYTHONPATH=$(TRANSFORMERS_4) $(VENV)/bin/python benchmarks/transformers_zoo.py
