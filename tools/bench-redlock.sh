#!/usr/bin/env bash
# Library-level Redlock figure: median acquire+release latency on
# three servers ÷ one server, from BenchmarkLockAcquireRelease (no HTTP).
set -euo pipefail
cd "$(dirname "$0")/.."
# Sub-benchmarks run in order servers=1, servers=3; redis-server's start-up
# lines can split a result from its name, so take the p50 values in order.
out=$(go test -run '^$' -bench BenchmarkLockAcquireRelease -benchtime 3000x ./redislock 2>/dev/null | grep -o '[0-9.]* p50-us')
one=$(echo "$out" | sed -n 1p | awk '{print $1}')
three=$(echo "$out" | sed -n 2p | awk '{print $1}')
ratio=$(awk -v a="$three" -v b="$one" 'BEGIN { printf "%.2f", a / b }')
ok=$(awk -v r="$ratio" 'BEGIN { print (r <= 1.5) ? "✔" : "✘" }')
echo
echo "### Redlock at library level (acquire + release, uncontended, no HTTP; BenchmarkLockAcquireRelease)"
echo
echo "| servers | median | ratio to one server | goal |"
echo "|---|---|---|---|"
echo "| 1 | ${one} µs | 1.00 | — |"
echo "| 3 (Redlock) | ${three} µs | **${ratio}** | ≤ 1.5 ${ok} |"
