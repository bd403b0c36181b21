# nftcni: the two set-up commands on a fresh machine are `make demo` and
# `make test` (see README.md). Everything else here is for developers.

GO      ?= go
BIN     := bin
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X main.version=$(VERSION)
export CGO_ENABLED := 0

.PHONY: all build test unit bench demo lint fuzz clean

all: build

build:
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./plugin/cmd/nftcni ./agent/cmd/nftcni-agent

# All tests, including the ones that need root and network namespaces (they
# skip with a message when not root). Fuzz seed corpora run as plain tests.
test: build
	$(GO) test -count=1 ./...

bench: build
	./hack/bench.sh

demo: build
	./hack/demo.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

# Longer fuzzing than `make test` does; FUZZTIME=10m for a soak.
FUZZTIME ?= 60s
fuzz:
	$(GO) test ./conflist -run '^$$' -fuzz FuzzInsert -fuzztime $(FUZZTIME)

clean:
	rm -rf $(BIN)
