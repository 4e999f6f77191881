# One-command set-up: `make demo` runs the embedded GRPO example, `make test` the suite.
# Both create .venv if missing and install once; the install is redone only when
# pyproject.toml changes (the stamp file records the last install).
# `make test` also builds .venv-xla (the XLA trainer's environment, torch_xla pins its own torch)
# and runs tests/xla in it; where that build fails, it says so and the XLA tests skip.

VENV ?= .venv
PYTHON ?= python3
# Elsewhere, the CPU build of torch comes from PyTorch's own index:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.titanrl-install-stamp
PIP_INDEX := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
# The XLA trainer's venv: pyproject's `xla` extra (torch 2.9, torch_xla 2.9, Ray), no vLLM.
# On a TPU VM: make xla-venv XLA_EXTRA=tpu (adds libtpu).
XLA_VENV ?= .venv-xla
XLA_EXTRA ?= xla
# PyPI's torch 2.9 is the CUDA build (~8 GB venv). A CPU torch from PyTorch's index is far smaller:
#   make xla-venv XLA_TORCH_INDEX=https://download.pytorch.org/whl/cpu   (not reachable here: untested)
XLA_TORCH_INDEX ?=
XLA_STAMP := $(XLA_VENV)/.titanrl-install-stamp
# `make demo DEVICE=xla` trains the example with its trainer on XLA.
DEVICE ?= cpu
# TRL's venv for benchmarks/vs_trl.py (TRL's GRPOTrainer, HF generate): TRL may want other
# transformers versions than vLLM's, so it gets its own. Base titanrl only (no vLLM, no Ray).
# Measured 2026-12-03: torch 2.13.0+cpu, transformers 5.19.0 (as .venv), trl 1.16.0,
# accelerate 1.16.0, datasets 5.2.0; no torchvision came along.
TRL_VENV ?= .venv-trl
TRL_STAMP := $(TRL_VENV)/.titanrl-install-stamp

.PHONY: install system-deps demo reasoning test test-xla xla-venv trl-venv clean-venv

# bubblewrap: the code-execution sandbox (titanrl.envs). Debian's package; needs root.
system-deps:
	@command -v bwrap >/dev/null || apt-get install -y -q bubblewrap \
		|| (apt-get update -q && apt-get install -y -q bubblewrap) \
		|| echo "WARNING: could not install bubblewrap; run: apt-get install -y bubblewrap"

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first, so nothing below can pull a multi-GB CUDA build.
	$(PIP) install -q $(PIP_INDEX) torch==2.13.0
	$(PIP) install -q $(PIP_INDEX) -e '.[cpu,dev]'
	# vLLM's CPU wheel drags in PyPI's torchvision/torchaudio/torchcodec, built against CUDA
	# torch; beside the CPU torch they break `import transformers` (torchvision::nms).
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(VENV)/bin/python -c "import torch, vllm, ray, transformers; print('installed: torch', torch.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
	@touch $(STAMP)

install: system-deps $(STAMP)

$(XLA_STAMP): pyproject.toml
	@test -x $(XLA_VENV)/bin/python || $(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q $(if $(XLA_TORCH_INDEX),--extra-index-url $(XLA_TORCH_INDEX),) -e '.[$(XLA_EXTRA),dev]'
	$(XLA_VENV)/bin/python -c "import torch, torch_xla, ray; print('installed: torch', torch.__version__, '| torch_xla', torch_xla.__version__, '| ray', ray.__version__)"
	@touch $(XLA_STAMP)

xla-venv: $(XLA_STAMP)

$(TRL_STAMP): pyproject.toml
	@test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	# CPU torch first (as for .venv), and pinned again below so the resolver cannot swap it.
	$(TRL_VENV)/bin/python -m pip install -q $(PIP_INDEX) torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install -q $(PIP_INDEX) torch==2.13.0 trl accelerate datasets -e .
	$(TRL_VENV)/bin/python -c "import torch, transformers, trl, accelerate, datasets; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__, '| accelerate', accelerate.__version__, '| datasets', datasets.__version__)"
	@touch $(TRL_STAMP)

trl-venv: $(TRL_STAMP)

demo: install $(if $(filter xla,$(DEVICE)),xla-venv)
	$(VENV)/bin/titanrl train examples/arithmetic/config.py $(if $(filter xla,$(DEVICE)),--train.compute.device=xla)

# GRPO on a real pretrained model: SmolLM2-135M-Instruct (fetched and converted into
# ~/.cache/titanrl/models on first use, as `titanrl models get` does) learns reasoning-gym's
# chain_sum; sized for ~30 minutes on a 2-core CPU (examples/reasoning/README.md).
reasoning: install
	$(VENV)/bin/titanrl train examples/reasoning/config.py

# The XLA venv is built first: main-suite tests that start the XLA trainer actor need it.
test: install
	@$(MAKE) --no-print-directory xla-venv \
		|| echo "SKIPPING XLA: building $(XLA_VENV) failed (output above); its tests skip"
	$(VENV)/bin/python -m pytest -q
	@$(MAKE) --no-print-directory test-xla

test-xla:
	@if ! test -d tests/xla; then echo "SKIPPED tests/xla: there is no such folder"; \
	elif test -f $(XLA_STAMP); then $(XLA_VENV)/bin/python -m pytest -q tests/xla; \
	else echo "SKIPPED tests/xla: $(XLA_VENV) is not built (make xla-venv)"; fi

clean-venv:
	rm -rf $(VENV) $(XLA_VENV) $(TRL_VENV)
