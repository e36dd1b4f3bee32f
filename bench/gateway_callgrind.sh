#!/usr/bin/env bash
# Instructions a request of a gateway, counted by callgrind (BENCHMARKS.md,
# "Gateway overhead"): the gateway under valgrind in front of the benchmark's
# fast upstream (two instances), one kept-alive connection, 200 requests of
# warm-up, then 1,000 counted, non-streaming and then streaming.
#
# usage: bench/gateway_callgrind.sh sluice [BINARY]    (default target/dist/sluice)
#        bench/gateway_callgrind.sh sglang-router      (pip install sglang-router)
# Needs valgrind, `make setup`, and the example:
#   cargo build --release -p sluice-gateway --example fast_upstream
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
gateway=${1:?sluice or sglang-router}
out=$(mktemp -d /tmp/sluice-callgrind.XXXXXX)
source bench/gateway_fixture.sh

start_upstream
sleep 0.5

case $gateway in
sluice)
  binary=${2:-target/dist/sluice}
  # A 32 MiB plugin memory reservation: valgrind refuses wasmtime's default
  # (4 GiB and guards per instance); one server thread.
  write_gateway_config "$out" <<EOF
plugin_memory_reservation = 33554432
threads = 1
EOF
  RUST_LOG=warn valgrind --tool=callgrind --dump-instr=no --callgrind-out-file="$out/cg.out" \
    "$binary" serve --config "$out/gateway.toml" > "$out/gateway.log" 2>&1 &
  ;;
sglang-router)
  # The Python executable itself (a pyenv shim would exec it out of valgrind's sight).
  python=$(python3 -c 'import sys; print(sys.executable)')
  valgrind --tool=callgrind --dump-instr=no --callgrind-out-file="$out/cg.out" \
    "$python" -m sglang_router.launch_router --policy cache_aware --log-level warn \
    --host 127.0.0.1 --port $port --prometheus-port $((port + 19)) \
    --worker-urls http://127.0.0.1:$up1 http://127.0.0.1:$up2 > "$out/gateway.log" 2>&1 &
  ;;
*)
  echo "unknown gateway: $gateway" >&2
  exit 2
  ;;
esac
gw=$!
wait_gateway

for mode in "" s; do
  python3 bench/gateway_load.py $port 200 $mode > /dev/null
  callgrind_control -z $gw > /dev/null
  python3 bench/gateway_load.py $port 1000 $mode
  callgrind_control -d $gw > /dev/null
done
for part in 1 2; do
  total=$(callgrind_annotate "$out/cg.out.$part" 2>/dev/null | grep -m1 'PROGRAM TOTALS' | awk '{gsub(",", "", $1); print $1}')
  mode=$([ $part = 1 ] && echo non_streaming || echo streaming)
  echo "{\"gateway\":\"$gateway\",\"mode\":\"$mode\",\"instructions_per_request\":$((total / 1000)),\"profile\":\"$out/cg.out.$part\"}"
done
