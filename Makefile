# hybrid — `make help` lists the targets.
PY ?= python3
STAMP := build/.installed
HW ?= cpu_only
TUNE_ARGS ?=
PORT ?= 5000
N ?= 2
GATEWAY ?= sglang
POLICY ?= cache_aware
ARGS ?=
PYVER ?= 3.12
WHEELHOUSE ?= wheelhouse
# Packages the target machine already has, left out of the wheelhouse: SKIP="numpy pandas pyarrow scipy ..."
SKIP ?=

.DEFAULT_GOAL := help
.PHONY: help setup run test test-all tune ui replicas wheelhouse clean

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

tune: $(STAMP) ## tune the policy on this machine: make tune HW=cpu_only TUNE_ARGS="model=tiny tuner.n_trials=6"
	$(PY) -m tuner +hw=$(HW) $(TUNE_ARGS)

ui: $(STAMP) ## the MLflow UI of runs/ on http://127.0.0.1:5000 (PORT=...); Ctrl-C stops it and its workers
	$(PY) -m hybrid.tracking ui --port $(PORT)

replicas: $(STAMP) ## N servers behind a gateway: make replicas N=2 GATEWAY=sglang|vllm|none POLICY=cache_aware ARGS="model=..."
	$(PY) -m hybrid mode=replicas replicas.count=$(N) replicas.gateway=$(GATEWAY) replicas.policy=$(POLICY) $(ARGS)

wheelhouse: ## wheels of every dependency but torch and triton (a GPU machine's torch brings its own), for an offline machine: make wheelhouse PYVER=3.12 [SKIP="numpy ..."]
	@mkdir -p $(WHEELHOUSE)
	$(PY) -m pip wheel -q --no-deps --no-binary=:all: antlr4-python3-runtime==4.9.3 -w $(WHEELHOUSE)
	$(PY) -m pip download -q --only-binary=:all: --python-version $(PYVER) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
	  --find-links $(WHEELHOUSE) -d $(WHEELHOUSE) $$($(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	  print(' '.join(d for d in p['dependencies'] + p['optional-dependencies']['test'] if not d.startswith(('torch', 'triton'))))")
	@for s in $(SKIP); do rm -f $(WHEELHOUSE)/$$(echo $$s | tr - _)-[0-9]*.whl $(WHEELHOUSE)/$$s-[0-9]*.whl; done
	@du -sh $(WHEELHOUSE); echo "install there: python3 -m pip install --no-index --find-links $(WHEELHOUSE) --no-deps $(WHEELHOUSE)/*.whl"

clean: ## remove build outputs (keeps runs/)
	rm -rf build hybrid/_native*.so
