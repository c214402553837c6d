# redisdlm — build, run, test, bench.
SHELL := /bin/bash
XCADDY  := go run github.com/caddyserver/xcaddy/cmd/xcaddy@v0.4.5
CADDY_VERSION := v2.11.9
MODULE  := github.com/caddy-dlm/redisdlm
PSEUDO  := v0.0.0-00010101000000-000000000000
SOURCES := $(wildcard *.go) $(wildcard scripts/*.lua) go.mod go.sum

.PHONY: all caddy run test bench redis-server

all: caddy

# Caddy with this plugin, rebuilt only when the plugin's sources change.
caddy: bin/caddy
bin/caddy: $(SOURCES)
	@mkdir -p bin
	$(XCADDY) build $(CADDY_VERSION) --with $(MODULE)@$(PSEUDO)=. --output bin/caddy

# Install redis-server from Debian packages when it is missing.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (apt-get)"; \
		(apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null

test: redis-server
	go vet ./...
	go test -race -count=1 ./...
