# colo: the two commands of the quick start (`make demo`, `make test`) and a few helpers.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/colo/installed.stamp
PYPROJECTS := pyproject.toml $(wildcard packages/*/pyproject.toml) scripts/setup_env.sh

# Triton kernels run in Triton's interpreter when there is no CUDA device; it must be set before triton is imported.
TRITON_ENV = TRITON_INTERPRET=$$($(PY) -c "import torch; print(0 if torch.cuda.is_available() else 1)")

# The oldest torch colo supports (every package's `torch>=`), tested by `make test-floor` in a venv of its own.
FLOOR_TORCH ?= 2.11.0
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/colo/installed.stamp
# On the floor torch: the tests of what differs between torch releases (process groups, checkpoints, launch, the
# kernels' operator registration and Triton 3.6, torch.compile, MoE grouped_mm, selective checkpointing, ZeRO,
# Gemini, pipelines) and the trainer end to end; the whole suite twice would not fit CI's time.
FLOOR_TESTS := packages/colo-comm/tests packages/colo-kernels/tests packages/colo-tensor/tests \
	packages/colo-zero/tests packages/colo-gemini/tests packages/colo-pipeline/tests \
	packages/colo-apps/tests/test_cli_commands.py packages/colo-apps/tests/test_train_resume.py \
	packages/colo-apps/tests/test_compile_kernels.py packages/colo-apps/tests/test_activation_checkpointing.py \
	packages/colo-apps/tests/test_moe_trainer.py packages/colo-apps/tests/test_moe_booster.py \
	packages/colo-apps/tests/test_booster_hybrid.py packages/colo-apps/tests/test_plan_memory.py

.PHONY: setup test test-floor demo lint format bench check-packages clean

setup: $(STAMP)

$(STAMP): $(PYPROJECTS)
	VENV=$(VENV) scripts/setup_env.sh
	@touch $(STAMP)

$(FLOOR_STAMP): $(PYPROJECTS)
	VENV=$(FLOOR_VENV) TORCH_PIN=$(FLOOR_TORCH) scripts/setup_env.sh
	@touch $(FLOOR_STAMP)

test: setup
	$(TRITON_ENV) OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=25

# The tests above on torch $(FLOOR_TORCH) (PyPI's CUDA build, which runs on the CPU too; about 4.6 GB in $(FLOOR_VENV)).
test-floor: $(FLOOR_STAMP)
	TRITON_INTERPRET=$$($(FLOOR_PY) -c "import torch; print(0 if torch.cuda.is_available() else 1)") OMP_NUM_THREADS=1 \
		$(FLOOR_PY) -m pytest -q --durations=10 $(FLOOR_TESTS)

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
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache .ruff_cache .hypothesis
