//! Helpers for sluice's end-to-end tests: where the built plugin components are,
//! small fleets and requests to call them with, and a real gateway with real
//! worker processes (`cluster`), and a test engine that speaks OpenAI and
//! publishes vLLM-format KV events (`openai_engine`).

pub mod cluster;
pub mod openai_engine;

use std::path::PathBuf;

use sluice_gateway::policy::{FleetView, Hop, RequestView, WorkerLoad, WorkerState};

/// `plugins/target/wasm32-wasip2/release`, where `make plugins` puts components.
pub fn plugins_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/target/wasm32-wasip2/release")
}

/// The bytes of the built plugin `name` (crate name, with `-` or `_`).
pub fn plugin_wasm(name: &str) -> Vec<u8> {
    let path = plugins_dir().join(format!("{}.wasm", name.replace('-', "_")));
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e}. Build the plugins first: `make plugins` \
             (cargo build --release --target wasm32-wasip2 in plugins/)",
            path.display()
        )
    })
}

/// A request of `prompt_blocks` blocks of 16 tokens.
pub fn request(prompt_blocks: u32) -> RequestView {
    RequestView {
        prompt_tokens: prompt_blocks * 16,
        prompt_blocks,
        block_size: 16,
        max_tokens: 128,
        session_hash: 0,
        tenant_id: 0,
        priority: 0,
        hop: Hop::Aggregated,
    }
}

/// `n` healthy workers (ids 1..=n) with made-up load and overlap from `seed`.
pub fn fleet(n: usize, seed: u64) -> FleetView {
    let mut rng = Rng(seed);
    let workers: Vec<WorkerLoad> = (0..n as u32)
        .map(|i| WorkerLoad {
            state: WorkerState::new(true, true, true),
            id: i + 1,
            active_requests: rng.below(32) as u32,
            queued_prefill_tokens: rng.below(8192) as u32,
            kv_blocks_used: rng.below(4000) as u32,
            kv_blocks_total: 4096,
            overlap_blocks: rng.below(64) as u32,
        })
        .collect();
    FleetView::from_workers(&workers)
}

/// A tiny seeded generator (splitmix64) for made-up fleets.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}
