# colo: the two commands of the quick start (`make demo`, `make test`) and a few helpers.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/colo/installed.stamp
PYPROJECTS := pyproject.toml $(wildcard packages/*/pyproject.toml) scripts/setup_env.sh

# Triton kernels run in Triton's interpreter when there is no CUDA device; it must be set before triton is imported.
TRITON_ENV = TRITON_INTERPRET=$$($(PY) -c "import torch; print(0 if torch.cuda.is_available() else 1)")

.PHONY: setup test demo lint format bench check-packages clean

setup: $(STAMP)

$(STAMP): $(PYPROJECTS)
	VENV=$(VENV) scripts/setup_env.sh
	@touch $(STAMP)

test: setup
	$(TRITON_ENV) OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=25

# Trains the tiny Llama on 2 local processes (GPUs when present, else CPU with OMP_NUM_THREADS=1 per rank).
demo: setup
	$(TRITON_ENV) env $$($(PY) -c "import torch; print('' if torch.cuda.is_available() else 'OMP_NUM_THREADS=1')") \
		$(VENV)/bin/colo launch --nproc-per-node 2 -- train --preset tiny-llama

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: setup
	$(PY) benchmarks/comm_overhead.py

check-packages: setup
	$(PY) scripts/check_packages.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
