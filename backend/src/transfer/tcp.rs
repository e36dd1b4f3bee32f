//! The TCP transport between any two hosts. The prefill side connects to the
//! decode worker's KV listener and sends `hello`, one `chunk` per exported
//! step, then `done`; the listener passes each to the decode engine
//! ([`Engine::receive_kv`]) and reads the next frame only once the engine has
//! written the last one, so a slow decode side slows the sender through
//! TCP's own flow control (backpressure) and at most one chunk per transfer
//! is buffered there. The listener ends with an `ack` (accepted, or the
//! reason it was refused). Every read and write has a timeout; a broken,
//! late or corrupt transfer fails its request on the decode side, which
//! releases the reserved blocks.
//!
//! Direct transfers (same node): before the prefill starts, the prefill
//! side asks on a connection of its own (`share ask` with its cache's
//! [`KvShare`]) and the listener answers the reserved pages (`share offer`)
//! when its cache is shared, the two are on one node and the sender's
//! layout matches; else a refusing `ack`, and the blocks go as bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::wire::Frame;
use super::{
    DirectTarget, KvExport, KvLayout, KvShare, KvTarget, KvTransport, Pushed, TransferError,
};
use crate::engine::{Engine, KvIntake};

/// The sending side.
#[derive(Clone, Copy, Debug)]
pub struct TcpTransport {
    pub connect_timeout: Duration,
    /// The longest one frame may take to write, or the acknowledgement to come.
    pub io_timeout: Duration,
}

impl Default for TcpTransport {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
        }
    }
}

async fn within<T, E: Into<TransferError>>(
    limit: Duration,
    f: impl Future<Output = Result<T, E>>,
) -> Result<T, TransferError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(TransferError::Timeout(limit)),
    }
}

impl TcpTransport {
    async fn connect(&self, addr: &str) -> Result<TcpStream, TransferError> {
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
                Err(_) => return Err(TransferError::Timeout(self.connect_timeout)),
                Ok(Err(source)) => {
                    return Err(TransferError::Connect {
                        addr: addr.to_string(),
                        source,
                    });
                }
                Ok(Ok(s)) => s,
            };
        stream.set_nodelay(true)?;
        Ok(stream)
    }

    /// [`KvTransport::direct`] over its own connection: `share ask`, then
    /// the offer or the reason there is none.
    async fn ask_direct(
        self,
        target: KvTarget,
        local: KvShare,
    ) -> Result<Option<DirectTarget>, TransferError> {
        let stream = self.connect(&target.addr).await?;
        let (mut rd, mut wr) = stream.into_split();
        let ask = Frame::ShareAsk {
            handle: target.handle,
            share: Box::new(local),
        };
        within(self.io_timeout, ask.write(&mut wr)).await?;
        match within(self.io_timeout, Frame::read(&mut rd)).await? {
            Some(Frame::ShareOffer { handle, target: t }) if handle == target.handle => {
                if t.from_block != target.from_block {
                    return Err(TransferError::Protocol(format!(
                        "pages offered from block {} where the transfer starts at {}",
                        t.from_block, target.from_block
                    )));
                }
                Ok(Some(*t))
            }
            Some(Frame::Ack {
                ok: false, message, ..
            }) => {
                tracing::debug!(addr = %target.addr, %message, "no direct KV copies; bytes instead");
                Ok(None)
            }
            other => Err(TransferError::Protocol(format!(
                "expected a share offer, got {other:?}"
            ))),
        }
    }
}

impl KvTransport for TcpTransport {
    fn push(
        &self,
        target: KvTarget,
        layout: KvLayout,
        mut chunks: mpsc::UnboundedReceiver<KvExport>,
    ) -> BoxFuture<'static, Result<Pushed, TransferError>> {
        let this = *self;
        let io_timeout = self.io_timeout;
        Box::pin(async move {
            let started = Instant::now();
            let stream = this.connect(&target.addr).await?;
            let (mut rd, mut wr) = stream.into_split();
            // The listener answers once, at the end or on refusal: read it
            // on the side so that an early refusal names its reason.
            let mut answer = tokio::spawn(async move { Frame::read(&mut rd).await });
            let handle = target.handle;
            let mut sent = Pushed::default();
            let mut next = target.from_block;
            let sending = async {
                within(io_timeout, Frame::Hello { handle, layout }.write(&mut wr)).await?;
                while let Some(chunk) = chunks.recv().await {
                    if chunk.first_block != next {
                        return Err(TransferError::Protocol(format!(
                            "the export gave block {} where {next} was due",
                            chunk.first_block
                        )));
                    }
                    let frame = if chunk.in_place {
                        sent.in_place += chunk.n_blocks;
                        Frame::Landed {
                            handle,
                            first_block: chunk.first_block,
                            n_blocks: chunk.n_blocks,
                        }
                    } else {
                        sent.bytes += chunk.data.len() as u64;
                        Frame::Chunk {
                            handle,
                            first_block: chunk.first_block,
                            n_blocks: chunk.n_blocks,
                            data: chunk.data,
                        }
                    };
                    within(io_timeout, frame.write(&mut wr)).await?;
                    next += chunk.n_blocks;
                    sent.blocks += chunk.n_blocks;
                }
                let done = Frame::Done {
                    handle,
                    blocks: sent.blocks,
                };
                within(io_timeout, done.write(&mut wr)).await
            };
            tokio::select! {
                r = sending => {
                    if let Err(e) = r {
                        // A refusal that raced the failed write says more
                        // than the write's error.
                        let late = tokio::time::timeout(Duration::from_millis(200), &mut answer).await;
                        return Err(match late {
                            Ok(a) if !answer_is_eof(&a) => early_answer(a),
                            _ => e,
                        });
                    }
                }
                // Refused (or gone) before the end.
                a = &mut answer => return Err(early_answer(a)),
            }
            let ack = tokio::time::timeout(io_timeout, answer)
                .await
                .map_err(|_| TransferError::Timeout(io_timeout))?;
            match ack {
                Ok(Ok(Some(Frame::Ack { ok: true, .. }))) => {
                    sent.seconds = started.elapsed().as_secs_f64();
                    Ok(sent)
                }
                other => Err(early_answer(other)),
            }
        })
    }

    fn direct(
        &self,
        target: &KvTarget,
        local: &KvShare,
    ) -> BoxFuture<'static, Result<Option<DirectTarget>, TransferError>> {
        Box::pin(self.ask_direct(target.clone(), local.clone()))
    }
}

type Answer = Result<Result<Option<Frame>, TransferError>, tokio::task::JoinError>;

fn answer_is_eof(a: &Answer) -> bool {
    matches!(a, Ok(Ok(None)))
}

/// The error an answer other than an acceptance means.
fn early_answer(a: Answer) -> TransferError {
    match a {
        Ok(Ok(Some(Frame::Ack {
            ok: false, message, ..
        }))) => TransferError::Refused(message),
        Ok(Ok(Some(Frame::Ack { ok: true, .. }))) => {
            TransferError::Protocol("accepted before the end".into())
        }
        Ok(Ok(Some(other))) => TransferError::Protocol(format!("unexpected answer {other:?}")),
        Ok(Ok(None)) => TransferError::Io(std::io::ErrorKind::UnexpectedEof.into()),
        Ok(Err(e)) => e,
        Err(e) => TransferError::Protocol(format!("the reading task failed: {e}")),
    }
}

/// Accepts transfers into `engine`'s reserved blocks until the listener
/// fails. `idle_timeout` bounds the wait for each frame (a prefill step).
pub async fn serve_kv(listener: TcpListener, engine: Arc<Engine>, idle_timeout: Duration) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of file descriptors and the like: wait, then go on.
                tracing::warn!(error = %e, "KV listener cannot accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let engine = engine.clone();
        tokio::spawn(async move {
            if let Err(e) = receive(stream, &engine, idle_timeout).await {
                tracing::warn!(%peer, error = %e, "KV transfer failed");
            }
        });
    }
}

/// One connection: a transfer (frames into the engine, then the
/// acknowledgement) or a direct-transfer ask (answered, nothing else).
async fn receive(stream: TcpStream, engine: &Engine, idle: Duration) -> Result<(), String> {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let first = within(idle, Frame::read(&mut rd))
        .await
        .map_err(|e| e.to_string());
    if let Ok(Some(Frame::ShareAsk { handle: h, share })) = first {
        let answer = match offer(engine, h, &share).await {
            Ok(target) => Frame::ShareOffer {
                handle: h,
                target: Box::new(target),
            },
            Err(message) => Frame::Ack {
                handle: h,
                ok: false,
                message,
            },
        };
        // An ask settles nothing: a refusal only means bytes.
        return within(idle, answer.write(&mut wr))
            .await
            .map_err(|e| e.to_string());
    }
    let mut handle = None;
    let result: Result<(), String> = async {
        let frame = first?;
        let Some(Frame::Hello { handle: h, layout }) = frame else {
            return Err(format!("expected hello, got {frame:?}"));
        };
        handle = Some(h);
        engine.receive_kv(h, KvIntake::Begin(layout)).await?;
        loop {
            let frame = within(idle, Frame::read(&mut rd))
                .await
                .map_err(|e| e.to_string())?;
            let intake = match frame {
                Some(Frame::Chunk {
                    handle: of,
                    first_block,
                    n_blocks,
                    data,
                }) if of == h => KvIntake::Blocks {
                    first_block,
                    n_blocks,
                    data,
                    dtype: layout.dtype,
                },
                Some(Frame::Landed {
                    handle: of,
                    first_block,
                    n_blocks,
                }) if of == h => KvIntake::Landed {
                    first_block,
                    n_blocks,
                },
                Some(Frame::Done { handle: of, blocks }) if of == h => {
                    return engine.receive_kv(h, KvIntake::Done { blocks }).await;
                }
                None => return Err("the sender closed the connection before done".into()),
                Some(other) => return Err(format!("unexpected frame {other:?}")),
            };
            engine.receive_kv(h, intake).await?;
        }
    }
    .await;
    if let (Err(e), Some(h)) = (&result, handle) {
        // Fails the request if the engine has not already (it answers an
        // error for a request it no longer holds).
        let _ = engine.receive_kv(h, KvIntake::Abort(e.clone())).await;
    }
    let ack = Frame::Ack {
        handle: handle.unwrap_or(0),
        ok: result.is_ok(),
        message: result.as_ref().err().cloned().unwrap_or_default(),
    };
    // The sender may be gone already; the request's fate is settled anyway.
    let _ = tokio::time::timeout(idle, ack.write(&mut wr)).await;
    result
}

/// The pages a prefill worker whose cache is `theirs` may copy request
/// `handle`'s blocks into, or why it may not.
async fn offer(engine: &Engine, handle: u64, theirs: &KvShare) -> Result<DirectTarget, String> {
    let Some(ours) = &engine.kv_share else {
        return Err("this worker's KV cache is not shared".into());
    };
    if ours.node.is_empty() || ours.node != theirs.node {
        return Err("the two workers are not on one node".into());
    }
    if ours.layout != theirs.layout {
        return Err(format!(
            "KV layouts differ: {:?} here, {:?} there",
            ours.layout, theirs.layout
        ));
    }
    engine.direct_pages(handle).await
}
