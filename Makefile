# The whole set-up is `make demo` or `make test`; both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-gpu docs docs-check bench bench-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest -q tests

# The GPU test set (tests_gpu/) on the machine's GPUs, against plain JAX on the first one; every
# test is skipped, with a message, where JAX finds no GPU (install '.[cuda13]' or '.[cuda12]').
# JAXMIRROR_GPU_SET_PLATFORM=cpu runs it on simulated CPU devices instead.
# On a GPU image whose Python has JAX already (and no network), `make test-gpu PY=python3`
# uses that Python as it is: nothing is installed.
ifeq ($(PY),$(VENV)/bin/python)
GPU_DEPS := install
endif

test-gpu: $(GPU_DEPS)
	$(PY) -m pytest -q tests_gpu

# Every benchmark's smallest run on one GPU (benchmarks/README.md), its checks at the GPU's
# tolerances; `make bench-gpu PY=python3` as above (the scripts import this checkout). TensorFlow's
# comparison is left out.
bench-gpu: $(GPU_DEPS)
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/tf_loop.py --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/fused_steps.py --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/nnx_step.py --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/step_overhead.py --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/variables.py --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/leaf_overhead.py --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/input_pipeline.py --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/cross_device_ops.py --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/deleted_array_guard.py --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/memory.py --devices 1 --steps 2
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/variable_bookkeeping.py --devices 1 --counts 10,100 --rounds 3
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/fused_failure_wait.py gpu --devices 1 --quick
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/multi_worker.py --devices 1 --models small --rounds 1 --steps 5
	JAX_PLATFORMS=cuda PYTHONPATH=$(CURDIR) $(PY) benchmarks/parameter_server.py --devices 1 --quick

# The documentation (docs/: Markdown pages, the API reference from the docstrings), built
# offline into build/docs/index.html; any Sphinx warning fails it.
docs: install
	$(PY) -m sphinx -W --keep-going -b html docs build/docs

# The built pages in a headless browser: nothing sticks out on the right, every #anchor resolves.
# Needs Chromium on the machine (apt-get install chromium); not part of `make test` or CI.
DOCS_CHECK_STAMP := $(VENV)/.installed-docs-check

$(DOCS_CHECK_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,docs-check]'
	touch $(DOCS_CHECK_STAMP)

docs-check: docs $(DOCS_CHECK_STAMP)
	$(PY) docs/check_pages.py build/docs

# TensorFlow and Keras (the `bench` extra) only for benchmarks/vs_tensorflow.py,
# vs_tf_multi_worker.py and vs_keras.py; tests never need them.
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

# Every benchmark, in under 15 minutes on a 2-core machine (each script's defaults run longer;
# benchmarks/README.md says how long and what they add).
bench: install $(BENCH_STAMP)
	$(PY) benchmarks/tf_loop.py
	$(PY) benchmarks/tf_loop.py --model wide --rounds 4
	$(PY) benchmarks/fused_steps.py
	$(PY) benchmarks/vs_tensorflow.py
	$(PY) benchmarks/vs_keras.py
	$(PY) benchmarks/leaf_overhead.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/multi_worker.py
	$(PY) benchmarks/vs_tf_multi_worker.py --rounds 2
	$(PY) benchmarks/step_overhead.py --quick
	$(PY) benchmarks/variables.py --quick
	$(PY) benchmarks/input_pipeline.py --quick
	$(PY) benchmarks/nnx_step.py --quick
	$(PY) benchmarks/cross_device_ops.py --quick
	$(PY) benchmarks/parameter_server.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
