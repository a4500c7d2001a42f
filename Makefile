# The README's two commands: `make test` and `make demo`. Both set up everything they need on a fresh
# machine: Debian packages (ZooKeeper, PostgreSQL, Java), a virtual environment and the Python packages.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS ?= dev,spark
PYTEST_ARGS ?=
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: test demo deps system-deps lint typecheck unit clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

system-deps:
	bash scripts/install-system-deps.sh

deps: system-deps $(STAMP)

lint: deps
	$(BIN)/ruff check src tests bench demo
	$(BIN)/ruff format --check src tests bench demo

typecheck: deps
	$(BIN)/mypy

unit: deps
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

test: deps lint typecheck
	$(BIN)/pytest $(PYTEST_ARGS)

demo: deps
	$(BIN)/python -m demo.run

# The black-box fault suite (docs/faults.md): FAULT_SEEDS seeds from FAULT_FIRST, about 80-150 s each.
FAULT_SEEDS ?= 3
FAULT_FIRST ?= 0
FAULT_ARGS ?=
.PHONY: faults
faults: deps
	$(BIN)/python -m bench.faults --seeds $(FAULT_SEEDS) --first $(FAULT_FIRST) $(FAULT_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
