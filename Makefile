# Two entry points on a fresh clone; both create and fill .venv themselves.
#   make demo   run the main job on the embedded CPU default
#   make test   run the test suite (what CI runs through .ci/run)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The CPU build of torch; naming it in the same pip command keeps pip from pulling a CUDA build.
TORCH_SPEC ?= torch==2.13.0
# One thread per process: with 2 cores, torch's default threads contend and slow tests 10-1000x.
export OMP_NUM_THREADS ?= 1
PYTEST_ARGS ?=

.PHONY: demo test venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" -e '.[train,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/vime demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.schedule

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
