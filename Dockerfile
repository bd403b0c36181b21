# The nftcni image: the agent and the plugin it installs, nothing else —
# no shell, no iptables, no nft (the product programs nftables through
# netlink). Build: docker build -t ghcr.io/nftcni/nftcni:$(git describe) .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
# The plugin without the Green Tea collector's per-span mark bits, as the
# Makefile builds it (see PLUGIN_GOEXPERIMENT there).
RUN CGO_ENABLED=0 GOEXPERIMENT=nogreenteagc go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" \
      -o /out/ ./plugin/cmd/nftcni && \
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" \
      -o /out/ ./agent/cmd/nftcni-agent

FROM scratch
COPY --from=build /out/nftcni /out/nftcni-agent /opt/nftcni/bin/
# The agent copies /opt/nftcni/bin/nftcni into the host's CNI bin dir
# (PLUGIN_BINARY in the chart).
ENTRYPOINT ["/opt/nftcni/bin/nftcni-agent"]
CMD ["run"]
