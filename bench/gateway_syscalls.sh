#!/usr/bin/env bash
# System calls a request of `sluice serve` (BENCHMARKS.md, "Gateway
# overhead"): the gateway (one server thread) in front of the benchmark's fast
# upstream, one kept-alive connection, 300 requests of warm-up, then `strace
# -c` over 2,000 non-streaming and 2,000 streaming ones.
#
# usage: bench/gateway_syscalls.sh [BINARY]    (default target/dist/sluice)
# Needs strace, `make setup`, and the example:
#   cargo build --release -p sluice-gateway --example fast_upstream
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
binary=${1:-target/dist/sluice}
out=$(mktemp -d /tmp/sluice-syscalls.XXXXXX)
source bench/gateway_fixture.sh

start_upstream
sleep 0.5
write_gateway_config "$out" <<EOT
threads = 1
EOT
RUST_LOG=warn "$binary" serve --config "$out/gateway.toml" > "$out/gateway.log" 2>&1 &
gw=$!
wait_gateway
python3 bench/gateway_load.py $port 300 > /dev/null
for mode in "" s; do
  strace -c -f -p $gw -o "$out/strace$mode.txt" &
  tracer=$!
  sleep 1
  python3 bench/gateway_load.py $port 2000 $mode > /dev/null
  kill -INT $tracer
  wait $tracer || true
  echo "== $([ -z "$mode" ] && echo non-streaming || echo streaming), 2,000 requests"
  sed -n '1,/^-.*total/p' "$out/strace$mode.txt" | grep -v '^-' | awk 'NR > 1 && $4 >= 100 {printf "%s %.2f a request\n", $NF, $4 / 2000}'
done
