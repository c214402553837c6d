#!/usr/bin/env bash
# make fuzz: runs every fuzz target of every package for FUZZTIME each
# (default 30s) and prints the inputs each one tried. A failing input is
# saved by go test under <package>/testdata/fuzz/<FuzzName>/ (commit it with
# the fix: plain `go test` then replays it) and ends the run with its log.
set -uo pipefail
FUZZTIME=${FUZZTIME:-30s}
cd "$(dirname "$0")/.."
summary=()
for pkg in $(go list -f '{{if .TestGoFiles}}{{.Dir}}{{end}}' ./...); do
	dir=${pkg#"$PWD"}
	dir=.${dir}
	targets=$(go test -list '^Fuzz' "$dir" | grep '^Fuzz')
	for t in $targets; do
		log=$(mktemp)
		echo "== $dir $t ($FUZZTIME)"
		if ! go test -run '^$' -fuzz "^${t}\$" -fuzztime "$FUZZTIME" "$dir" >"$log" 2>&1; then
			cat "$log"
			echo "$t FAILED; the input is under $dir/testdata/fuzz/$t/" >&2
			rm -f "$log"
			exit 1
		fi
		last=$(grep -E '^fuzz: elapsed' "$log" | tail -1)
		execs=$(sed -nE 's/.*execs: ([0-9]+).*/\1/p' <<<"$last")
		news=$(sed -nE 's/.*new interesting: ([0-9]+).*/\1/p' <<<"$last")
		seeds=$(ls "$dir/testdata/fuzz/$t" 2>/dev/null | wc -l)
		echo "$last"
		summary+=("$(printf '%-24s %12s inputs tried  %4s new interesting  %3s committed seeds' "$t" "${execs:-?}" "${news:-0}" "$seeds")")
		rm -f "$log"
	done
done
echo
echo "fuzzing summary (FUZZTIME=$FUZZTIME each):"
printf '%s\n' "${summary[@]}"
