//! cargo run --release -p sluice-tests --example fleet_layout
//!
//! The experiment behind `fleet-view`'s layout in `wit/policy.wit`: the same
//! KV-aware loop (plugins/fixtures/fleet-layout) called with the fleet as a list
//! of records, as seven column lists, and as one packed list. Prints one JSON
//! line per layout and fleet size (median ns per call of 5 rounds).

use std::time::Instant;

use wasmtime::component::{Component, ComponentType, Linker, Lower, TypedFunc};
use wasmtime::{Config, Engine, Store};

#[derive(ComponentType, Lower, Clone, Copy)]
#[component(enum)]
#[repr(u8)]
enum Hop {
    #[component(name = "aggregated")]
    Aggregated,
    #[allow(dead_code, reason = "part of the WIT enum")]
    #[component(name = "prefill")]
    Prefill,
    #[allow(dead_code, reason = "part of the WIT enum")]
    #[component(name = "decode")]
    Decode,
}

/// `sluice:policy/types.request-view`, as the experiment passes it.
#[derive(ComponentType, Lower, Clone, Copy)]
#[component(record)]
struct Request {
    #[component(name = "prompt-tokens")]
    prompt_tokens: u32,
    #[component(name = "prompt-blocks")]
    prompt_blocks: u32,
    #[component(name = "block-size")]
    block_size: u32,
    #[component(name = "max-tokens")]
    max_tokens: u32,
    #[component(name = "session-hash")]
    session_hash: u64,
    #[component(name = "tenant-id")]
    tenant_id: u32,
    #[component(name = "priority")]
    priority: i32,
    #[component(name = "hop")]
    hop: Hop,
}

#[derive(ComponentType, Lower, Clone, Copy)]
#[component(record)]
struct Worker {
    #[component(name = "state")]
    state: u8,
    #[component(name = "worker-id")]
    worker_id: u32,
    #[component(name = "active-requests")]
    active_requests: u32,
    #[component(name = "queued-prefill-tokens")]
    queued_prefill_tokens: u32,
    #[component(name = "kv-blocks-used")]
    kv_blocks_used: u32,
    #[component(name = "kv-blocks-total")]
    kv_blocks_total: u32,
    #[component(name = "overlap-blocks")]
    overlap_blocks: u32,
}

#[derive(ComponentType, Lower)]
#[component(record)]
struct Columns<'a> {
    #[component(name = "state")]
    state: &'a [u8],
    #[component(name = "worker-ids")]
    worker_ids: &'a [u32],
    #[component(name = "active-requests")]
    active_requests: &'a [u32],
    #[component(name = "queued-prefill-tokens")]
    queued_prefill_tokens: &'a [u32],
    #[component(name = "kv-blocks-used")]
    kv_blocks_used: &'a [u32],
    #[component(name = "kv-blocks-total")]
    kv_blocks_total: &'a [u32],
    #[component(name = "overlap-blocks")]
    overlap_blocks: &'a [u32],
}

#[derive(ComponentType, Lower)]
#[component(record)]
struct Packed<'a> {
    #[component(name = "workers")]
    workers: u32,
    #[component(name = "columns")]
    columns: &'a [u32],
}

fn median_ns(mut f: impl FnMut() -> u32, calls: u32) -> f64 {
    let mut rounds: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..calls {
                std::hint::black_box(f());
            }
            t.elapsed().as_nanos() as f64 / f64::from(calls)
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[2]
}

fn main() -> wasmtime::Result<()> {
    let engine = Engine::new(&Config::new())?;
    let bytes = std::fs::read(sluice_tests::plugins_dir().join("fleet_layout.wasm"))?;
    let component = Component::new(&engine, &bytes)?;
    let mut linker = Linker::<()>::new(&engine);
    linker.define_unknown_imports_as_traps(&component)?;
    let mut store = Store::new(&engine, ());
    let instance = linker.instantiate(&mut store, &component)?;
    let iface = component
        .get_export_index(None, "sluice:layout-experiment/layouts")
        .expect("layouts export");
    let func = |store: &mut Store<()>, name: &str| {
        let idx = component.get_export_index(Some(&iface), name).expect(name);
        instance.get_func(&mut *store, idx).expect(name)
    };
    let records: TypedFunc<(Request, &[Worker]), (u32,)> =
        func(&mut store, "route-records").typed(&store)?;
    let columns: TypedFunc<(Request, Columns<'_>), (u32,)> =
        func(&mut store, "route-columns").typed(&store)?;
    let packed: TypedFunc<(Request, Packed<'_>), (u32,)> =
        func(&mut store, "route-packed").typed(&store)?;

    let request = Request {
        prompt_tokens: 2048,
        prompt_blocks: 128,
        block_size: 16,
        max_tokens: 256,
        session_hash: 1,
        tenant_id: 1,
        priority: 0,
        hop: Hop::Aggregated,
    };
    for n in [8u32, 64, 512] {
        let workers: Vec<Worker> = (0..n)
            .map(|i| {
                let mix = i.wrapping_mul(2_654_435_761);
                Worker {
                    state: 7,
                    worker_id: i + 1,
                    active_requests: mix % 17,
                    queued_prefill_tokens: mix % 4096,
                    kv_blocks_used: mix % 3000,
                    kv_blocks_total: 4096,
                    overlap_blocks: (mix >> 7) % 64,
                }
            })
            .collect();
        let col = |f: fn(&Worker) -> u32| workers.iter().map(f).collect::<Vec<u32>>();
        let state: Vec<u8> = workers.iter().map(|w| w.state).collect();
        let (ids, active, queued) = (
            col(|w| w.worker_id),
            col(|w| w.active_requests),
            col(|w| w.queued_prefill_tokens),
        );
        let (used, total, overlap) = (
            col(|w| w.kv_blocks_used),
            col(|w| w.kv_blocks_total),
            col(|w| w.overlap_blocks),
        );
        let mut flat: Vec<u32> = state.iter().map(|&s| u32::from(s)).collect();
        for c in [&ids, &active, &queued, &used, &total, &overlap] {
            flat.extend_from_slice(c);
        }
        let calls = 200_000 * 8 / n.max(8);
        let t_records = median_ns(
            || records.call(&mut store, (request, &workers)).unwrap().0,
            calls,
        );
        let t_columns = median_ns(
            || {
                let cols = Columns {
                    state: &state,
                    worker_ids: &ids,
                    active_requests: &active,
                    queued_prefill_tokens: &queued,
                    kv_blocks_used: &used,
                    kv_blocks_total: &total,
                    overlap_blocks: &overlap,
                };
                columns.call(&mut store, (request, cols)).unwrap().0
            },
            calls,
        );
        let t_packed = median_ns(
            || {
                packed
                    .call(
                        &mut store,
                        (
                            request,
                            Packed {
                                workers: n,
                                columns: &flat,
                            },
                        ),
                    )
                    .unwrap()
                    .0
            },
            calls,
        );
        let picks = [
            records.call(&mut store, (request, &workers))?.0,
            packed
                .call(
                    &mut store,
                    (
                        request,
                        Packed {
                            workers: n,
                            columns: &flat,
                        },
                    ),
                )?
                .0,
        ];
        assert_eq!(picks[0], picks[1], "the layouts agree");
        println!(
            "{{\"workers\":{n},\"records_ns\":{t_records:.0},\"columns_ns\":{t_columns:.0},\"packed_ns\":{t_packed:.0}}}"
        );
    }
    Ok(())
}
