# Sourced by bench/gateway_callgrind.sh, bench/gateway_syscalls.sh and
# bench/pgo_train.sh: the gateway benchmark's fixture outside `sluice bench
# gateway` (its fast upstream, two instances, and a `sluice serve` config in
# front of them with the kv-aware router plugin). Expects $root (the
# repository) and sets port, up1, up2.
port=18080 up1=18091 up2=18092

# Starts the fast upstream on $up1 and $up2 (`cargo build --release -p
# sluice-gateway --example fast_upstream`), and a trap that stops it and the
# gateway ($gw, where set) when the script exits.
start_upstream() {
  "$root/target/release/examples/fast_upstream" $up1 $up2 &
  upstream=$!
  trap 'kill $upstream 2>/dev/null; [ -n "${gw:-}" ] && kill $gw 2>/dev/null; true' EXIT
}

# Writes DIR/gateway.toml (and the plugin into DIR/plugins); extra config
# lines come on stdin.
write_gateway_config() {
  local dir=$1
  mkdir -p "$dir/plugins"
  cp "$root/plugins/target/wasm32-wasip2/release/kv_aware.wasm" "$dir/plugins/router.wasm"
  {
    cat <<EOC
listen = "127.0.0.1:$port"
model = "$root/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
served_model_name = "bench"
workers = ["http://127.0.0.1:$up1", "http://127.0.0.1:$up2"]
plugins_dir = "$dir/plugins"
admin_token = "bench-admin-token-0123456789"
EOC
    cat
  } > "$dir/gateway.toml"
}

# Waits until the gateway on $port answers (at most 4 minutes: valgrind is slow to start).
wait_gateway() {
  for _ in $(seq 1 120); do
    curl -s -m 2 -o /dev/null "127.0.0.1:$port/v1/models" && return 0
    sleep 2
  done
  echo "the gateway on port $port did not answer" >&2
  return 1
}
