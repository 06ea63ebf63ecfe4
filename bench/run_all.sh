#!/bin/bash
# Run every benchmark in bench/ (bench/bench_*.py) in turn with this checkout's venv,
# each with its default arguments; exits non-zero if any of them failed.
#   bench/run_all.sh
# Needs root (the scope and gate benchmarks boot a throwaway systemd with
# systemd-nspawn) and the venv: packaging/dev-setup makes both ready. bench_adaptive.py
# also needs the bench extra for its pictures (.venv/bin/pip install -e '.[bench]') and
# takes up to an hour.
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
python="$repo/.venv/bin/python"
if [ ! -x "$python" ]; then
	echo "run_all: $python is missing; run packaging/dev-setup first" >&2
	exit 69
fi
cd "$repo"
failed=()
for bench in bench/bench_*.py; do
	[ -e "$bench" ] || continue
	echo "=== $bench ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
	if ! "$python" "$bench"; then
		failed+=("$bench")
	fi
	echo
done
if [ ${#failed[@]} -gt 0 ]; then
	echo "run_all: failed: ${failed[*]}" >&2
	exit 1
fi
echo "run_all: all benchmarks ran"
