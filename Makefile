# The two commands of the README:
#   make run-sim   run the sidecar on a simulated GPU node (state under ./.run/)
#   make test      lint, type-check and run every test (Python and Go; Go linted by golangci-lint)
# The inner loop: make check (lint, type-check, unit and component tests; no e2e, no Go).
# Both work from a fresh clone: they create .venv (Python 3.11) and install what they need.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
GO     ?= go
GOBIN  := $(shell $(GO) env GOPATH 2>/dev/null)/bin
GO_MODULES := api $(wildcard integration/goclient) $(wildcard integration/cdischema) $(wildcard integration/manifests) $(wildcard integration/drivercdi)

RUN_DIR  := $(CURDIR)/.run
SIM_GPUS ?= h100-80gb:2,a100-40gb:1

# Tests run in PYTEST_WORKERS processes (pytest-xdist), two per CPU by default: an end-to-end test
# spends much of its time waiting on its sidecar process (start, kill -9, restart, a poll for a
# record), so one worker per CPU leaves the CPUs idle. On 2 cores the whole pytest run took 3 min 40 s
# with 2 workers, 2 min 19 s with 4 and 2 min 37 s with 6. Each test already has its own sidecar
# process, directories and, for metrics, a port the kernel picks; the Go tests share one build of the
# Go binaries and so run in one worker (their xdist_group). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) * 2 )))
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup

.PHONY: run-sim test check venv lint typecheck pytest go-plugins kube-binaries go-test proto image image-dra clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

# With Go, run-sim builds hami-mig-driver-cdi too, so the simulated node's driver (a fake driver root
# beside the state file) gets its CDI device like a real node's; without Go the sidecar runs without it.
DRIVER_CDI := $(if $(shell command -v $(GO) 2>/dev/null),$(RUN_DIR)/bin/hami-mig-driver-cdi)

run-sim: venv $(DRIVER_CDI)
	mkdir -p $(RUN_DIR)
	$(BIN)/hami-mig-sidecar serve --backend simulated \
	  --sim-state $(RUN_DIR)/hw.json --sim-gpus $(SIM_GPUS) \
	  --state-dir $(RUN_DIR)/state --cdi-dir $(RUN_DIR)/cdi \
	  --driver-cdi-command "$(DRIVER_CDI)" \
	  --socket $(RUN_DIR)/sidecar.sock --metrics-address 127.0.0.1:9408

$(RUN_DIR)/bin/hami-mig-driver-cdi: integration/drivercdi/go.mod integration/drivercdi/go.sum $(wildcard integration/drivercdi/*.go integration/drivercdi/cmd/*/*.go)
	cd integration/drivercdi && CGO_ENABLED=1 CGO_CFLAGS="-O2 -Wno-deprecated-declarations" $(GO) build -o $@ ./cmd/hami-mig-driver-cdi

test: lint typecheck go-plugins go-test pytest

check: lint typecheck
	$(BIN)/pytest -q $(PYTEST_PARALLEL) tests/unit tests/component tests/nvml

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# sidecar/, tests/ and bench/, as the files of [tool.mypy] in pyproject.toml name them.
typecheck: venv
	$(BIN)/mypy

# pytest exits 5 when it collects nothing (with workers too); make treats that as the failure it is.
pytest: venv
	$(BIN)/pytest -q $(PYTEST_PARALLEL)

go-plugins:
	@while read -r plugin; do \
	  case "$$plugin" in ""|\#*) continue ;; esac; \
	  path=$${plugin%@*}; version=$${plugin##*@}; name=$$(basename "$$path"); \
	  case "$$name" in v[0-9]*) name=$$(basename "$$(dirname "$$path")") ;; esac; \
	  if [ -x "$(GOBIN)/$$name" ] && $(GO) version -m "$(GOBIN)/$$name" 2>/dev/null | grep -q "[[:space:]]$$version\([[:space:]]\|$$\)"; then continue; fi; \
	  echo "go install $$plugin"; $(GO) install "$$plugin" || exit 1; \
	done < scripts/go-plugins.txt

# The pinned kube-apiserver, etcd and kube-scheduler the Go tests against a real API server start
# (integration/goclient/internal/kubeapi), built from the module proxy by the wrapper modules in
# scripts/kube-binaries/ into GOBIN beside the Go plugins, and rebuilt only when the pinned version in
# a wrapper's go.mod differs from the one `go version -m` reads in the binary. A cold build on 2 cores
# takes about 10 minutes, 1.9 GB of memory and 1.5 GB of module and build cache; it runs under nice.
# kube-scheduler comes from the same k8s.io/kubernetes module: alone from an empty build cache it costs
# 510 s of CPU (426 user, 82 system; 7m50s on 2 loaded cores, 1.4 GB of memory, 1.6 GB of build
# cache), after the API server's build 49 s of CPU, since most of its packages are the server's.
# The wrapper modules stay out of GO_MODULES: vetting them would compile Kubernetes on every make test.
KUBE_BINARIES := etcd=go.etcd.io/etcd/server/v3 kube-apiserver=k8s.io/kubernetes kube-scheduler=k8s.io/kubernetes
pinned = $(shell awk '{ sub(/^require /, "") } $$1 == "$(2)" && $$2 ~ /^v/ { print $$2; exit }' scripts/kube-binaries/$(1)/go.mod)
KUBE_VERSION := $(patsubst v%,%,$(call pinned,kube-apiserver,k8s.io/kubernetes))
KUBE_LDFLAGS := -s -w $(foreach var,gitVersion=v$(KUBE_VERSION) gitMajor=$(word 1,$(subst ., ,$(KUBE_VERSION))) gitMinor=$(word 2,$(subst ., ,$(KUBE_VERSION))) gitTreeState=clean,-X k8s.io/component-base/version.$(var))
kube-binaries:
	@$(foreach binary,$(KUBE_BINARIES),$(call kube-binary,$(word 1,$(subst =, ,$(binary))),$(word 2,$(subst =, ,$(binary))))) true

# $(call kube-binary,NAME,PINNED-MODULE): build scripts/kube-binaries/NAME unless GOBIN holds it at the pin.
kube-binary = version=$(call pinned,$(1),$(2)); \
  if ! { [ -x "$(GOBIN)/$(1)" ] && $(GO) version -m "$(GOBIN)/$(1)" 2>/dev/null | grep -q "dep[[:space:]]*$(2)[[:space:]]*$$version\([[:space:]]\|$$\)"; }; then \
    echo "go build $(1) ($(2) $$version) into $(GOBIN)"; \
    (cd scripts/kube-binaries/$(1) && nice $(GO) build -ldflags "$(KUBE_LDFLAGS)" -o "$(GOBIN)/$(1)" .) || exit 1; \
  fi;

# golangci-lint (pinned in scripts/go-plugins.txt, configured by .golangci.yml) before the tests.
go-test: go-plugins
	@[ -x "$(GOBIN)/kube-apiserver" ] && [ -x "$(GOBIN)/etcd" ] && [ -x "$(GOBIN)/kube-scheduler" ] || echo "go-test: kube-apiserver, kube-scheduler or etcd is not built, so the tests against a real API server skip; \`make kube-binaries\` builds them (about 11 minutes, 1.9 GB of memory and 1.6 GB of disk, once)"
	@for module in $(GO_MODULES); do \
	  echo "go vet + golangci-lint + go test in $$module"; \
	  (cd $$module && $(GO) vet ./... && $(GOBIN)/golangci-lint run ./... && $(GO) test ./...) || exit 1; \
	done

proto: venv go-plugins
	PYTHON=$(BIN)/python scripts/gen-proto

# The sidecar's image with podman, else docker (CONTAINER_TOOL=docker to choose); IMAGE names the tag.
CONTAINER_TOOL ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
IMAGE ?= hami-mig-sidecar:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image:
	$(CONTAINER_TOOL) build -t $(IMAGE) -f Containerfile .

# The DRA kubelet plugin's image (deploy/dra/daemonset.yaml's dra-plugin container), of the same version.
DRA_IMAGE ?= hami-mig-dra:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image-dra:
	$(CONTAINER_TOOL) build --target dra -t $(DRA_IMAGE) -f Containerfile .

clean:
	rm -rf $(RUN_DIR) .pytest_cache .mypy_cache .ruff_cache
