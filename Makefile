# The whole set-up is `make demo` or `make test`; both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

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

bench: install
	$(PY) benchmarks/step_overhead.py
	$(PY) benchmarks/variables.py
	$(PY) benchmarks/input_pipeline.py
	$(PY) benchmarks/tf_loop.py
	$(PY) benchmarks/nnx_step.py
	$(PY) benchmarks/multi_worker.py
	$(PY) benchmarks/cross_device_ops.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
