# Set-up and the two quick-start targets. Everything installs into .venv (python3.11 here).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, the tested version (this machine's package index serves its CPU wheel; elsewhere add
# --index-url https://download.pytorch.org/whl/cpu, or pip brings a multi-GB CUDA build); then zckpt with every
# extra the suite needs (torch, s3, hub, test). zckpt itself needs none of them: pip install zckpt is the small core
# (make setup TORCH_INDEX='--index-url https://download.pytorch.org/whl/cpu')
TORCH_INDEX ?=
$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0 $(TORCH_INDEX)
	@# PYTHONWARNINGS: without it setuptools prints a notice box about editable installs
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -q -e '.[torch,s3,hub,test]'
	@# torchtitan for tests/test_convert_torchtitan.py and test_fsdp2_api.py: --no-deps keeps torch 2.13.0; the four
	@# small pure-Python packages its import needs (typing_extensions comes with torch)
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
		spmd-types==0.3.1
	touch $@

setup: $(VENV)/.installed

# The main job on the shipped ZeRO-2 bf16 Trainer checkpoint: inspect, verify, merge to safetensors.
demo: setup
	$(BIN)/zckpt info fixtures/trainer/checkpoint-4
	$(BIN)/zckpt verify fixtures/trainer/checkpoint-4
	$(BIN)/zckpt merge fixtures/trainer/checkpoint-4 --to safetensors -o out/demo-model --overwrite
	@HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error $(BIN)/python -c "from transformers import AutoModelForCausalLM; \
	m = AutoModelForCausalLM.from_pretrained('out/demo-model'); \
	print(f'out/demo-model loads: {type(m).__name__}, {sum(p.numel() for p in m.parameters()):,} parameters')" \
	2>/dev/null
	@echo "Load it in Python: AutoModelForCausalLM.from_pretrained('out/demo-model')"

# the suite builds DeepSpeed's CPU ops into its own folder: one built by another venv cannot break it
test: setup
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(CURDIR)/.cache/torch_extensions $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 tests

bench: setup
	DS_ACCELERATOR=cpu $(BIN)/python benchmarks/bench_merge.py

clean:
	rm -rf $(VENV) out .bench
