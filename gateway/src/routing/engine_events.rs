//! KV events of OpenAI-compatible engines (vLLM, SGLang) into the KV index.
//!
//! Both publish on a ZMQ PUB socket: frames `[topic, seq (u64 big-endian),
//! msgpack batch]`, a batch being `[ts, [events], dp_rank]` and an event
//! `BlockStored` / `BlockRemoved` / `AllBlocksCleared` (vLLM writes events as
//! maps with a `type` key since mid-2026, before that, as SGLang still does,
//! as arrays with the tag first; block hashes are u64, i64 or bytes). Their
//! hashes are not ours, so each stored block's hash is computed here from
//! its token ids (`kv::hash`, chained to its parent's) and the engine's
//! hash mapped to it; removals go through that map.
//!
//! Sequence numbers tell what was missed. After a gap, a reconnect or a
//! restart, the missed batches are asked of the publisher's replay socket
//! (ROUTER: send `["", seq]`, get `["", (topic,) seq, batch]`… then seq -1);
//! when the history cannot be completed, the worker falls back to
//! approximate mode (predictions from routing, `approx`) until it can.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use rmpv::Value;
use sluice_backend::kv::hash::{chain, local_hash};
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::fleet::{Fleet, Worker};

/// One engine event, in a form both engines' encodings decode to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    Stored {
        /// The engine's hashes of the blocks, in order.
        hashes: Vec<u64>,
        /// The engine's hash of the first block's parent; none = the
        /// prompt's first block.
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    },
    Removed {
        hashes: Vec<u64>,
    },
    AllCleared,
}

/// One published batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank that published it, when it says.
    pub dp_rank: Option<u32>,
}

/// Decodes a msgpack batch (either encoding). Events on other media than
/// the GPU (offloaded to CPU or disk) and unknown event types are left out.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, String> {
    let value = rmpv::decode::read_value_with_max_depth(&mut &payload[..], 16)
        .map_err(|e| format!("not msgpack: {e}"))?;
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (
            field(&value, "ts"),
            field(&value, "events"),
            field(&value, "data_parallel_rank").or_else(|| field(&value, "attn_dp_rank")),
        ),
        _ => return Err("a batch is not an array or a map".into()),
    };
    let ts = ts.and_then(Value::as_f64).unwrap_or(0.0);
    let events = events
        .and_then(Value::as_array)
        .ok_or("a batch has no event list")?;
    let dp_rank = rank.and_then(Value::as_u64).map(|r| r as u32);
    let mut out = Vec::with_capacity(events.len());
    for event in events {
        if let Some(e) = decode_event(event)? {
            out.push(e);
        }
    }
    Ok(EventBatch {
        ts,
        events: out,
        dp_rank,
    })
}

fn field<'a>(map: &'a Value, name: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

/// An event's fields by name, from either encoding (positional names are
/// the engines' field order after the tag).
fn decode_event<'a>(event: &'a Value) -> Result<Option<EngineEvent>, String> {
    const STORED: [&str; 6] = [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ];
    const REMOVED: [&str; 2] = ["block_hashes", "medium"];
    type Get<'a> = Box<dyn Fn(&str) -> Option<&'a Value> + 'a>;
    let (tag, get): (&str, Get<'a>) = match event {
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or("an event has no tag")?;
            let names: &[&str] = match tag {
                "BlockStored" => &STORED,
                "BlockRemoved" => &REMOVED,
                _ => &[],
            };
            (
                tag,
                Box::new(move |name: &str| {
                    let i = names.iter().position(|n| *n == name)?;
                    items.get(i + 1)
                }),
            )
        }
        Value::Map(_) => (
            field(event, "type")
                .and_then(Value::as_str)
                .ok_or("an event has no type")?,
            Box::new(move |name: &str| field(event, name)),
        ),
        _ => return Err("an event is not an array or a map".into()),
    };
    // Blocks offloaded to CPU or disk are not in the engine's GPU cache.
    let on_gpu = match get("medium") {
        None | Some(Value::Nil) => true,
        Some(m) => m.as_str().is_some_and(|m| m.eq_ignore_ascii_case("gpu")),
    };
    let hashes = || -> Result<Vec<u64>, String> {
        get("block_hashes")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("{tag} has no block_hashes"))?
            .iter()
            .map(|h| engine_hash(h).ok_or_else(|| format!("{tag}: bad block hash {h}")))
            .collect()
    };
    Ok(match tag {
        "BlockStored" if on_gpu => {
            let parent = match get("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(h) => Some(engine_hash(h).ok_or("BlockStored: bad parent hash")?),
            };
            let token_ids = get("token_ids")
                .and_then(Value::as_array)
                .ok_or("BlockStored has no token_ids")?
                .iter()
                .map(|t| {
                    t.as_u64()
                        .map(|t| t as u32)
                        .ok_or("BlockStored: bad token id")
                })
                .collect::<Result<Vec<u32>, _>>()?;
            let block_size = get("block_size")
                .and_then(Value::as_u64)
                .ok_or("BlockStored has no block_size")? as u32;
            Some(EngineEvent::Stored {
                hashes: hashes()?,
                parent,
                token_ids,
                block_size,
            })
        }
        "BlockRemoved" if on_gpu => Some(EngineEvent::Removed { hashes: hashes()? }),
        "AllBlocksCleared" => Some(EngineEvent::AllCleared),
        _ => None,
    })
}

/// An engine's block hash as a u64: vLLM's are u64 (or sha256 bytes with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`), SGLang's i64.
fn engine_hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|i| i as u64)),
        Value::Binary(b) => Some(xxhash_rust::xxh3::xxh3_64(b)),
        _ => None,
    }
}

/// One engine's blocks: its hashes mapped to ours. A block of equal tokens
/// may be stored twice by the engine (different LoRA or salt): ours is held
/// as long as any of its copies is.
#[derive(Debug, Default)]
pub struct EngineBlocks {
    ours: HashMap<u64, u64>,
    copies: HashMap<u64, u32>,
}

/// What applying an event changed in the index.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Change {
    pub stored: Vec<u64>,
    pub removed: Vec<u64>,
    pub cleared: bool,
}

impl EngineBlocks {
    /// Our hashes of every block held.
    pub fn our_hashes(&self) -> Vec<u64> {
        self.copies.keys().copied().collect()
    }

    pub fn clear(&mut self) {
        self.ours.clear();
        self.copies.clear();
    }

    /// Applies one event (idempotent: a block stored twice is one copy).
    /// Blocks of another size than `block_size`, or whose parent is unknown
    /// (stored before events were heard), are not indexed: they could not
    /// match a prompt's prefix here.
    pub fn apply(&mut self, event: &EngineEvent, block_size: u32) -> Change {
        let mut change = Change::default();
        match event {
            EngineEvent::Stored {
                hashes,
                parent,
                token_ids,
                block_size: size,
            } => {
                if *size != block_size {
                    return change;
                }
                let mut parent = match parent {
                    None => None,
                    Some(p) => match self.ours.get(p) {
                        Some(&ours) => Some(ours),
                        None => return change,
                    },
                };
                for (engine, tokens) in hashes.iter().zip(token_ids.chunks_exact(*size as usize)) {
                    let local = local_hash(tokens);
                    let ours = parent.map_or(local, |p| chain(p, local));
                    if self.ours.insert(*engine, ours).is_none() {
                        let n = self.copies.entry(ours).or_default();
                        *n += 1;
                        if *n == 1 {
                            change.stored.push(ours);
                        }
                    }
                    parent = Some(ours);
                }
            }
            EngineEvent::Removed { hashes } => {
                for engine in hashes {
                    let Some(ours) = self.ours.remove(engine) else {
                        continue;
                    };
                    if let Some(n) = self.copies.get_mut(&ours) {
                        *n -= 1;
                        if *n == 0 {
                            self.copies.remove(&ours);
                            change.removed.push(ours);
                        }
                    }
                }
            }
            EngineEvent::AllCleared => {
                self.clear();
                change.cleared = true;
            }
        }
        change
    }
}

/// Where a follower stands with its publisher's history.
#[derive(Debug)]
struct Follower {
    /// The last batch applied.
    last: Option<u64>,
    /// Whether every batch since the publisher started (or since a state
    /// known to be complete) has been applied: then the index is exact.
    complete: bool,
    /// The connection was (re)made: the next batch may come from a
    /// restarted publisher.
    reconnected: bool,
    blocks: EngineBlocks,
}

/// What to do with a live batch.
#[derive(Debug, PartialEq, Eq)]
enum Live {
    Apply,
    Skip,
    /// Batches were missed: ask for them from this one on.
    Missed(u64),
}

impl Follower {
    fn new() -> Self {
        Self {
            last: None,
            complete: false,
            reconnected: true,
            blocks: EngineBlocks::default(),
        }
    }

    fn classify(&mut self, seq: u64) -> Live {
        let reconnected = std::mem::take(&mut self.reconnected);
        match self.last {
            Some(last) if seq == last + 1 => Live::Apply,
            // A restarted publisher numbers from 0 again.
            Some(last) if seq <= last && reconnected => {
                self.restart();
                if seq == 0 {
                    Live::Apply
                } else {
                    Live::Missed(0)
                }
            }
            Some(last) if seq <= last => Live::Skip,
            Some(last) => Live::Missed(last + 1),
            None if seq == 0 => Live::Apply,
            None => Live::Missed(0),
        }
    }

    /// A new history: nothing of the old one is true any more.
    fn restart(&mut self) {
        self.last = None;
        self.complete = false;
        self.blocks.clear();
    }
}

/// Parses `tcp://host:port` (ZMQ's own syntax); returns host and port.
pub fn parse_tcp_endpoint(endpoint: &str) -> Result<(String, u16), String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("KV event endpoint `{endpoint}` is not tcp://host:port"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("KV event endpoint `{endpoint}` has no port"))?;
    let port = port
        .parse()
        .map_err(|_| format!("KV event endpoint `{endpoint}`: bad port"))?;
    if host.is_empty() || host == "*" {
        return Err(format!(
            "KV event endpoint `{endpoint}`: name the engine's host (the engine binds `*`)"
        ));
    }
    Ok((host.to_string(), port))
}

/// A data-parallel rank's endpoint: the port plus the rank, as the engines
/// bind them.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, String> {
    let (host, port) = parse_tcp_endpoint(endpoint)?;
    let port = u32::from(port) + rank;
    if port > u32::from(u16::MAX) {
        return Err(format!(
            "KV event endpoint `{endpoint}`: rank {rank} is past port 65535"
        ));
    }
    Ok(format!("tcp://{host}:{port}"))
}

/// Where one rank's events come from.
#[derive(Clone, Debug)]
pub struct Publisher {
    pub events: String,
    pub replay: Option<String>,
}

/// How long a connect or a replay may take.
const ZMQ_TIMEOUT: Duration = Duration::from_secs(2);

/// Follows one rank's publisher for as long as the worker is in the fleet.
pub fn spawn(fleet: Arc<Fleet>, worker: Arc<Worker>, publisher: Publisher) {
    tokio::spawn(async move {
        let mut follower = Follower::new();
        let mut last_error = String::new();
        while !worker.is_removed() {
            if let Err(e) = follow(&fleet, &worker, &publisher, &mut follower).await
                && e != last_error
            {
                tracing::warn!(worker = worker.id, url = %worker.label(), endpoint = %publisher.events, error = %e, "KV events not heard");
                last_error = e;
            }
            fleet.set_exact(&worker, None);
            follower.reconnected = true;
            tokio::time::sleep(Duration::from_millis(fleet.config.reconnect_ms)).await;
        }
    });
}

/// Subscribes and applies batches until the connection cannot be made.
async fn follow(
    fleet: &Fleet,
    worker: &Worker,
    publisher: &Publisher,
    follower: &mut Follower,
) -> Result<(), String> {
    let mut options = zeromq::SocketOptions::default();
    options.connect_timeout(ZMQ_TIMEOUT);
    let mut sub = SubSocket::with_options(options);
    let mut monitor = sub.monitor();
    sub.connect(&publisher.events)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    sub.subscribe("")
        .await
        .map_err(|e| format!("cannot subscribe: {e}"))?;
    tracing::info!(worker = worker.id, endpoint = %publisher.events, "following KV events");
    // Whatever was published before the subscription took is asked for
    // when the socket reports the connection (`SocketEvent::Connected`, on
    // the first connect as on every reconnect).
    follower.reconnected = true;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            message = sub.recv() => {
                // A dropped peer makes one recv fail; the socket reconnects.
                let Ok(message) = message else { continue };
                let Some((seq, payload)) = frames(&message.into_vec()) else {
                    tracing::debug!(worker = worker.id, "KV event message of unknown shape");
                    continue;
                };
                let batch = match decode_batch(&payload) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(worker = worker.id, seq, error = %e, "bad KV event batch");
                        continue;
                    }
                };
                match follower.classify(seq) {
                    Live::Skip => continue,
                    Live::Apply => apply(fleet, worker, follower, seq, &batch),
                    Live::Missed(from) => {
                        tracing::info!(worker = worker.id, expected = from, got = seq, "KV events missed");
                        let caught_up = catch_up(fleet, worker, publisher, follower, from).await;
                        if !caught_up || follower.last.is_some_and(|l| l + 1 < seq) {
                            // The history has a hole: keep what follows, but
                            // the index is a guess now.
                            follower.complete = false;
                            fleet.set_exact(worker, None);
                        }
                        if follower.last.is_none_or(|l| seq > l) {
                            follower.last = Some(seq - 1);
                            apply(fleet, worker, follower, seq, &batch);
                        }
                    }
                }
                if follower.complete && !worker.is_exact() {
                    fleet.set_exact(worker, Some(&follower.blocks.our_hashes()));
                }
            }
            event = monitor.next() => match event {
                Some(SocketEvent::Disconnected(_)) => {
                    tracing::warn!(worker = worker.id, endpoint = %publisher.events, "KV event publisher gone; approximate mode");
                    follower.reconnected = true;
                    fleet.set_exact(worker, None);
                }
                Some(SocketEvent::Connected(..)) if publisher.replay.is_some() => {
                    follower.reconnected = true;
                    catch_up(fleet, worker, publisher, follower, 0).await;
                    if follower.complete {
                        fleet.set_exact(worker, Some(&follower.blocks.our_hashes()));
                    }
                }
                Some(_) => {}
                None => return Err("the socket closed".into()),
            },
            _ = tick.tick() => {
                if worker.is_removed() {
                    return Ok(());
                }
            }
        }
    }
}

/// `[topic, seq, payload]` (or without the topic) -> (seq, payload).
fn frames(frames: &[Bytes]) -> Option<(u64, Bytes)> {
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] => (seq, payload),
        _ => return None,
    };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload.clone()))
}

/// Applies a batch to the follower and the index.
fn apply(fleet: &Fleet, worker: &Worker, follower: &mut Follower, seq: u64, batch: &EventBatch) {
    if seq == 0 {
        // The publisher's whole history starts here.
        follower.blocks.clear();
        follower.complete = true;
    }
    follower.last = Some(seq);
    let mut index = fleet.index_mut();
    if worker.is_removed() {
        return;
    }
    for event in &batch.events {
        let change = follower.blocks.apply(event, fleet.block_size);
        if change.cleared {
            index.clear_worker(worker.id);
            // Nothing is cached: what follows is the whole story.
            follower.complete = true;
        }
        index.store(worker.id, &change.stored);
        index.remove(worker.id, &change.removed);
    }
}

/// Asks the replay socket for batches from `from` on and applies them.
/// Returns whether the history is whole up to the newest one (replaying
/// from 0 when the publisher still has batch 0 rebuilds it from scratch).
async fn catch_up(
    fleet: &Fleet,
    worker: &Worker,
    publisher: &Publisher,
    follower: &mut Follower,
    from: u64,
) -> bool {
    let Some(endpoint) = &publisher.replay else {
        return false;
    };
    let batches = match tokio::time::timeout(ZMQ_TIMEOUT, replay(endpoint, from)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            tracing::warn!(worker = worker.id, endpoint = %endpoint, error = %e, "KV event replay failed");
            return false;
        }
        Err(_) => {
            tracing::warn!(worker = worker.id, endpoint = %endpoint, "KV event replay timed out");
            return false;
        }
    };
    let Some(&(first, _)) = batches.first() else {
        if from == 0 {
            // The publisher has published nothing since it started (it keeps
            // its batches from the start): its engine caches nothing.
            follower.restart();
            follower.complete = true;
            follower.reconnected = false;
        }
        return follower.complete;
    };
    if first == 0 {
        follower.restart();
    } else if follower.last.is_none_or(|l| first > l + 1) {
        // The oldest batch kept is later than what we miss.
        follower.complete = false;
    }
    for (seq, payload) in &batches {
        if follower.last.is_some_and(|l| *seq <= l) {
            continue;
        }
        match decode_batch(payload) {
            Ok(batch) => apply(fleet, worker, follower, *seq, &batch),
            Err(e) => {
                tracing::warn!(worker = worker.id, seq, error = %e, "bad replayed KV event batch");
                follower.complete = false;
            }
        }
    }
    follower.reconnected = false;
    tracing::info!(
        worker = worker.id,
        from,
        batches = batches.len(),
        complete = follower.complete,
        "KV events replayed"
    );
    follower.complete
}

/// One replay request: `["", from]` to the ROUTER; batches come back as
/// `["", (topic,) seq, payload]` until seq -1 (or an empty payload).
async fn replay(endpoint: &str, from: u64) -> Result<Vec<(u64, Bytes)>, String> {
    let mut options = zeromq::SocketOptions::default();
    options.connect_timeout(ZMQ_TIMEOUT);
    let mut dealer = zeromq::DealerSocket::with_options(options);
    dealer
        .connect(endpoint)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .map_err(|e| e.to_string())?;
    dealer.send(request).await.map_err(|e| e.to_string())?;
    let mut batches = Vec::new();
    loop {
        let message = dealer.recv().await.map_err(|e| e.to_string())?;
        let frames = message.into_vec();
        let rest = match frames.split_first() {
            Some((delimiter, rest)) if delimiter.is_empty() => rest,
            _ => return Err("a replayed message without its delimiter".into()),
        };
        let Some((seq, payload)) = self::frames(rest) else {
            return Err("a replayed message of unknown shape".into());
        };
        if seq == u64::MAX || payload.is_empty() {
            return Ok(batches);
        }
        batches.push((seq, payload));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_backend::kv::hash::block_hashes;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn ints(v: &[u64]) -> Value {
        Value::Array(v.iter().map(|&x| Value::from(x)).collect())
    }

    fn map(fields: Vec<(&str, Value)>) -> Value {
        Value::Map(
            fields
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        )
    }

    #[test]
    fn both_encodings_decode_alike() {
        let tokens: Vec<u64> = (0..8).collect();
        // vLLM today: events are maps (extra fields ignored), hashes u64
        // past i64::MAX.
        let vllm = Value::Array(vec![
            Value::from(1.5),
            Value::Array(vec![
                map(vec![
                    ("type", Value::from("BlockStored")),
                    ("block_hashes", ints(&[u64::MAX - 1, 7])),
                    ("parent_block_hash", Value::Nil),
                    ("token_ids", ints(&tokens)),
                    ("block_size", Value::from(4)),
                    ("lora_id", Value::Nil),
                    ("medium", Value::from("GPU")),
                    ("group_idx", Value::from(0)),
                ]),
                map(vec![
                    ("type", Value::from("BlockRemoved")),
                    ("block_hashes", ints(&[7])),
                    ("medium", Value::from("CPU")),
                ]),
                map(vec![("type", Value::from("AllBlocksCleared"))]),
            ]),
            Value::from(1),
        ]);
        // vLLM before, and SGLang: arrays with the tag first, i64 hashes,
        // trailing defaults left out.
        let sglang = Value::Array(vec![
            Value::from(1.5),
            Value::Array(vec![
                Value::Array(vec![
                    Value::from("BlockStored"),
                    Value::Array(vec![Value::from(-2i64), Value::from(7)]),
                    Value::Nil,
                    ints(&tokens),
                    Value::from(4),
                    Value::Nil,
                ]),
                Value::Array(vec![
                    Value::from("BlockRemoved"),
                    ints(&[7]),
                    Value::from("CPU_PINNED"),
                ]),
                Value::Array(vec![Value::from("AllBlocksCleared")]),
                Value::Array(vec![Value::from("SomethingNew"), Value::from(1)]),
            ]),
            Value::from(1),
        ]);
        let expected = EventBatch {
            ts: 1.5,
            events: vec![
                EngineEvent::Stored {
                    hashes: vec![u64::MAX - 1, 7],
                    parent: None,
                    token_ids: (0..8).collect(),
                    block_size: 4,
                },
                // The CPU-medium removal is left out.
                EngineEvent::AllCleared,
            ],
            dp_rank: Some(1),
        };
        assert_eq!(decode_batch(&encode(&vllm)).unwrap(), expected);
        assert_eq!(decode_batch(&encode(&sglang)).unwrap(), expected);
        assert!(decode_batch(b"\xc1").is_err());
        assert!(decode_batch(&encode(&Value::from(3))).is_err());
    }

    #[test]
    fn engine_blocks_get_our_hashes_through_their_parents() {
        let prompt: Vec<u32> = (100..124).collect();
        let ours = block_hashes(&prompt, 8, 0);
        let mut blocks = EngineBlocks::default();
        // Two events: blocks 0-1, then block 2 with block 1 as its parent.
        let first = EngineEvent::Stored {
            hashes: vec![11, 12],
            parent: None,
            token_ids: prompt[..16].to_vec(),
            block_size: 8,
        };
        let change = blocks.apply(&first, 8);
        assert_eq!(change.stored, ours[..2]);
        assert_eq!(blocks.apply(&first, 8), Change::default(), "idempotent");
        let next = EngineEvent::Stored {
            hashes: vec![13],
            parent: Some(12),
            token_ids: prompt[16..].to_vec(),
            block_size: 8,
        };
        assert_eq!(blocks.apply(&next, 8).stored, ours[2..]);
        // Unknown parent or another block size: not indexed.
        let orphan = EngineEvent::Stored {
            hashes: vec![99],
            parent: Some(98),
            token_ids: prompt[..8].to_vec(),
            block_size: 8,
        };
        assert_eq!(blocks.apply(&orphan, 8), Change::default());
        assert_eq!(blocks.apply(&first, 16), Change::default());
        // A second engine copy of block 0 (say another LoRA): ours stays
        // until both are removed.
        let copy = EngineEvent::Stored {
            hashes: vec![21],
            parent: None,
            token_ids: prompt[..8].to_vec(),
            block_size: 8,
        };
        assert!(blocks.apply(&copy, 8).stored.is_empty());
        let removed = blocks.apply(
            &EngineEvent::Removed {
                hashes: vec![11, 13, 77],
            },
            8,
        );
        assert_eq!(removed.removed, [ours[2]]);
        let removed = blocks.apply(&EngineEvent::Removed { hashes: vec![21] }, 8);
        assert_eq!(removed.removed, [ours[0]]);
        let mut left = blocks.our_hashes();
        left.sort_unstable();
        assert_eq!(left, [ours[1]]);
        assert!(blocks.apply(&EngineEvent::AllCleared, 8).cleared);
        assert!(blocks.our_hashes().is_empty());
    }

    #[test]
    fn sequence_numbers_decide_apply_skip_or_catch_up() {
        let mut f = Follower::new();
        assert_eq!(f.classify(0), Live::Apply, "a publisher's first batch");
        f.last = Some(0);
        assert_eq!(f.classify(1), Live::Apply);
        f.last = Some(5);
        assert_eq!(f.classify(5), Live::Skip, "already applied");
        assert_eq!(f.classify(9), Live::Missed(6));
        // After a reconnect, an old number means the publisher restarted.
        f.reconnected = true;
        f.complete = true;
        assert_eq!(f.classify(0), Live::Apply);
        assert!(f.last.is_none() && !f.complete);
        f.last = Some(5);
        f.reconnected = true;
        assert_eq!(f.classify(3), Live::Missed(0));
        let mut fresh = Follower::new();
        assert_eq!(fresh.classify(40), Live::Missed(0), "joined late");
    }

    #[test]
    fn endpoints_are_tcp_with_a_host_and_ranks_add_to_the_port() {
        assert_eq!(
            parse_tcp_endpoint("tcp://10.0.0.2:5557").unwrap(),
            ("10.0.0.2".into(), 5557)
        );
        assert!(parse_tcp_endpoint("tcp://*:5557").is_err());
        assert!(parse_tcp_endpoint("ipc:///tmp/x").is_err());
        assert!(parse_tcp_endpoint("tcp://host").is_err());
        assert_eq!(rank_endpoint("tcp://h:5557", 3).unwrap(), "tcp://h:5560");
        assert!(rank_endpoint("tcp://h:65535", 1).is_err());
    }
}
