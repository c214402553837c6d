#!/usr/bin/env bash
# go test -race over the module (make test). A test that fails fails the
# run: nothing is rerun, since a rerun alone removes the very load under
# which a race or a timing fault shows. The one exception is a test named
# in tools/tolerant-tests (one per line, with why): it is run once more,
# alone, and the run says so. Every run ends with a line saying how many
# tests were retried, and which.
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
go test -race -count=1 "$@" ./... 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ]; then
	echo "== retried: 0"
	exit 0
fi
mapfile -t fails < <(grep -E '^--- FAIL: ' "$log" | awk '{print $3}' | sort -u)
mapfile -t tolerant < <(grep -vE '^\s*(#|$)' tools/tolerant-tests | awk '{print $1}')
if grep -qE '^(panic: |FAIL.*\[build failed\]|# )|test timed out' "$log" || [ "${#fails[@]}" -eq 0 ]; then
	echo "== retried: 0 (a build error, a panic or a timeout is never retried)"
	exit "$rc"
fi
for f in "${fails[@]}"; do
	if ! printf '%s\n' "${tolerant[@]}" | grep -qxF "$f"; then
		echo "== retried: 0 (${fails[*]} failed; only the tests named in tools/tolerant-tests are retried)"
		exit "$rc"
	fi
done
re="^($(IFS='|'; echo "${fails[*]}"))\$"
echo "== retried: ${#fails[@]} (${fails[*]}), named in tools/tolerant-tests"
go test -race -count=1 -run "$re" ./...
