# The two commands: `make demo` runs the mesh and shows it answering; `make test` runs the tests.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast test-multinode up protos lint bench clean image compose-test

setup:
	@scripts/setup.sh

demo: setup
	$(BIN)/kvmesh demo

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup  ## unit tests only
	$(BIN)/python -m pytest -q tests/unit

test-multinode: setup  ## nodes in network namespaces on this machine (root; skipped otherwise)
	$(BIN)/python -m pytest -q -s tests/integration/test_netns.py tests/e2e/test_multinode.py tests/e2e/test_multinode_pd.py

up: setup
	$(BIN)/kvmesh up

protos: setup
	$(BIN)/python -m kvmesh.protogen

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

bench: setup
	$(BIN)/python benchmarks/router_overhead.py

image:  ## the kvmesh:cpu image (podman, else docker; bootstraps a Debian base if no registry answers)
	scripts/image.sh

compose-test: setup  ## build the image, run docker/docker-compose.yml with podman-compose, check it (minutes)
	PYTHON=$(BIN)/python scripts/compose-test.sh

clean:
	rm -rf .models .pytest_cache
