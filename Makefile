# nftcni: the two set-up commands on a fresh machine are `make demo` and
# `make test` (see README.md). Everything else here is for developers.

GO      ?= go
BIN     := bin
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X main.version=$(VERSION)
export CGO_ENABLED := 0

.PHONY: all build image test chaos unit bench demo lint fuzz clean deps cni-plugins k8s-bins containerd-bins helm istio-bins multus-bins docs manifest

# The reference CNI plugins and cnitool, built from the Go module proxy once
# and cached: the end-to-end tests chain nftcni after them.
CACHE               ?= $(HOME)/.cache/nftcni
CNI_PLUGINS_VERSION := v1.10.0
CNI_VERSION         := v1.3.1
CNI_BIN             := $(CACHE)/cni-plugins-$(CNI_PLUGINS_VERSION)
CNI_PKG             := github.com/containernetworking/plugins/plugins
export NFTCNI_CNI_BIN := $(CNI_BIN)
# etcd and the Kubernetes commands (API server for the integration tests; kubelet,
# controller manager and scheduler for the node tests), built from the
# module proxy once (about 8 minutes cold on 2 cores) by hack/k8s-bins.sh.
K8S_BIN             := $(CACHE)/k8s-v1.37.2
export NFTCNI_K8S_BIN := $(K8S_BIN)
# containerd 2.x for the CRI end-to-end tests (1.6 comes from Debian, see
# hack/deps.sh), built from the module proxy once (about a minute cold).
CONTAINERD2_VERSION := v2.4.2
CONTAINERD2_BIN     := $(CACHE)/containerd-$(CONTAINERD2_VERSION)
export NFTCNI_CONTAINERD2_BIN := $(CONTAINERD2_BIN)
# helm, to lint and render the chart in tests (about 5 minutes cold).
HELM_VERSION := v3.22.0
HELM         := $(CACHE)/helm-$(HELM_VERSION)/helm
export NFTCNI_HELM := $(HELM)
# Istio's own CNI agent and plugin, for the live handover test and the
# side-by-side benchmark (about 3 minutes cold), pinned at the commit the
# anchor figures were measured at.
ISTIO_BIN := $(CACHE)/istio-eed52ebb66ad
export NFTCNI_ISTIO_BIN := $(ISTIO_BIN)
# Multus's thin plugin, for the node test of standalone mode (OpenShift's
# shape), pinned in hack/multus-bins.sh (about a minute cold).
MULTUS_BIN := $(CACHE)/multus-v4.2.2
export NFTCNI_MULTUS_BIN := $(MULTUS_BIN)

all: build

# The plugin is exec'd for every pod sandbox, lives a few milliseconds and
# never collects garbage. Go 1.26's default collector (Green Tea) puts mark
# bits at the end of every fresh span, which costs a fresh process a second
# page fault for each size class it allocates: about 40 of the plugin's 240
# (docs/benchmarks.md). The agent keeps the default. Empty when the
# toolchain no longer knows the experiment.
PLUGIN_GOEXPERIMENT ?= $(shell GOEXPERIMENT=nogreenteagc $(GO) env GOEXPERIMENT 2>/dev/null)

build:
	GOEXPERIMENT=$(PLUGIN_GOEXPERIMENT) $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./plugin/cmd/nftcni
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./agent/cmd/nftcni-agent

# The image as an OCI archive, built offline from the binaries at the
# Dockerfile's paths (hack/mkimage); same commit, same digest.
IMAGE ?= ghcr.io/nftcni/nftcni:$(VERSION)
image: build
	SOURCE_DATE_EPOCH=$$(git log -1 --format=%ct 2>/dev/null || echo 0) $(GO) run ./hack/mkimage -bin $(BIN) -tag $(IMAGE) -out $(BIN)/nftcni-image.oci.tar

# All tests, including the ones that need root and network namespaces (they
# skip with a message when not root). Fuzz seed corpora run as plain tests.
# The live handover from istio-cni runs Istio's own agent and plugin.
# The conformance suite's result line (Istio's rules against nftcni's) is
# printed last.
# The node test installs the image `make image` built, as users would.
# The fault-injection suite runs one round of each scenario here, and its
# table is printed after the conformance line, then the chained-mode
# fighting-primary figures.
test: deps build image cni-plugins k8s-bins containerd-bins helm istio-bins multus-bins
	@rm -f $(BIN)/conformance.txt $(BIN)/chaos.txt $(BIN)/fight.txt
	NFTCNI_REQUIRE_CRI=1 NFTCNI_REQUIRE_ISTIO=1 NFTCNI_CONFORMANCE_REPORT=$(CURDIR)/$(BIN)/conformance.txt \
	NFTCNI_CHAOS_REPORT=$(CURDIR)/$(BIN)/chaos.txt NFTCNI_FIGHT_REPORT=$(CURDIR)/$(BIN)/fight.txt \
	NFTCNI_IMAGE=$(CURDIR)/$(BIN)/nftcni-image.oci.tar NFTCNI_IMAGE_REF=$(IMAGE) \
	  $(GO) test -count=1 -timeout 45m ./...; status=$$?; cat $(BIN)/conformance.txt $(BIN)/chaos.txt $(BIN)/fight.txt 2>/dev/null; exit $$status

# The fault-injection suite alone (root): CHAOS_ROUNDS rounds of every
# scenario (agent SIGKILL/SIGTERM in ADD storms and at injected points,
# ztunnel killed, hung, speaking garbage or slow, DELs while the agent is
# down, duplicate and reordered calls, a full run dir, oversized and
# invalid annotations); every sandbox is checked enrolled in full or in no
# part. The table goes to bin/chaos.txt.
CHAOS_ROUNDS ?= 5
chaos: deps build cni-plugins
	NFTCNI_CHAOS_ROUNDS=$(CHAOS_ROUNDS) NFTCNI_CHAOS_REPORT=$(CURDIR)/$(BIN)/chaos.txt \
	  $(GO) test -count=1 -timeout 30m -run 'TestChaos$$' ./integration/; status=$$?; cat $(BIN)/chaos.txt 2>/dev/null; exit $$status

# Unit tests: every package but the integration tests, without the kernel
# tests (files *_kernel_test.go, built without the tag `unit`: they need
# root and network namespaces). Runs the same as any user, root or not;
# the kernel tests run in `make test`.
unit:
	$(GO) test -tags unit -count=1 $$($(GO) list ./... | grep -v /integration)

# Debian packages the tests use, installed when missing (root only).
deps:
	./hack/deps.sh

helm: $(HELM)
$(HELM):
	GOBIN=$(dir $(HELM)) $(GO) install -trimpath -ldflags '-s -w' helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)

# Generated files, each checked up to date by a test.
docs: manifest
	$(GO) run ./agent/cmd/nftcni-agent reference > docs/config-reference.md
manifest: helm
	$(HELM) template nftcni deploy/charts/nftcni --namespace kube-system --kube-version 1.37.2 > deploy/nftcni.yaml

multus-bins: $(MULTUS_BIN)/multus
$(MULTUS_BIN)/multus:
	./hack/multus-bins.sh $(MULTUS_BIN)

istio-bins: $(ISTIO_BIN)/install-cni
$(ISTIO_BIN)/install-cni:
	./hack/istio-bins.sh $(ISTIO_BIN)

containerd-bins: $(CONTAINERD2_BIN)/.complete
$(CONTAINERD2_BIN)/.complete:
	GOBIN=$(CONTAINERD2_BIN) $(GO) install -trimpath -ldflags '-s -w' -tags 'no_btrfs no_devmapper no_zfs no_aufs' \
	  github.com/containerd/containerd/v2/cmd/containerd@$(CONTAINERD2_VERSION) \
	  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$(CONTAINERD2_VERSION) \
	  github.com/containerd/containerd/v2/cmd/ctr@$(CONTAINERD2_VERSION)
	touch $@

# The stamp names the last command built, so a cache holding only the API
# server (older checkouts) gains the node's commands.
k8s-bins: $(K8S_BIN)/kube-scheduler
$(K8S_BIN)/kube-scheduler:
	./hack/k8s-bins.sh $(K8S_BIN)

cni-plugins: $(CNI_BIN)/.complete
$(CNI_BIN)/.complete:
	GOBIN=$(CNI_BIN) $(GO) install -trimpath -ldflags '-s -w' \
	  $(CNI_PKG)/main/bridge@$(CNI_PLUGINS_VERSION) $(CNI_PKG)/main/loopback@$(CNI_PLUGINS_VERSION) \
	  $(CNI_PKG)/main/ptp@$(CNI_PLUGINS_VERSION) $(CNI_PKG)/ipam/host-local@$(CNI_PLUGINS_VERSION) \
	  $(CNI_PKG)/meta/portmap@$(CNI_PLUGINS_VERSION) $(CNI_PKG)/meta/tuning@$(CNI_PLUGINS_VERSION)
	GOBIN=$(CNI_BIN) $(GO) install -trimpath -ldflags '-s -w' github.com/containernetworking/cni/cnitool@$(CNI_VERSION)
	touch $@

bench: deps build image cni-plugins k8s-bins containerd-bins helm istio-bins
	NFTCNI_IMAGE=$(CURDIR)/$(BIN)/nftcni-image.oci.tar NFTCNI_IMAGE_REF=$(IMAGE) ./hack/bench.sh

demo: deps build cni-plugins
	./hack/demo.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

# Longer fuzzing than `make test` does; FUZZTIME=10m for a soak.
FUZZTIME ?= 60s
fuzz:
	$(GO) test ./conflist -run '^$$' -fuzz FuzzInsert -fuzztime $(FUZZTIME)
	$(GO) test ./plugin/wire -run '^$$' -fuzz FuzzDecode -fuzztime $(FUZZTIME)
	$(GO) test ./plugin/wire -run '^$$' -fuzz FuzzDecodeAgreesWithEncodingJSON -fuzztime $(FUZZTIME)
	$(GO) test ./plugin -run '^$$' -fuzz FuzzParseConfig -fuzztime $(FUZZTIME)
	$(GO) test ./agent/zds -run '^$$' -fuzz FuzzDecode -fuzztime $(FUZZTIME)

clean:
	rm -rf $(BIN)
