# redisdlm — build, run, test, bench.
SHELL := /bin/bash
XCADDY  := go run github.com/caddyserver/xcaddy/cmd/xcaddy@v0.4.5
CADDY_VERSION := v2.11.9
MODULE  := github.com/caddy-dlm/redisdlm
PSEUDO  := v0.0.0-00010101000000-000000000000
SOURCES := $(shell find . \( -path ./bench -o -path ./examples -o -path ./tools -o -path ./bin \) -prune -o \( -name '*.go' ! -name '*_test.go' -o -name '*.lua' \) -print) go.mod go.sum

.PHONY: all caddy upstream run stop test test-bench bench redis-server prometheus fuzz soak

all: caddy

# Caddy with this plugin, rebuilt only when the plugin's sources change.
caddy: bin/caddy
bin/caddy: $(SOURCES)
	@mkdir -p bin
	$(XCADDY) build $(CADDY_VERSION) --with $(MODULE)@$(PSEUDO)=. --output bin/caddy

# The demo upstream of examples/ (standard library only).
upstream: bin/upstream
bin/upstream: $(wildcard examples/upstream/*.go)
	@mkdir -p bin
	go build -o bin/upstream ./examples/upstream

# The redis_lock demo: Redis on 127.0.0.1:6379 (started under .run/ unless
# one answers there), the demo upstream on 127.0.0.1:9080, and Caddy with
# examples/Caddyfile on :8080. Prints curl lines to try; Ctrl-C stops all
# it started. `make stop` stops what an interrupted run left behind.
run: bin/caddy bin/upstream
	@tools/demo.sh run

stop:
	@tools/demo.sh stop

# Install redis-server from Debian packages when it is missing.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (apt-get)"; \
		(apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null

# Install prometheus (Debian's package) when it is missing: a test runs the
# Grafana dashboard's queries on a real Prometheus (and fails without it).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
		echo "installing prometheus (apt-get)"; \
		(apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	@command -v prometheus >/dev/null

# The plugin's tests (real redis-servers, about 1–2 minutes on 2 cores), then the
# benchmark modules' vet and tests, then a 30 s soak (and its quiet spell) (docs/testing.md)
# with a fixed seed, so that CI replays a known fault schedule; `make soak`
# draws a new seed each time.
TEST_SOAK_SEED ?= 300568143
test: redis-server prometheus
	go vet ./...
	@tools/test-race.sh
	@$(MAKE) --no-print-directory test-bench
	@$(MAKE) --no-print-directory soak SOAK=30s SEED=$(TEST_SOAK_SEED)

# The benchmark modules have a go.mod of their own (their dependencies stay
# out of users' builds), so `go test ./...` at the root skips them.
BENCH_MODULES := bench bench/benchmutex bench/benchfloor
test-bench:
	@set -e; for m in $(BENCH_MODULES); do \
		echo "cd $$m && go vet ./... && go test -count=1 ./..."; \
		(cd $$m && go vet ./... && go test -count=1 ./...); \
	done

# Every fuzz target for FUZZTIME each (default 30s), printing the inputs
# tried; the seed corpora under testdata/fuzz/ are replayed by plain go test.
FUZZTIME ?= 30s
fuzz:
	@FUZZTIME=$(FUZZTIME) tools/fuzz.sh

# The soak (docs/testing.md): 4 Caddy processes, a single Redis and a
# 3-server Redlock behind TCP fault proxies, random faults drawn from a seed,
# an independent checker; exits 1 when a promise was broken. SOAK is the
# length of the fault phase (about 80 s more in all: a quiet spell of 71 s ends it); SEED=<n> replays a
# run's fault schedule; SOAK_FLAGS passes more flags (see -help).
SOAK ?= 5m
SEED ?= 0
SOAK_FLAGS ?=
soak: caddy redis-server
	cd bench && go run ./cmd/soak -caddy ../bin/caddy -duration $(SOAK) -seed $(SEED) $(SOAK_FLAGS)

# The hot-key ceiling and the cost goals' floor handlers for `make bench`:
# stock Caddy plus bench/benchmutex (a process-wide sync.Mutex handler) and
# bench/benchfloor (the least a Redis lock and a Redis rate limit can do per
# request), benchmarking only, rebuilt only when they change.
CEILING_SOURCES := $(wildcard bench/benchmutex/*.go bench/benchfloor/*.go) bench/benchmutex/go.mod bench/benchmutex/go.sum bench/benchfloor/go.mod bench/benchfloor/go.sum
bin/caddy-ceiling: $(CEILING_SOURCES)
	@mkdir -p bin
	$(XCADDY) build $(CADDY_VERSION) --with $(MODULE)/bench/benchmutex@$(PSEUDO)=./bench/benchmutex --with $(MODULE)/bench/benchfloor@$(PSEUDO)=./bench/benchfloor --output bin/caddy-ceiling

# Benchmark, its own Go module: starts redis-servers, an upstream and
# Caddy processes on loopback ports, prints a Markdown table, stops them all.
# The library-level Redlock figure first, so that the bench's last table,
# "Cost goals (same-run ratios)", ends the output.
bench: caddy bin/caddy-ceiling redis-server
	@tools/bench-redlock.sh
	cd bench && go run ./cmd/bench -caddy ../bin/caddy -caddy-ceiling ../bin/caddy-ceiling
