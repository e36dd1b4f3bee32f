#!/usr/bin/env bash
# The profile `make build` optimizes `sluice` with (`make pgo-profile`; BENCHMARKS.md,
# "Profile-guided optimization"): an instrumented `sluice serve` in front of the
# gateway benchmark's fast upstream (two instances), serving the benchmark's
# chat requests (non-streaming and streaming, two kept-alive connections at
# once, 3,000 each) and 200 completions, then stopped with SIGTERM, on which it
# exits cleanly and writes its counts to PROFRAW_DIR/sluice-<pid>.profraw.
#
# usage: bench/pgo_train.sh INSTRUMENTED_SLUICE PROFRAW_DIR
# Needs `make model plugins` and
#   cargo build --release -p sluice-gateway --example fast_upstream
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
binary=${1:?the instrumented sluice binary}
raw=${2:?where the .profraw goes}
out=$(mktemp -d /tmp/sluice-pgo.XXXXXX)
source bench/gateway_fixture.sh

start_upstream
mkdir -p "$raw"
write_gateway_config "$out" < /dev/null
LLVM_PROFILE_FILE="$raw/sluice-%p.profraw" RUST_LOG=warn "$binary" serve --config "$out/gateway.toml" \
  > "$out/gateway.log" 2>&1 &
gw=$!
wait_gateway
for _ in 1 2; do
  python3 bench/gateway_load.py $port 1500 &
  plain=$!
  python3 bench/gateway_load.py $port 1500 s &
  streaming=$!
  wait $plain
  wait $streaming
done
for i in $(seq 1 200); do
  stream=$([ $((i % 2)) = 0 ] && echo true || echo false)
  curl -sf -o /dev/null "127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"bench\",\"prompt\":\"Order $i: a chain and two brake pads\",\"max_tokens\":8,\"stream\":$stream}"
done
kill -TERM $gw
wait $gw
gw=
ls "$raw"/sluice-*.profraw > /dev/null  # it wrote its counts
rm -rf "$out"
