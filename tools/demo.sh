#!/usr/bin/env bash
# The demo behind `make run` and `make stop`: redis_lock on :8080 and
# redis_ratelimit on :8081 (examples/Caddyfile, which imports
# examples/ratelimit.Caddyfile).
#
#   tools/demo.sh run    start Redis (unless one answers on 127.0.0.1:6379),
#                        the demo upstream and Caddy with $CADDYFILE (default
#                        examples/Caddyfile); print curl lines to try; stop it
#                        all on Ctrl-C
#   tools/demo.sh stop   stop what an earlier `run` left behind
#
# Expects bin/caddy and bin/upstream (the Makefile builds them). Everything it
# starts is recorded in .run/*.pid; a Redis it did not start is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

RUN_DIR=$ROOT/.run
CADDY=${CADDY:-$ROOT/bin/caddy}
UPSTREAM=${UPSTREAM:-$ROOT/bin/upstream}
CADDYFILE=${CADDYFILE:-examples/Caddyfile}
REDIS_HOST=127.0.0.1
REDIS_PORT=6379
UPSTREAM_ADDR=127.0.0.1:9080
HTTP_PORT=8080   # as in examples/Caddyfile
RL_PORT=8081     # as in examples/ratelimit.Caddyfile
ADMIN_PORT=2019  # Caddy's default admin endpoint

say() { printf '%s\n' "$*"; }
die() { printf 'demo: %s\n' "$*" >&2; exit 1; }

# port_open HOST PORT: something accepts connections there.
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# redis_up: a Redis answers PING on REDIS_HOST:REDIS_PORT.
redis_up() {
	if command -v redis-cli >/dev/null 2>&1; then
		[[ $(redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null) == PONG ]]
	else
		(
			exec 3<>"/dev/tcp/$REDIS_HOST/$REDIS_PORT" || exit 1
			printf 'PING\r\n' >&3
			IFS= read -r -t 2 line <&3 && [[ $line == +PONG* ]]
		) 2>/dev/null
	fi
}

# alive_pidfile FILE NAME: FILE holds the pid of a live process whose
# command line contains NAME (so a recycled pid is never killed).
alive_pidfile() {
	local pid
	[[ -s $1 ]] || return 1
	pid=$(<"$1")
	[[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null &&
		tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2"
}

# stop_pidfile FILE NAME [quiet]: stop that process (TERM, then KILL
# after 10s).
stop_pidfile() {
	local file=$1 name=$2 quiet=${3:-} pid i
	if alive_pidfile "$file" "$name"; then
		pid=$(<"$file")
		[[ -n $quiet ]] || say "stopping $name (pid $pid)"
		kill -TERM "$pid" 2>/dev/null || true
		for ((i = 0; i < 100; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		if kill -0 "$pid" 2>/dev/null; then
			say "$name (pid $pid) did not stop; killing it"
			kill -KILL "$pid" 2>/dev/null || true
		fi
	fi
	rm -f "$file"
}

stop_all() {
	stop_pidfile "$RUN_DIR/tail.pid" tail quiet
	stop_pidfile "$RUN_DIR/caddy.pid" caddy
	stop_pidfile "$RUN_DIR/upstream.pid" upstream
	# redis.pid exists only when the demo started that Redis itself.
	stop_pidfile "$RUN_DIR/redis.pid" redis-server
}

# wait_for WHAT PID CHECK...: run CHECK until it succeeds (15s at most),
# failing early when PID exits.
wait_for() {
	local what=$1 pid=$2 i
	shift 2
	for ((i = 0; i < 150; i++)); do
		"$@" && return 0
		if [[ $pid != - ]] && ! kill -0 "$pid" 2>/dev/null; then
			return 1
		fi
		sleep 0.1
	done
	say "demo: $what is not ready after 15s" >&2
	return 1
}

run() {
	[[ -x $CADDY ]] || die "$CADDY is missing; run 'make run' (it builds it)"
	[[ -x $UPSTREAM ]] || die "$UPSTREAM is missing; run 'make run' (it builds it)"
	mkdir -p "$RUN_DIR"
	printf '*\n' >"$RUN_DIR/.gitignore"

	if alive_pidfile "$RUN_DIR/caddy.pid" caddy || alive_pidfile "$RUN_DIR/upstream.pid" upstream; then
		die "an earlier demo is still running; stop it with 'make stop'"
	fi
	local p
	for p in "$HTTP_PORT" "$RL_PORT" "$ADMIN_PORT" "${UPSTREAM_ADDR##*:}"; do
		if port_open 127.0.0.1 "$p"; then
			die "port $p is in use; stop what uses it (an earlier demo: 'make stop')"
		fi
	done

	trap stop_all EXIT
	trap 'exit 129' HUP
	trap 'exit 130' INT
	trap 'exit 143' TERM

	# Redis: use one that answers, else start our own.
	if redis_up; then
		say "using the Redis already running on $REDIS_HOST:$REDIS_PORT (it will be left running)"
	else
		command -v redis-server >/dev/null 2>&1 || ${MAKE:-make} --no-print-directory redis-server
		rm -f "$RUN_DIR/redis.pid"
		say "starting redis-server on $REDIS_HOST:$REDIS_PORT (log: .run/redis.log)"
		redis-server --bind "$REDIS_HOST" --port "$REDIS_PORT" \
			--save "" --appendonly no \
			--daemonize yes --pidfile "$RUN_DIR/redis.pid" \
			--logfile "$RUN_DIR/redis.log" --dir "$RUN_DIR"
		wait_for redis-server - redis_up || die "redis-server did not start; see .run/redis.log"
	fi

	say "starting the demo upstream on $UPSTREAM_ADDR (log: .run/upstream.log)"
	"$UPSTREAM" -addr "$UPSTREAM_ADDR" -sleep 2s >"$RUN_DIR/upstream.log" 2>&1 &
	echo $! >"$RUN_DIR/upstream.pid"
	wait_for upstream $! port_open 127.0.0.1 "${UPSTREAM_ADDR##*:}" ||
		{ cat "$RUN_DIR/upstream.log" >&2; die "the upstream did not start"; }

	say "starting caddy with $CADDYFILE on :$HTTP_PORT (log: .run/caddy.log)"
	"$CADDY" run --config "$CADDYFILE" --adapter caddyfile >"$RUN_DIR/caddy.log" 2>&1 &
	echo $! >"$RUN_DIR/caddy.pid"
	# The admin endpoint opens first, then the sites of the config.
	local ready=(port_open 127.0.0.1 "$ADMIN_PORT")
	if [[ $CADDYFILE == examples/Caddyfile ]]; then
		ready=(port_open 127.0.0.1 "$RL_PORT")
	fi
	wait_for caddy $! "${ready[@]}" ||
		{ cat "$RUN_DIR/caddy.log" >&2; die "caddy did not start"; }

	if [[ $CADDYFILE == examples/Caddyfile ]]; then
		print_tries
	else
		say ""
		say "caddy runs $CADDYFILE; what to try is in the comment at its top."
	fi
	say ""
	say "Following the upstream's and Caddy's logs (.run/*.log). Ctrl-C stops everything this started."
	# (In a script, background jobs ignore Ctrl-C; stop_all ends this one.)
	tail -n 0 -F "$RUN_DIR/upstream.log" "$RUN_DIR/caddy.log" &
	echo $! >"$RUN_DIR/tail.pid"
	# Until Ctrl-C, or until caddy or the upstream exits by itself.
	wait -n "$(<"$RUN_DIR/caddy.pid")" "$(<"$RUN_DIR/upstream.pid")" || true
	say "demo: caddy or the upstream exited; stopping" >&2
	exit 1
}

# print_tries prints the curl lines of the examples/Caddyfile demo.
print_tries() {
	local H=localhost:$HTTP_PORT R=localhost:$RL_PORT A=localhost:$ADMIN_PORT
	cat <<EOF

The demo is up: redis_lock on http://$H -> upstream $UPSTREAM_ADDR (2s per request),
redis_ratelimit on http://$R, the admin API on http://$A/redisdlm/.
The upstream answers one JSON line per request: fencing_token is the lock's token,
in_flight is how many requests for the same key it was serving (1 = serialised).
Try, in another terminal:

  # (a) two updates of one user: the second ends ~2s after the first, with a higher fencing token
  curl -s localhost:$HTTP_PORT/profile -H 'X-User-ID: alice' & curl -s localhost:$HTTP_PORT/profile -H 'X-User-ID: alice'; wait

  #     another user is not held up by alice
  curl -s localhost:$HTTP_PORT/profile -H 'X-User-ID: alice' & curl -s localhost:$HTTP_PORT/profile -H 'X-User-ID: bob'; wait

  #     no X-User-ID: the key renders empty -> 400
  curl -si localhost:$HTTP_PORT/profile

  # (b) orders lock both inventory items, all or nothing: the second shares "pear", so it waits
  curl -s 'localhost:$HTTP_PORT/orders?sku1=apple&sku2=pear' & curl -s 'localhost:$HTTP_PORT/orders?sku1=pear&sku2=plum'; wait

  # (b2) execute once: the same checkout twice (same user, same Idempotency-Key):
  #      the upstream runs it once; the second answer carries Idempotent-Replayed: true
  curl -si -X POST localhost:$HTTP_PORT/checkout -H 'X-User-ID: alice' -H 'Idempotency-Key: k1' -d 'cart=42'
  curl -si -X POST localhost:$HTTP_PORT/checkout -H 'X-User-ID: alice' -H 'Idempotency-Key: k1' -d 'cart=42'
  #      the same key with another body: 422, and the upstream is not called
  curl -si -X POST localhost:$HTTP_PORT/checkout -H 'X-User-ID: alice' -H 'Idempotency-Key: k1' -d 'cart=43'

  # (c) the same job twice at once: the second is answered 423 at once, with Retry-After
  #     (run it twice: once a 5s run was seen, Retry-After says about 5, not the 30s lease)
  curl -s 'localhost:$HTTP_PORT/jobs/reindex?sleep=5s' & sleep 0.5; curl -si localhost:$HTTP_PORT/jobs/reindex; wait

  # (d) rate limit per user on :$RL_PORT: alice may make 5 requests per 10s, the 6th gets 429
  for i in 1 2 3 4 5 6; do curl -s -o /dev/null -w '%{http_code} ' -H 'X-User-ID: alice' $R/api/items; done; echo

  #     the answer's headers: RateLimit-Policy lists both rates (5 per 10s, 100 per hour),
  #     RateLimit the tightest one's remaining quota (r) and seconds until it grows (t),
  #     Retry-After the seconds until alice may try again
  curl -si -H 'X-User-ID: alice' $R/api/items

  #     bob has a quota of his own
  curl -si -H 'X-User-ID: bob' $R/api/items

  # (e) rate limit per client IP, on every path: 20 per 10s, so this ends in 429s
  for i in \$(seq 25); do curl -s -o /dev/null -w '%{http_code} ' $R/; done; echo

  # (f) the admin API on Caddy's admin endpoint: the handlers, alice's quota
  #     (reading it counts nothing), and a reset of it
  curl -s $A/redisdlm/
  curl -s $A/redisdlm/limits/per_user/alice
  curl -s -X DELETE $A/redisdlm/limits/per_user/alice

  #     a running job's lock (holders, lease left, fencing counter), then a force
  #     release: the job's request finds its lease lost at its next extension
  #     (within ttl/3 = 10s) and is canceled (503). The key, /jobs/reindex, is URL-escaped.
  curl -s '$H/jobs/reindex?sleep=30s' & sleep 0.5; curl -s $A/redisdlm/locks/jobs/%2Fjobs%2Freindex
  curl -s -X POST $A/redisdlm/locks/jobs/%2Fjobs%2Freindex/release; wait

  # metrics
  curl -s $A/metrics | grep caddy_redis_
EOF
}

case ${1:-run} in
run) run ;;
stop) stop_all ;;
*) die "usage: $0 run|stop" ;;
esac
