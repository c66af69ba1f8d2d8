# hybrid — `make help` lists the targets.
PY ?= python3
STAMP := build/.installed

.DEFAULT_GOAL := help
.PHONY: help setup run test test-all clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml CMakeLists.txt $(wildcard hybrid/csrc/*)
	$(PY) -m pip install -q torch==2.13.0 "scikit-build-core>=0.10" "pybind11>=2.12"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	@mkdir -p build && touch $@

setup: $(STAMP) ## install hybrid and its dependencies (editable; compiles the native module)

run: $(STAMP) ## generate from the embedded default model (a tiny checkpoint generated on first use)
	$(PY) -m hybrid

test: $(STAMP) ## the default test suite (everything but `slow`)
	$(PY) -m pytest -m "not slow" -q

test-all: $(STAMP) ## every test, slow ones included
	$(PY) -m pytest -q

clean: ## remove build outputs (keeps runs/)
	rm -rf build hybrid/_native*.so
