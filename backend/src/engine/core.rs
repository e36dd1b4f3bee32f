//! The engine loop: continuous batching on one thread. Each step admits waiting
//! requests while KV blocks and the step's token budget allow, feeds one token
//! to every decoding sequence and a chunk of prompt to prefilling ones (chunked
//! prefill), runs the executor over the whole batch (the model's forward
//! pass, or the simulator's timing model), samples, and streams tokens back. When blocks run out, the youngest running sequence is preempted
//! and later recomputed. A request whose receiver is dropped is cancelled.
//!
//! Disaggregation adds two kinds of sequence: an *export* (a prefill worker's
//! request: prefill only, each step's finished blocks sent out as
//! [`KvExport`]s, no sampling) and an *import* (a decode worker's
//! `remote_prefill` request: admitted with its blocks reserved, it waits in
//! `receiving` until a transfer has filled them, then decodes as usual).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc as tmpsc};

use super::detok::Detokenizer;
use super::executor::{Executor, ModelExecutor, Next};
use super::sampling::{Sampled, Sampler};
use super::types::{FinishReason, GenerateEvent, GenerateRequest, Load, TokenOut, Usage};
use crate::kv::{BlockPool, KvEvent, KvStorage, PoolUsage, hash};
use crate::model::{Llama, Logits, SeqChunk, Tokenizer};
use crate::transfer::{
    DIRECT_GRACE, DIRECT_MARGIN, DirectTarget, KvDtype, KvExport, KvLayout, KvShare, convert,
    unix_ms,
};

/// Sizes of the engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub kv_blocks: u32,
    /// Tokens one step may feed (decode tokens plus prefill chunks).
    pub step_tokens: usize,
    /// Sequences running at once (waiting for KV from a prefill worker counts).
    pub max_running: usize,
    /// How long a `remote_prefill` request waits for its KV once admitted.
    pub kv_wait: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_blocks: 512,
            step_tokens: 256,
            max_running: 16,
            kv_wait: Duration::from_secs(30),
        }
    }
}

/// A KV event with the worker's sequence number (1, 2, ...; a gap means lost
/// events, and the listener should resync from a snapshot). On the wire one
/// flat object, `{"seq":7,"type":"stored","hashes":[..],"parent":..}`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "NumberedKvEventWire", into = "NumberedKvEventWire")]
pub struct NumberedKvEvent {
    pub seq: u64,
    pub event: KvEvent,
}

/// [`NumberedKvEvent`]'s wire form as one struct: what `#[serde(flatten)]` of
/// the tagged event wrote, read without flatten's buffering of every field
/// (the gateway reads one of these for every request a worker serves).
#[derive(serde::Serialize, serde::Deserialize)]
struct NumberedKvEventWire {
    seq: u64,
    #[serde(rename = "type")]
    kind: KvEventKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hashes: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    parent: Option<u64>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum KvEventKind {
    Stored,
    Removed,
    AllCleared,
}

impl TryFrom<NumberedKvEventWire> for NumberedKvEvent {
    type Error = &'static str;

    fn try_from(w: NumberedKvEventWire) -> Result<Self, Self::Error> {
        let event = match (w.kind, w.hashes) {
            (KvEventKind::Stored, Some(hashes)) => KvEvent::Stored {
                hashes,
                parent: w.parent,
            },
            (KvEventKind::Removed, Some(hashes)) => KvEvent::Removed { hashes },
            (KvEventKind::AllCleared, _) => KvEvent::AllCleared,
            (_, None) => return Err("missing field `hashes`"),
        };
        Ok(NumberedKvEvent { seq: w.seq, event })
    }
}

impl From<NumberedKvEvent> for NumberedKvEventWire {
    fn from(e: NumberedKvEvent) -> Self {
        let (kind, hashes, parent) = match e.event {
            KvEvent::Stored { hashes, parent } => (KvEventKind::Stored, Some(hashes), parent),
            KvEvent::Removed { hashes } => (KvEventKind::Removed, Some(hashes), None),
            KvEvent::AllCleared => (KvEventKind::AllCleared, None, None),
        };
        NumberedKvEventWire {
            seq: e.seq,
            kind,
            hashes,
            parent,
        }
    }
}

/// A `remote_prefill` request whose blocks are reserved ([`Engine::reserve_kv`]).
#[derive(Debug)]
pub struct Reservation {
    /// The request's events from here on (tokens once its KV has landed).
    pub events: tmpsc::UnboundedReceiver<GenerateEvent>,
    /// The transfer handle (the request's id).
    pub handle: u64,
    /// The first block a prefill worker sends (earlier ones are cached here).
    pub from_block: u32,
    /// Blocks to send; 0 = the whole prompt is cached here.
    pub blocks: u32,
}

/// One step of a transfer into a `remote_prefill` request's reserved blocks
/// (what the transport's receiving end passes on).
#[derive(Debug)]
pub enum KvIntake {
    /// A sender connected: its layout must match this worker's.
    Begin(KvLayout),
    /// The next blocks, in order, in the sender's dtype.
    Blocks {
        first_block: u32,
        n_blocks: u32,
        data: Vec<u8>,
        dtype: KvDtype,
    },
    /// The next blocks, in order, copied into their reserved pages by the
    /// sender itself (a direct transfer: the pages were handed out with
    /// [`Engine::direct_pages`]).
    Landed { first_block: u32, n_blocks: u32 },
    /// Every block was sent: the request starts decoding.
    Done { blocks: u32 },
    /// The transfer broke: the request fails and its blocks are released.
    Abort(String),
}

/// Where a prefill-only request's finished blocks go: from block
/// `from_block` on, as [`KvExport`]s on `out`, and first copied straight into
/// the decode worker's cache where `direct` names it.
#[derive(Debug)]
struct ExportTo {
    from_block: u32,
    out: tmpsc::UnboundedSender<KvExport>,
    direct: Option<DirectTarget>,
}

enum Command {
    Submit {
        id: u64,
        request: GenerateRequest,
        out: tmpsc::UnboundedSender<GenerateEvent>,
        /// Prefill only: where finished blocks go.
        export: Option<Box<ExportTo>>,
    },
    /// The reserved pages of an import, for a direct transfer.
    Pages {
        handle: u64,
        reply: tokio::sync::oneshot::Sender<Result<DirectTarget, String>>,
    },
    Kv {
        handle: u64,
        intake: KvIntake,
        reply: tokio::sync::oneshot::Sender<Result<(), String>>,
    },
    Cancel(u64),
    /// Answer (last event number, every cached block hash), taken between
    /// steps, so that it covers exactly the events sent so far.
    Snapshot(tokio::sync::oneshot::Sender<(u64, Vec<u64>)>),
}

/// The handle the server holds: submit requests, read the load, follow events.
#[derive(Debug)]
pub struct Engine {
    commands: Mutex<mpsc::Sender<Command>>,
    load: Arc<Mutex<Load>>,
    kv_events: broadcast::Sender<NumberedKvEvent>,
    next_id: AtomicU64,
    pub config: EngineConfig,
    /// The longest sequence (prompt plus output) the executor runs.
    pub context: usize,
    pub vocab: usize,
    pub tokenizer: Arc<Tokenizer>,
    /// How this engine's KV blocks look on the wire.
    pub kv_layout: KvLayout,
    /// Its cache as other processes of the node may write into it (direct
    /// transfers), where the executor allows that.
    pub kv_share: Option<KvShare>,
}

impl Engine {
    /// Starts the engine thread over the model's forward pass.
    pub fn start(model: Arc<Llama>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Engine {
        let c = &model.config;
        let storage = KvStorage::new(
            c.n_layers,
            config.kv_blocks as usize,
            config.block_size,
            c.kv_dim(),
        );
        Self::start_with(
            Box::new(ModelExecutor { model, storage }),
            tokenizer,
            config,
        )
    }

    /// Starts the engine thread over any executor (the simulator's, say).
    pub fn start_with(
        executor: Box<dyn Executor>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
    ) -> Engine {
        let (tx, rx) = mpsc::channel();
        let load = Arc::new(Mutex::new(Load {
            kv_blocks_total: config.kv_blocks,
            ..Load::default()
        }));
        let (kv_events, _) = broadcast::channel(4096);
        let (context, vocab) = (executor.context(), executor.vocab());
        let kv_layout = executor.kv_layout();
        let kv_share = executor.kv_share();
        let core = Core {
            pool: BlockPool::new(config.kv_blocks),
            executor,
            waiting: VecDeque::new(),
            running: Vec::new(),
            receiving: Vec::new(),
            held: Vec::new(),
            commands: rx,
            load: load.clone(),
            kv_events: kv_events.clone(),
            event_seq: 0,
            context,
            vocab,
            tokenizer: tokenizer.clone(),
            config: config.clone(),
            started: Instant::now(),
        };
        std::thread::Builder::new()
            .name("sluice-engine".into())
            .spawn(move || core.run())
            .expect("spawn the engine thread");
        Engine {
            commands: Mutex::new(tx),
            load,
            kv_events,
            next_id: AtomicU64::new(1),
            config,
            context,
            vocab,
            tokenizer,
            kv_layout,
            kv_share,
        }
    }

    /// Queues a request; events arrive on the returned receiver. Dropping the
    /// receiver cancels the request.
    pub fn submit(
        &self,
        request: GenerateRequest,
    ) -> (u64, tmpsc::UnboundedReceiver<GenerateEvent>) {
        self.submit_as(request, None)
    }

    /// Queues a prefill-only request (a prefill worker's half of a
    /// disaggregated request): the prompt without its last token is
    /// prefilled, and the blocks from `from_block` on come out on the second
    /// receiver as each step finishes them. Events: `started`, then
    /// `finished` (no tokens) once every block has been handed over, or
    /// `error`. Dropping either receiver cancels the request. With `direct`
    /// (a decode worker's pages on this node, from [`KvTransport::direct`](
    /// crate::transfer::KvTransport::direct)) each step's blocks are first
    /// copied into those pages and come out `in_place`; a copy that fails
    /// is logged and the request's blocks go as bytes from then on.
    pub fn submit_prefill(
        &self,
        request: GenerateRequest,
        from_block: u32,
        direct: Option<DirectTarget>,
    ) -> (
        u64,
        tmpsc::UnboundedReceiver<GenerateEvent>,
        tmpsc::UnboundedReceiver<KvExport>,
    ) {
        let (out, kv_rx) = tmpsc::unbounded_channel();
        let export = ExportTo {
            from_block,
            out,
            direct,
        };
        let (id, rx) = self.submit_as(request, Some(Box::new(export)));
        (id, rx, kv_rx)
    }

    /// The reserved pages of the `remote_prefill` request `handle` and this
    /// engine's shared cache: where a prefill worker on this node may copy
    /// its blocks (the import then takes [`KvIntake::Landed`] as well as
    /// bytes). An error where the cache is not shared or no such request
    /// waits.
    pub async fn direct_pages(&self, handle: u64) -> Result<DirectTarget, String> {
        self.ask(|reply| Command::Pages { handle, reply }).await
    }

    fn submit_as(
        &self,
        request: GenerateRequest,
        export: Option<Box<ExportTo>>,
    ) -> (u64, tmpsc::UnboundedReceiver<GenerateEvent>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (out, rx) = tmpsc::unbounded_channel();
        let commands = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        if commands
            .send(Command::Submit {
                id,
                request,
                out: out.clone(),
                export,
            })
            .is_err()
        {
            let _ = out.send(GenerateEvent::Error {
                message: "the engine has stopped".into(),
                status: Some(503),
            });
        }
        (id, rx)
    }

    /// Passes one step of a KV transfer to the request `handle` (the id its
    /// `awaiting_kv` event named); resolves once the engine has applied it.
    /// Any error fails that request and releases its blocks.
    pub async fn receive_kv(&self, handle: u64, intake: KvIntake) -> Result<(), String> {
        self.ask(|reply| Command::Kv {
            handle,
            intake,
            reply,
        })
        .await
    }

    /// Sends the command `make` builds around a reply channel and waits for
    /// the engine's answer.
    async fn ask<T>(
        &self,
        make: impl FnOnce(tokio::sync::oneshot::Sender<Result<T, String>>) -> Command,
    ) -> Result<T, String> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        {
            let commands = self.commands.lock().unwrap_or_else(|e| e.into_inner());
            commands
                .send(make(reply))
                .map_err(|_| "the engine has stopped".to_string())?;
        }
        answer
            .await
            .unwrap_or_else(|_| Err("the engine has stopped".into()))
    }

    /// Queues `request` as a `remote_prefill` request and waits until its
    /// blocks are reserved: its events (from after `awaiting_kv`) and the
    /// reservation, or the error the engine answered instead.
    pub async fn reserve_kv(&self, request: GenerateRequest) -> Result<Reservation, String> {
        let (_, mut events) = self.submit(GenerateRequest {
            remote_prefill: true,
            ..request
        });
        while let Some(event) = events.recv().await {
            match event {
                GenerateEvent::AwaitingKv {
                    handle,
                    from_block,
                    blocks,
                    ..
                } => {
                    return Ok(Reservation {
                        events,
                        handle,
                        from_block,
                        blocks,
                    });
                }
                GenerateEvent::Error { message, .. } => return Err(message),
                GenerateEvent::Started { .. } => {}
                other => return Err(format!("expected awaiting_kv, got {other:?}")),
            }
        }
        Err("the engine has stopped".into())
    }

    pub fn cancel(&self, id: u64) {
        let commands = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        let _ = commands.send(Command::Cancel(id));
    }

    pub fn load(&self) -> Load {
        *self.load.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Follows KV events from now on.
    pub fn subscribe_kv_events(&self) -> broadcast::Receiver<NumberedKvEvent> {
        self.kv_events.subscribe()
    }

    /// (last event sequence number, every cached block hash): a snapshot to
    /// resync from after a gap, taken by the engine between two steps (so
    /// it costs nothing until asked for). `(0, [])` if the engine stopped.
    pub async fn snapshot(&self) -> (u64, Vec<u64>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send_snapshot(tx);
        rx.await.unwrap_or_default()
    }

    /// [`Engine::snapshot`] for callers outside an async runtime.
    pub fn cached_snapshot(&self) -> (u64, Vec<u64>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send_snapshot(tx);
        rx.blocking_recv().unwrap_or_default()
    }

    fn send_snapshot(&self, tx: tokio::sync::oneshot::Sender<(u64, Vec<u64>)>) {
        let commands = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        let _ = commands.send(Command::Snapshot(tx));
    }
}

/// One request inside the engine.
struct Seq {
    id: u64,
    request: GenerateRequest,
    out: tmpsc::UnboundedSender<GenerateEvent>,
    /// Prompt followed by the generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose K and V are in the cache.
    computed: usize,
    blocks: Vec<u32>,
    /// Sequence hashes of the full blocks of `tokens`, as far as known.
    hashes: Vec<u64>,
    /// Leading blocks registered in the prefix cache.
    committed: usize,
    sampler: Sampler,
    detok: Detokenizer,
    cached_tokens: u32,
    started: bool,
    mode: Mode,
}

/// What a sequence does besides plain generation (disaggregation).
enum Mode {
    Generate,
    /// Prefill only: blocks from `next_block` on go out when finished
    /// (copied into `direct`'s pages first, where it is set).
    Export {
        next_block: usize,
        out: tmpsc::UnboundedSender<KvExport>,
        direct: Option<DirectTarget>,
    },
    /// Blocks `from_block..to_block` come from a prefill worker; `received`
    /// of them have landed. `direct`: its pages were handed out, so blocks
    /// may land without bytes.
    Import {
        from_block: usize,
        to_block: usize,
        received: usize,
        deadline: Instant,
        direct: bool,
    },
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Extends `hashes` to every full block of `tokens[..upto]`.
    fn hash_blocks(&mut self, block_size: usize, upto: usize) {
        while (self.hashes.len() + 1) * block_size <= upto {
            let i = self.hashes.len();
            let local = hash::local_hash(&self.tokens[i * block_size..(i + 1) * block_size]);
            let parent = match i {
                0 => (self.request.cache_salt != 0).then_some(self.request.cache_salt),
                _ => Some(self.hashes[i - 1]),
            };
            self.hashes
                .push(parent.map_or(local, |p| hash::chain(p, local)));
        }
    }

    fn send(&self, event: GenerateEvent) -> bool {
        self.out.send(event).is_ok()
    }

    /// When an import stops waiting for its KV.
    fn kv_deadline(&self) -> Option<Instant> {
        match self.mode {
            Mode::Import { deadline, .. } => Some(deadline),
            _ => None,
        }
    }
}

struct Core {
    pool: BlockPool,
    executor: Box<dyn Executor>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Admitted `remote_prefill` requests waiting for their KV.
    receiving: Vec<Seq>,
    /// Blocks of direct imports that failed or were cancelled, out of use
    /// until the time given: a prefill worker may still be copying into
    /// them (`DirectTarget::expires_unix_ms`).
    held: Vec<(Vec<u32>, Instant)>,
    commands: mpsc::Receiver<Command>,
    load: Arc<Mutex<Load>>,
    kv_events: broadcast::Sender<NumberedKvEvent>,
    event_seq: u64,
    context: usize,
    vocab: usize,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    started: Instant,
}

impl Core {
    fn run(mut self) {
        loop {
            // Block only when idle (until the next KV deadline, if a request
            // waits for KV); otherwise take what has arrived.
            if self.waiting.is_empty() && self.running.is_empty() {
                // Every 50 ms at most while a request waits for KV, to notice a
                // client that went away (its blocks are then released).
                let deadline = self
                    .receiving
                    .iter()
                    .filter_map(Seq::kv_deadline)
                    .chain(self.held.iter().map(|h| h.1))
                    .min()
                    .map(|d| d.min(Instant::now() + Duration::from_millis(50)));
                let next = match deadline {
                    None => self.commands.recv().map_err(|_| true),
                    Some(d) => self
                        .commands
                        .recv_timeout(d.saturating_duration_since(Instant::now()))
                        .map_err(|e| e == mpsc::RecvTimeoutError::Disconnected),
                };
                match next {
                    Ok(c) => self.command(c),
                    Err(true) => return, // every handle is gone
                    Err(false) => {}     // a deadline: `step` fails the late ones
                }
            }
            loop {
                match self.commands.try_recv() {
                    Ok(c) => self.command(c),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        if self.waiting.is_empty()
                            && self.running.is_empty()
                            && self.receiving.is_empty()
                        {
                            return;
                        }
                        break;
                    }
                }
            }
            self.step();
            self.publish();
        }
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Submit {
                id,
                mut request,
                out,
                export,
            } => {
                let blocks_needed = (request.prompt.len() + 1).div_ceil(self.config.block_size);
                let problem = if request.prompt.is_empty() {
                    Some("the prompt is empty".to_string())
                } else if export.is_some() && request.prompt.len() < 2 {
                    Some("a prefill-only request needs at least two prompt tokens".to_string())
                } else if export.is_some() && request.remote_prefill {
                    Some("a request cannot both prefill for another worker and wait for one".into())
                } else if request.prompt.len() >= self.context {
                    Some(format!(
                        "the prompt has {} tokens; this model's context is {}",
                        request.prompt.len(),
                        self.context
                    ))
                } else if blocks_needed > self.config.kv_blocks as usize {
                    Some(format!(
                        "the prompt needs {blocks_needed} KV blocks; this worker has {}",
                        self.config.kv_blocks
                    ))
                } else if let Some(&bad) =
                    request.prompt.iter().find(|&&t| t as usize >= self.vocab)
                {
                    Some(format!(
                        "token id {bad} is outside the vocabulary ({})",
                        self.vocab
                    ))
                } else {
                    request.sampling.validate().err()
                };
                if let Some(message) = problem {
                    let _ = out.send(GenerateEvent::Error {
                        message,
                        status: None,
                    });
                    return;
                }
                let seed = request
                    .sampling
                    .seed
                    .unwrap_or(id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let mut stop_ids = request.stop_ids.clone();
                if !request.ignore_eos {
                    stop_ids.extend(&self.tokenizer.stop_ids);
                }
                // An export prefills all but the last prompt token: the
                // decode worker runs that one and samples.
                let mode = match export.map(|e| *e) {
                    Some(ExportTo {
                        from_block,
                        out,
                        direct,
                    }) => {
                        request.prompt.pop();
                        Mode::Export {
                            next_block: from_block as usize,
                            out,
                            direct,
                        }
                    }
                    None => Mode::Generate,
                };
                let prompt_len = request.prompt.len();
                let seq = Seq {
                    mode,
                    id,
                    tokens: request.prompt.clone(),
                    prompt_len,
                    computed: 0,
                    blocks: Vec::new(),
                    hashes: Vec::new(),
                    committed: 0,
                    sampler: Sampler::new(request.sampling.clone(), seed),
                    detok: Detokenizer::new(request.stop_strings.clone()),
                    cached_tokens: 0,
                    started: false,
                    request: GenerateRequest {
                        stop_ids,
                        ..request
                    },
                    out,
                };
                self.waiting.push_back(seq);
            }
            Command::Kv {
                handle,
                intake,
                reply,
            } => {
                let _ = reply.send(self.receive_kv(handle, intake));
            }
            Command::Pages { handle, reply } => {
                let _ = reply.send(self.direct_pages(handle));
            }
            Command::Snapshot(reply) => {
                let _ = reply.send((self.event_seq, self.pool.cached_hashes()));
            }
            Command::Cancel(id) => {
                if let Some(i) = self.running.iter().position(|s| s.id == id) {
                    let seq = self.running.remove(i);
                    self.finish(seq, FinishReason::Cancelled);
                } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
                    let seq = self.waiting.remove(i).expect("index found");
                    self.finish(seq, FinishReason::Cancelled);
                } else if let Some(i) = self.receiving.iter().position(|s| s.id == id) {
                    let seq = self.end_import(i);
                    self.finish(seq, FinishReason::Cancelled);
                }
            }
        }
    }

    /// The pages an import's blocks go to, for a direct transfer; from then
    /// on the import takes blocks that landed without bytes.
    fn direct_pages(&mut self, handle: u64) -> Result<DirectTarget, String> {
        let Some(share) = self.executor.kv_share() else {
            return Err("this worker's KV cache cannot be written by other processes".into());
        };
        let seq = self
            .receiving
            .iter_mut()
            .find(|s| s.id == handle)
            .ok_or_else(|| no_import(handle))?;
        let Mode::Import {
            from_block,
            to_block,
            received,
            direct,
            deadline,
        } = &mut seq.mode
        else {
            unreachable!("only imports wait in `receiving`");
        };
        if *received > 0 {
            return Err("the transfer into this request has begun already".into());
        }
        *direct = true;
        let left = deadline.saturating_duration_since(Instant::now());
        Ok(DirectTarget {
            share,
            from_block: *from_block as u32,
            pages: seq.blocks[*from_block..*to_block].to_vec(),
            expires_unix_ms: unix_ms() + left.as_millis() as u64,
        })
    }

    /// Applies one step of a transfer into a receiving request; on any
    /// error the request fails and its blocks are released.
    fn receive_kv(&mut self, handle: u64, intake: KvIntake) -> Result<(), String> {
        let Some(i) = self.receiving.iter().position(|s| s.id == handle) else {
            return Err(no_import(handle));
        };
        let ours = self.executor.kv_layout();
        let seq = &mut self.receiving[i];
        let Mode::Import {
            from_block,
            to_block,
            received,
            direct,
            ..
        } = &mut seq.mode
        else {
            unreachable!("only imports wait in `receiving`");
        };
        // Blocks `first..first + n` are next and inside the reservation.
        let (from, to) = (*from_block, *to_block);
        let in_order = |first: usize, n: usize, received: usize| {
            let expected = from + received;
            if first != expected {
                Err(format!(
                    "block {first} arrived where block {expected} was due"
                ))
            } else if first + n > to {
                Err(format!(
                    "blocks {first}..{} go past the reservation's end, block {to}",
                    first + n
                ))
            } else {
                Ok(())
            }
        };
        let result = match intake {
            KvIntake::Begin(theirs) => ours.mismatch(&theirs).map_or(Ok(()), Err),
            KvIntake::Blocks {
                first_block,
                n_blocks,
                data,
                dtype,
            } => {
                let (first, n) = (first_block as usize, n_blocks as usize);
                let bytes = n * KvLayout { dtype, ..ours }.block_bytes();
                if let Err(e) = in_order(first, n, *received) {
                    Err(e)
                } else if data.len() != bytes {
                    Err(format!(
                        "{n} blocks came as {} bytes; they take {bytes}",
                        data.len()
                    ))
                } else {
                    // Converted only between unlike caches (a CPU prefill
                    // worker and a GPU decode worker).
                    let data = if dtype == ours.dtype {
                        data
                    } else {
                        convert(&data, dtype, ours.dtype)
                    };
                    self.executor.write_kv(&seq.blocks[first..first + n], &data);
                    *received += n;
                    Ok(())
                }
            }
            KvIntake::Landed {
                first_block,
                n_blocks,
            } => {
                let (first, n) = (first_block as usize, n_blocks as usize);
                if !*direct {
                    Err(
                        "blocks landed in place, but this request's pages were never handed out"
                            .into(),
                    )
                } else {
                    in_order(first, n, *received).map(|()| *received += n)
                }
            }
            KvIntake::Done { blocks } => {
                let wanted = *to_block - *from_block;
                if *received == wanted && blocks as usize == wanted {
                    let mut seq = self.receiving.remove(i);
                    seq.computed = seq.tokens.len() - 1;
                    seq.mode = Mode::Generate;
                    self.running.push(seq);
                    return Ok(());
                }
                Err(format!(
                    "the transfer ended after {received} of {wanted} blocks (the sender counted {blocks})"
                ))
            }
            KvIntake::Abort(reason) => Err(reason),
        };
        if let Err(e) = &result {
            let seq = self.end_import(i);
            self.fail(seq, format!("the KV transfer failed: {e}"), 503);
        }
        result
    }

    /// Takes `receiving[i]` out before it fails or is cancelled; a direct
    /// import's blocks go to `held` instead of back with the sequence (the
    /// sender may still be copying into them).
    fn end_import(&mut self, i: usize) -> Seq {
        let mut seq = self.receiving.remove(i);
        if let Mode::Import {
            direct: true,
            deadline,
            ..
        } = seq.mode
        {
            self.held
                .push((std::mem::take(&mut seq.blocks), deadline + DIRECT_GRACE));
        }
        seq
    }

    /// Releases a sequence's blocks and ends it with an error.
    fn fail(&mut self, mut seq: Seq, message: String, status: u16) {
        tracing::warn!(request = seq.id, %message, "request failed");
        self.pool.release(&seq.blocks);
        seq.blocks.clear();
        seq.send(GenerateEvent::Error {
            message,
            status: Some(status),
        });
    }

    /// Sends the blocks of `running[i]` (an export) that are finished now;
    /// false if nobody takes them any more.
    fn export_ready(&mut self, i: usize) -> bool {
        let bs = self.config.block_size;
        let seq = &mut self.running[i];
        let Mode::Export {
            next_block,
            out,
            direct,
        } = &mut seq.mode
        else {
            return true;
        };
        let ready = if seq.computed == seq.tokens.len() {
            seq.tokens.len().div_ceil(bs)
        } else {
            seq.computed / bs
        };
        if ready <= *next_block {
            return true;
        }
        let blocks = &seq.blocks[*next_block..ready];
        let mut in_place = false;
        if let Some(target) = direct {
            let offset = *next_block - target.from_block as usize;
            let late = unix_ms() + DIRECT_MARGIN.as_millis() as u64 >= target.expires_unix_ms;
            let copied = if late {
                Err("the reservation's deadline is too close".to_string())
            } else {
                self.executor.copy_kv_into(target, offset, blocks)
            };
            match copied {
                Ok(()) => in_place = true,
                Err(e) => {
                    tracing::warn!(
                        request = seq.id,
                        error = %e,
                        "cannot copy KV into the decode worker's cache; sending bytes"
                    );
                    *direct = None;
                }
            }
        }
        let data = if in_place {
            Vec::new()
        } else {
            self.executor.read_kv(blocks)
        };
        let sent = out.send(KvExport {
            first_block: *next_block as u32,
            n_blocks: (ready - *next_block) as u32,
            data,
            in_place,
        });
        *next_block = ready;
        sent.is_ok()
    }

    /// Exports that have prefilled everything hand over their last blocks
    /// and finish.
    fn finish_exports(&mut self) {
        let mut i = self.running.len();
        while i > 0 {
            i -= 1;
            let seq = &self.running[i];
            if !matches!(seq.mode, Mode::Export { .. }) {
                continue;
            }
            let complete = seq.computed == seq.tokens.len();
            if !self.export_ready(i) {
                let seq = self.running.remove(i);
                self.finish(seq, FinishReason::Cancelled);
            } else if complete {
                let seq = self.running.remove(i);
                self.finish(seq, FinishReason::Stop);
            }
        }
    }

    /// Releases a sequence's blocks and sends its last event.
    fn finish(&mut self, mut seq: Seq, reason: FinishReason) {
        self.pool.release(&seq.blocks);
        seq.blocks.clear();
        let text = seq.detok.flush();
        let usage = Usage {
            prompt_tokens: seq.prompt_len as u32,
            completion_tokens: seq.generated() as u32,
            cached_tokens: seq.cached_tokens,
        };
        seq.send(GenerateEvent::Finished {
            reason,
            text,
            usage,
        });
    }

    /// Sends the youngest running sequence back to the front of the queue,
    /// freeing its blocks; it is recomputed when it runs again.
    fn preempt_youngest(&mut self) -> bool {
        let Some(mut seq) = self.running.pop() else {
            return false;
        };
        self.pool.release(&seq.blocks);
        seq.blocks.clear();
        seq.computed = 0;
        seq.committed = 0;
        self.waiting.push_front(seq);
        true
    }

    /// Admits the front of the queue if its blocks can be had.
    fn admit(&mut self) -> bool {
        let bs = self.config.block_size;
        let Some(seq) = self.waiting.front_mut() else {
            return false;
        };
        seq.hash_blocks(bs, seq.tokens.len());
        let n_blocks = seq.tokens.len().div_ceil(bs);
        let Some(alloc) = self.pool.allocate(&seq.hashes, n_blocks) else {
            return false;
        };
        let mut seq = self.waiting.pop_front().expect("front exists");
        // At least the last token is fed, to get its logits (an export wants
        // no logits: it may be cached whole).
        let most = match seq.mode {
            Mode::Export { .. } => seq.tokens.len(),
            _ => seq.tokens.len() - 1,
        };
        seq.computed = (alloc.cached_blocks * bs).min(most);
        seq.committed = alloc.cached_blocks;
        seq.blocks = alloc.blocks;
        if !seq.started {
            seq.started = true;
            seq.cached_tokens = seq.computed as u32;
            let ok = seq.send(GenerateEvent::Started {
                prompt_tokens: seq.prompt_len as u32,
                cached_tokens: seq.cached_tokens,
            });
            if !ok {
                self.finish(seq, FinishReason::Cancelled);
                return true;
            }
            if seq.request.remote_prefill {
                // Blocks from the cached prefix up to the last prompt token
                // come from the prefill worker; the rest is computed here.
                let (from, to) = (seq.computed, seq.tokens.len() - 1);
                let (from_block, to_block) = (from / bs, to.div_ceil(bs));
                let blocks = if from < to { to_block - from_block } else { 0 };
                let ok = seq.send(GenerateEvent::AwaitingKv {
                    handle: seq.id,
                    from_block: from_block as u32,
                    blocks: blocks as u32,
                    addr: String::new(),
                });
                if !ok {
                    self.finish(seq, FinishReason::Cancelled);
                } else if blocks > 0 {
                    seq.mode = Mode::Import {
                        from_block,
                        to_block,
                        received: 0,
                        deadline: Instant::now() + self.config.kv_wait,
                        direct: false,
                    };
                    self.receiving.push(seq);
                } else {
                    self.running.push(seq);
                }
                return true;
            }
        }
        self.running.push(seq);
        true
    }

    fn step(&mut self) {
        let bs = self.config.block_size;
        self.pool
            .set_now_ms(self.started.elapsed().as_millis() as u64);
        // Requests whose client went away stop here.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].out.is_closed() {
                let seq = self.running.remove(i);
                self.finish(seq, FinishReason::Cancelled);
            } else {
                i += 1;
            }
        }
        self.waiting.retain(|s| !s.out.is_closed());
        let now = Instant::now();
        let (free, held): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| h.1 <= now);
        self.held = held;
        for (blocks, _) in free {
            self.pool.release(&blocks);
        }
        let mut i = 0;
        while i < self.receiving.len() {
            let seq = &self.receiving[i];
            if seq.out.is_closed() {
                let seq = self.end_import(i);
                self.finish(seq, FinishReason::Cancelled);
            } else if seq.kv_deadline().is_some_and(|d| d <= now) {
                let seq = self.end_import(i);
                let wait = self.config.kv_wait;
                self.fail(
                    seq,
                    format!("no KV arrived from the prefill worker within {wait:?}"),
                    504,
                );
            } else {
                i += 1;
            }
        }

        // Admit while there is room; running sequences come first.
        while self.running.len() + self.receiving.len() < self.config.max_running && self.admit() {}
        self.finish_exports();

        // Plan: (running index, tokens to feed), within the step budget; make
        // room for decode growth, preempting the youngest if blocks run out.
        let mut budget = self.config.step_tokens;
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let take = (seq.tokens.len() - seq.computed).min(budget);
            let needed_blocks = (seq.computed + take).div_ceil(bs);
            let mut preempted_self = false;
            while self.running[i].blocks.len() < needed_blocks {
                match self.pool.append() {
                    Some(b) => self.running[i].blocks.push(b),
                    None => {
                        let last = self.running.len() - 1;
                        self.preempt_youngest();
                        if last == i {
                            preempted_self = true;
                            break;
                        }
                    }
                }
            }
            if preempted_self {
                break;
            }
            plan.push((i, take));
            budget -= take;
            i += 1;
        }
        if plan.is_empty() {
            return;
        }

        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|&(i, take)| {
                let s = &self.running[i];
                SeqChunk {
                    tokens: &s.tokens[s.computed..s.computed + take],
                    start: s.computed,
                    block_table: &s.blocks,
                    logits: if s.computed + take == s.tokens.len()
                        && !matches!(s.mode, Mode::Export { .. })
                    {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                }
            })
            .collect();
        let outputs = self.executor.run(&chunks);
        drop(chunks);

        let mut done: Vec<(usize, FinishReason)> = Vec::new();
        for (&(i, take), next) in plan.iter().zip(outputs) {
            let context = self.context;
            let seq = &mut self.running[i];
            seq.computed += take;
            // Full blocks become reusable by later requests.
            seq.hash_blocks(bs, seq.computed);
            // Only blocks whose K and V are computed (admission hashed the
            // whole prompt; chunked prefill computes it step by step).
            while seq.committed < seq.hashes.len() && (seq.committed + 1) * bs <= seq.computed {
                let k = seq.committed;
                let parent = if k == 0 {
                    None
                } else {
                    Some(seq.hashes[k - 1])
                };
                self.pool.commit(
                    seq.blocks[k],
                    seq.hashes[k],
                    parent,
                    seq.request.cache_priority,
                    seq.request.tenant_id,
                );
                seq.committed += 1;
            }
            let sampled = match next {
                Next::Pending => continue, // a prefill chunk that is not the prompt's last
                Next::Logits(mut logits) => seq.sampler.sample(&mut logits),
                Next::Token(token) => Sampled {
                    token,
                    logprob: 0.0,
                    top: Vec::new(),
                },
            };
            let (text, stopped) = seq.detok.push(&self.tokenizer, sampled.token);
            let is_stop_id = seq.request.stop_ids.contains(&sampled.token);
            if !is_stop_id {
                seq.tokens.push(sampled.token);
                let top = sampled
                    .top
                    .iter()
                    .map(|&(id, lp)| {
                        (
                            id,
                            self.tokenizer.decode(&[id], false).unwrap_or_default(),
                            lp,
                        )
                    })
                    .collect();
                let ok = seq.send(GenerateEvent::Token(TokenOut {
                    id: sampled.token,
                    text,
                    logprob: sampled.logprob,
                    top,
                }));
                if !ok {
                    done.push((i, FinishReason::Cancelled));
                    continue;
                }
            }
            if is_stop_id || stopped {
                done.push((i, FinishReason::Stop));
            } else if seq.generated() >= seq.request.max_tokens as usize
                || seq.tokens.len() >= context
            {
                done.push((i, FinishReason::Length));
            }
        }
        // Remove finished sequences, highest index first.
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (i, reason) in done {
            let seq = self.running.remove(i);
            self.finish(seq, reason);
        }
        self.finish_exports();
    }

    /// Publishes KV events and the load after a step.
    fn publish(&mut self) {
        for event in self.pool.drain_events() {
            self.event_seq += 1;
            let _ = self.kv_events.send(NumberedKvEvent {
                seq: self.event_seq,
                event,
            });
        }
        let PoolUsage { used, total, .. } = self.pool.usage();
        let queued: usize = self
            .waiting
            .iter()
            .map(|s| s.tokens.len())
            .chain(self.running.iter().map(|s| s.tokens.len() - s.computed))
            .sum();
        *self.load.lock().unwrap_or_else(|e| e.into_inner()) = Load {
            active_requests: (self.running.len() + self.receiving.len()) as u32,
            waiting_requests: self.waiting.len() as u32,
            queued_prefill_tokens: queued as u32,
            kv_blocks_used: used,
            kv_blocks_total: total,
        };
    }
}

fn no_import(handle: u64) -> String {
    format!(
        "no request here is waiting for KV under handle {handle} (finished, cancelled or timed out)"
    )
}

#[cfg(test)]
mod kv_event_wire_tests {
    use super::{KvEvent, NumberedKvEvent};

    fn read(text: &str) -> Result<NumberedKvEvent, serde_json::Error> {
        serde_json::from_str(text)
    }

    #[test]
    fn kv_events_read_as_the_flattened_form_wrote_them() {
        // What `#[serde(flatten)]` over the tagged enum wrote (parent null
        // included), and fields in any order, unknown ones ignored.
        assert_eq!(
            read(r#"{"seq":3,"type":"stored","hashes":[1,18446744073709551615],"parent":null}"#)
                .unwrap(),
            NumberedKvEvent {
                seq: 3,
                event: KvEvent::Stored {
                    hashes: vec![1, u64::MAX],
                    parent: None
                }
            }
        );
        assert_eq!(
            read(r#"{"parent":9,"hashes":[],"type":"stored","seq":4,"extra":{"a":[1]}}"#).unwrap(),
            NumberedKvEvent {
                seq: 4,
                event: KvEvent::Stored {
                    hashes: vec![],
                    parent: Some(9)
                }
            }
        );
        assert_eq!(
            read(r#"{"seq":5,"type":"removed","hashes":[7]}"#)
                .unwrap()
                .event,
            KvEvent::Removed { hashes: vec![7] }
        );
        assert_eq!(
            read(r#"{"seq":6,"type":"all_cleared"}"#).unwrap().event,
            KvEvent::AllCleared
        );
        for bad in [
            r#"{"seq":1,"type":"stored"}"#,
            r#"{"seq":1,"type":"removed","parent":2}"#,
            r#"{"seq":1,"type":"evicted","hashes":[]}"#,
            r#"{"type":"all_cleared"}"#,
            r#"{"seq":-1,"type":"all_cleared"}"#,
            r#"{"seq":1,"type":"stored","hashes":[1.5]}"#,
        ] {
            assert!(read(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn kv_events_round_trip() {
        for event in [
            KvEvent::Stored {
                hashes: vec![0, 42, u64::MAX],
                parent: Some(u64::MAX - 1),
            },
            KvEvent::Stored {
                hashes: vec![5],
                parent: None,
            },
            KvEvent::Removed { hashes: vec![3, 2] },
            KvEvent::AllCleared,
        ] {
            let numbered = NumberedKvEvent { seq: 77, event };
            let text = serde_json::to_string(&numbered).unwrap();
            assert!(text.starts_with(r#"{"seq":77,"type":""#), "{text}");
            assert_eq!(read(&text).unwrap(), numbered, "{text}");
        }
    }
}
