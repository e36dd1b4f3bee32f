//! Direct KV transfers (same node) between two engines on the real model
//! (SmolLM2-135M, `make model`), over the real TCP listener and protocol:
//! the prefill engine asks for the decode worker's pages (`share ask` /
//! `share offer`), copies its blocks into them itself and sends only
//! `landed` frames. On a GPU the copy is the IPC gather kernel
//! (`backend/tests/cuda.rs` runs that); here both executors are the CPU
//! reference behind a stand-in "shared cache" (`SharedCpu`, an in-process
//! registry in place of CUDA IPC handles), so that everything around the
//! copy runs in CI: greedy output equal to aggregated, the refusals that
//! send bytes instead, a failing copy that falls back to bytes mid-request,
//! and `landed` frames nobody asked for.

mod common;

use common::{kv_listener, tokens};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use sluice_backend::engine::{
    Engine, EngineConfig, Executor, GenerateEvent, GenerateRequest, ModelExecutor, Next,
};
use sluice_backend::kv::KvStorage;
use sluice_backend::model::SeqChunk;
use sluice_backend::transfer::tcp::TcpTransport;
use sluice_backend::transfer::wire::Frame;
use sluice_backend::transfer::{
    DIRECT_GRACE, DirectTarget, KvLayout, KvShare, KvTarget, KvTransport, node_id, unix_ms,
};
use tokio::sync::mpsc::UnboundedReceiver;

/// Executors whose caches other engines may write, by id (what a CUDA IPC
/// handle names on a GPU).
fn registry() -> &'static Mutex<HashMap<u64, Arc<Mutex<ModelExecutor>>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<u64, Arc<Mutex<ModelExecutor>>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The CPU reference with a shared cache: its `KvShare` names its registry
/// id in `k_handle`; `copy_kv_into` writes the blocks into the named
/// executor's pages.
struct SharedCpu {
    id: u64,
    inner: Arc<Mutex<ModelExecutor>>,
}

impl SharedCpu {
    fn new(config: &EngineConfig) -> SharedCpu {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let m = common::loaded_model().0.clone();
        let c = &m.config;
        let storage = KvStorage::new(
            c.n_layers,
            config.kv_blocks as usize,
            config.block_size,
            c.kv_dim(),
        );
        let inner = Arc::new(Mutex::new(ModelExecutor { model: m, storage }));
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        registry().lock().unwrap().insert(id, inner.clone());
        SharedCpu { id, inner }
    }

    fn with<T>(&self, f: impl FnOnce(&mut ModelExecutor) -> T) -> T {
        f(&mut self.inner.lock().unwrap())
    }
}

impl Executor for SharedCpu {
    fn context(&self) -> usize {
        self.with(|e| e.context())
    }
    fn vocab(&self) -> usize {
        self.with(|e| e.vocab())
    }
    fn run(&mut self, chunks: &[SeqChunk<'_>]) -> Vec<Next> {
        self.with(|e| e.run(chunks))
    }
    fn kv_layout(&self) -> KvLayout {
        self.with(|e| e.kv_layout())
    }
    fn read_kv(&mut self, blocks: &[u32]) -> Vec<u8> {
        self.with(|e| e.read_kv(blocks))
    }
    fn write_kv(&mut self, blocks: &[u32], data: &[u8]) {
        self.with(|e| e.write_kv(blocks, data))
    }
    fn kv_share(&self) -> Option<KvShare> {
        Some(KvShare {
            node: node_id(),
            pid: std::process::id(),
            device: format!("cpu-{}", self.id),
            layout: self.kv_layout(),
            n_blocks: self.with(|e| e.storage.n_blocks as u32),
            k_handle: self.id.to_le_bytes().to_vec(),
            v_handle: Vec::new(),
            k_addr: 0,
            v_addr: 0,
        })
    }
    fn copy_kv_into(
        &mut self,
        target: &DirectTarget,
        offset: usize,
        blocks: &[u32],
    ) -> Result<(), String> {
        let id = u64::from_le_bytes(
            target.share.k_handle[..]
                .try_into()
                .map_err(|_| "a bad handle")?,
        );
        let peer = registry()
            .lock()
            .unwrap()
            .get(&id)
            .cloned()
            .ok_or_else(|| format!("no cache {id} to map"))?;
        let pages = &target.pages[offset..offset + blocks.len()];
        let data = self.read_kv(blocks);
        peer.lock().unwrap().write_kv(pages, &data);
        Ok(())
    }
}

fn shared_engine(config: EngineConfig) -> Arc<Engine> {
    let executor = Box::new(SharedCpu::new(&config));
    Arc::new(Engine::start_with(
        executor,
        common::loaded_model().1.clone(),
        config,
    ))
}

fn plain_engine() -> Arc<Engine> {
    let (m, t) = common::loaded_model();
    Arc::new(Engine::start(m.clone(), t.clone(), EngineConfig::default()))
}

fn greedy(question: &str, max_tokens: u32) -> GenerateRequest {
    let mut r = GenerateRequest::new(
        common::chat_tokens(&common::loaded_model().1, question),
        max_tokens,
    );
    r.sampling.temperature = 0.0;
    r
}

/// Reserves `request` on `decode` and names the transfer's target.
async fn reserve(
    decode: &Engine,
    addr: &str,
    request: &GenerateRequest,
) -> (UnboundedReceiver<GenerateEvent>, KvTarget, u32) {
    let r = decode.reserve_kv(request.clone()).await.unwrap();
    let target = KvTarget {
        addr: addr.to_string(),
        handle: r.handle,
        from_block: r.from_block,
    };
    (r.events, target, r.blocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_transfers_give_the_aggregated_tokens_and_send_no_bytes() {
    let aggregated = plain_engine();
    // Small steps: the blocks land in several copies.
    let prefill = shared_engine(EngineConfig {
        step_tokens: 24,
        ..EngineConfig::default()
    });
    let decode = shared_engine(EngineConfig::default());
    let addr = kv_listener(&decode).await;
    let local = prefill.kv_share.clone().expect("a shared cache");
    for question in [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain, step by step, how a bill becomes a law, and what can stop it on the way.",
    ] {
        let request = greedy(question, 16);
        let (_, mut rx) = aggregated.submit(request.clone());
        let want = tokens(&mut rx).await.unwrap();
        let (mut rx, target, blocks) = reserve(&decode, &addr, &request).await;
        let transport = TcpTransport::default();
        let direct = transport
            .direct(&target, &local)
            .await
            .unwrap()
            .expect("same node, both shared: pages offered");
        assert_eq!(direct.pages.len(), blocks as usize);
        assert_eq!(direct.from_block, target.from_block);
        let (_, _events, kv) =
            prefill.submit_prefill(request.clone(), target.from_block, Some(direct));
        let pushed = transport.push(target, prefill.kv_layout, kv).await.unwrap();
        assert_eq!(
            (pushed.blocks, pushed.in_place, pushed.bytes),
            (blocks, blocks, 0),
            "{question:?}: every block copied in place, no byte on the wire"
        );
        assert_eq!(tokens(&mut rx).await.unwrap(), want, "{question:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_shared_cache_or_on_another_node_the_blocks_go_as_bytes() {
    let prefill = shared_engine(EngineConfig::default());
    let local = prefill.kv_share.clone().unwrap();
    let request = greedy("Name three colors.", 8);
    let transport = TcpTransport::default();

    // A decode worker whose cache is not shared refuses: bytes it is.
    let unshared = plain_engine();
    let addr = kv_listener(&unshared).await;
    let (mut rx, target, _) = reserve(&unshared, &addr, &request).await;
    assert_eq!(transport.direct(&target, &local).await.unwrap(), None);
    let (_, _events, kv) = prefill.submit_prefill(request.clone(), target.from_block, None);
    let pushed = transport.push(target, prefill.kv_layout, kv).await.unwrap();
    assert_eq!(pushed.in_place, 0);
    assert!(pushed.bytes > 0);
    let want = tokens(&mut rx).await.unwrap();

    // A sender on another node is refused too.
    let decode = shared_engine(EngineConfig::default());
    let addr = kv_listener(&decode).await;
    let (mut rx, target, _) = reserve(&decode, &addr, &request).await;
    let elsewhere = KvShare {
        node: "another-machine".into(),
        ..local.clone()
    };
    assert_eq!(transport.direct(&target, &elsewhere).await.unwrap(), None);
    // ... and so are blocks that "landed" without pages handed out: the
    // decode side never let anyone write them.
    let mut frames = Vec::new();
    for f in [
        Frame::Hello {
            handle: target.handle,
            layout: decode.kv_layout,
        },
        Frame::Landed {
            handle: target.handle,
            first_block: target.from_block,
            n_blocks: 1,
        },
    ] {
        f.write(&mut frames).await.unwrap();
    }
    let ack = common::kv_answer(&addr, &frames).await;
    assert!(
        matches!(&ack, Frame::Ack { ok: false, message, .. } if message.contains("never handed out")),
        "{ack:?}"
    );
    let error = tokens(&mut rx).await.unwrap_err();
    assert!(error.contains("KV transfer failed"), "{error}");

    // An ask for a request that waits for nothing (that one has failed) is
    // refused, not an error.
    assert_eq!(transport.direct(&target, &local).await.unwrap(), None);

    // The same request again, directly this time, still decodes as before.
    let (mut rx, target, _) = reserve(&decode, &addr, &request).await;
    let direct = transport.direct(&target, &local).await.unwrap().unwrap();
    let (_, _events, kv) = prefill.submit_prefill(request.clone(), target.from_block, Some(direct));
    transport.push(target, prefill.kv_layout, kv).await.unwrap();
    assert_eq!(tokens(&mut rx).await.unwrap(), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_fails_sends_the_blocks_as_bytes_instead() {
    let prefill = shared_engine(EngineConfig {
        step_tokens: 24,
        ..EngineConfig::default()
    });
    let decode = shared_engine(EngineConfig::default());
    let addr = kv_listener(&decode).await;
    let request = greedy("Write a haiku about the sea.", 12);
    let (_, mut rx) = plain_engine().submit(request.clone());
    let want = tokens(&mut rx).await.unwrap();

    let transport = TcpTransport::default();
    let spoil: [fn(&mut DirectTarget); 2] = [
        // A cache that cannot be mapped (on a GPU: a stale or foreign handle).
        |d| d.share.k_handle = u64::MAX.to_le_bytes().to_vec(),
        // A reservation about to expire: no copy starts that close to it.
        |d| d.expires_unix_ms = unix_ms(),
    ];
    for spoil in spoil {
        let (mut rx, target, blocks) = reserve(&decode, &addr, &request).await;
        let mut direct = transport
            .direct(&target, prefill.kv_share.as_ref().unwrap())
            .await
            .unwrap()
            .unwrap();
        spoil(&mut direct);
        let (_, _events, kv) =
            prefill.submit_prefill(request.clone(), target.from_block, Some(direct));
        let pushed = transport.push(target, prefill.kv_layout, kv).await.unwrap();
        assert_eq!((pushed.blocks, pushed.in_place), (blocks, 0));
        assert_eq!(
            pushed.bytes,
            u64::from(blocks) * prefill.kv_layout.block_bytes() as u64
        );
        assert_eq!(tokens(&mut rx).await.unwrap(), want);
    }
}

/// A direct import that fails keeps its pages out of use until the grace
/// after its deadline (the prefill worker may still be copying into them),
/// then lets them go; a bytes import that fails frees them at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_direct_import_holds_its_pages_until_no_copy_can_come() {
    let kv_wait = Duration::from_millis(300);
    let decode = shared_engine(EngineConfig {
        kv_wait,
        ..EngineConfig::default()
    });
    let addr = kv_listener(&decode).await;
    let local = shared_engine(EngineConfig::default())
        .kv_share
        .clone()
        .unwrap();
    let request = greedy("Name three colors.", 4);
    for direct in [false, true] {
        let started = std::time::Instant::now();
        let (mut rx, target, _) = reserve(&decode, &addr, &request).await;
        if direct {
            let d = TcpTransport::default()
                .direct(&target, &local)
                .await
                .unwrap();
            assert!(d.is_some());
        }
        // Nobody sends anything: the reservation times out.
        let error = tokens(&mut rx).await.unwrap_err();
        assert!(error.contains("no KV arrived"), "{error}");
        // Well inside the grace (the load is published after each step).
        tokio::time::sleep(Duration::from_secs(1)).await;
        let used = decode.load().kv_blocks_used;
        if direct {
            assert!(used > 0, "the failed direct import's pages are held");
            let limit = kv_wait + DIRECT_GRACE + Duration::from_secs(3);
            while decode.load().kv_blocks_used > 0 {
                assert!(started.elapsed() < limit, "held past {limit:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert!(
                started.elapsed() >= kv_wait + DIRECT_GRACE,
                "freed after {:?}, before the grace ended",
                started.elapsed()
            );
        } else {
            assert_eq!(used, 0, "a bytes import's blocks are freed at once");
        }
    }
}
