//! The TCP transport's binary frames. Every frame is a 40-byte header and a
//! payload; all integers little-endian:
//!
//! ```text
//! 0   magic "SLKV"        4   version (1)   5   kind   6   reserved (2)
//! 8   handle (u64)        16  a (u32)       20  b (u32)     24  c (u32)
//! 28  payload length (u32)                  32  XXH3-64 of the payload
//! ```
//!
//! | kind | a | b | c | payload |
//! |---|---|---|---|---|
//! | hello (sender) | layers | block size | kv dim | dtype code (u32) |
//! | chunk (sender) | first block | blocks | 0 | the blocks' bytes |
//! | done (sender) | blocks sent | 0 | 0 | none |
//! | ack (receiver) | 1 = accepted, 0 = refused | 0 | 0 | the reason, UTF-8 |
//! | share ask (sender) | 0 | 0 | 0 | the sender's [`KvShare`], JSON |
//! | share offer (receiver) | 0 | 0 | 0 | a [`DirectTarget`], JSON |
//! | landed (sender) | first block | blocks | 0 | none |
//!
//! A direct transfer (same node) begins on a connection of its own: `share
//! ask` (may this worker write into the reservation?) answered by `share
//! offer` (the pages) or a refusing `ack`. The transfer then runs as any
//! other, with `landed` frames for blocks already copied in place where
//! `chunk`s would carry bytes.
//!
//! The checksum covers every payload; a frame whose payload does not match
//! it, or that is longer than [`MAX_PAYLOAD`], ends the connection.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{DirectTarget, KvDtype, KvLayout, KvShare, TransferError};

const MAGIC: [u8; 4] = *b"SLKV";
const VERSION: u8 = 1;
pub const HEADER_BYTES: usize = 40;
/// The largest payload accepted (a chunk is one prefill step's blocks).
pub const MAX_PAYLOAD: u32 = 256 << 20;

/// One frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    Hello {
        handle: u64,
        layout: KvLayout,
    },
    Chunk {
        handle: u64,
        first_block: u32,
        n_blocks: u32,
        data: Vec<u8>,
    },
    Done {
        handle: u64,
        blocks: u32,
    },
    Ack {
        handle: u64,
        ok: bool,
        message: String,
    },
    ShareAsk {
        handle: u64,
        share: Box<KvShare>,
    },
    ShareOffer {
        handle: u64,
        target: Box<DirectTarget>,
    },
    Landed {
        handle: u64,
        first_block: u32,
        n_blocks: u32,
    },
}

const HELLO: u8 = 1;
const CHUNK: u8 = 2;
const DONE: u8 = 3;
const ACK: u8 = 4;
const SHARE_ASK: u8 = 5;
const SHARE_OFFER: u8 = 6;
const LANDED: u8 = 7;

fn json<T: serde::Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("plain structs serialize")
}

fn from_json<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Result<T, TransferError> {
    serde_json::from_slice(payload)
        .map_err(|e| TransferError::Protocol(format!("bad payload: {e}")))
}

impl Frame {
    /// The header and the payload.
    pub fn encode(&self) -> ([u8; HEADER_BYTES], Vec<u8>) {
        let (kind, handle, [a, b, c], payload) = match self {
            Frame::Hello { handle, layout } => (
                HELLO,
                *handle,
                [layout.n_layers, layout.block_size, layout.kv_dim],
                layout.dtype.code().to_le_bytes().to_vec(),
            ),
            Frame::Chunk {
                handle,
                first_block,
                n_blocks,
                data,
            } => (CHUNK, *handle, [*first_block, *n_blocks, 0], data.clone()),
            Frame::Done { handle, blocks } => (DONE, *handle, [*blocks, 0, 0], Vec::new()),
            Frame::Ack {
                handle,
                ok,
                message,
            } => (
                ACK,
                *handle,
                [u32::from(*ok), 0, 0],
                message.as_bytes().to_vec(),
            ),
            Frame::ShareAsk { handle, share } => (SHARE_ASK, *handle, [0, 0, 0], json(share)),
            Frame::ShareOffer { handle, target } => (SHARE_OFFER, *handle, [0, 0, 0], json(target)),
            Frame::Landed {
                handle,
                first_block,
                n_blocks,
            } => (LANDED, *handle, [*first_block, *n_blocks, 0], Vec::new()),
        };
        (header(kind, handle, [a, b, c], &payload), payload)
    }

    /// Writes the frame (a chunk's data without copying it).
    pub async fn write<W: AsyncWrite + Unpin>(&self, w: &mut W) -> std::io::Result<()> {
        if let Frame::Chunk {
            handle,
            first_block,
            n_blocks,
            data,
        } = self
        {
            let h = header(CHUNK, *handle, [*first_block, *n_blocks, 0], data);
            w.write_all(&h).await?;
            w.write_all(data).await?;
        } else {
            let (h, payload) = self.encode();
            w.write_all(&h).await?;
            w.write_all(&payload).await?;
        }
        w.flush().await
    }

    /// Reads one frame; `Ok(None)` at a clean end of stream before a header.
    pub async fn read<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Frame>, TransferError> {
        let mut h = [0u8; HEADER_BYTES];
        match r.read_exact(&mut h[..1]).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        r.read_exact(&mut h[1..]).await?;
        if h[..4] != MAGIC {
            return Err(TransferError::Protocol("not a sluice KV frame".into()));
        }
        if h[4] != VERSION {
            return Err(TransferError::Protocol(format!(
                "frame version {}, expected {VERSION}",
                h[4]
            )));
        }
        let u32_at = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
        let handle = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        let (a, b, c, len) = (u32_at(16), u32_at(20), u32_at(24), u32_at(28));
        let checksum = u64::from_le_bytes(h[32..40].try_into().expect("8 bytes"));
        if len > MAX_PAYLOAD {
            return Err(TransferError::Protocol(format!(
                "payload of {len} bytes is over the limit of {MAX_PAYLOAD}"
            )));
        }
        let mut payload = vec![0u8; len as usize];
        r.read_exact(&mut payload).await?;
        if xxhash_rust::xxh3::xxh3_64(&payload) != checksum {
            return Err(TransferError::Protocol(format!(
                "checksum mismatch in a {len}-byte payload"
            )));
        }
        let frame = match h[5] {
            HELLO => {
                let code = payload
                    .get(..4)
                    .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
                let dtype = code
                    .and_then(KvDtype::from_code)
                    .ok_or_else(|| TransferError::Protocol(format!("unknown KV dtype {code:?}")))?;
                Frame::Hello {
                    handle,
                    layout: KvLayout {
                        n_layers: a,
                        block_size: b,
                        kv_dim: c,
                        dtype,
                    },
                }
            }
            CHUNK => Frame::Chunk {
                handle,
                first_block: a,
                n_blocks: b,
                data: payload,
            },
            DONE => Frame::Done { handle, blocks: a },
            ACK => Frame::Ack {
                handle,
                ok: a == 1,
                message: String::from_utf8_lossy(&payload).into_owned(),
            },
            SHARE_ASK => Frame::ShareAsk {
                handle,
                share: Box::new(from_json(&payload)?),
            },
            SHARE_OFFER => Frame::ShareOffer {
                handle,
                target: Box::new(from_json(&payload)?),
            },
            LANDED => Frame::Landed {
                handle,
                first_block: a,
                n_blocks: b,
            },
            kind => {
                return Err(TransferError::Protocol(format!(
                    "unknown frame kind {kind}"
                )));
            }
        };
        Ok(Some(frame))
    }
}

fn header(kind: u8, handle: u64, [a, b, c]: [u32; 3], payload: &[u8]) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = VERSION;
    h[5] = kind;
    h[8..16].copy_from_slice(&handle.to_le_bytes());
    h[16..20].copy_from_slice(&a.to_le_bytes());
    h[20..24].copy_from_slice(&b.to_le_bytes());
    h[24..28].copy_from_slice(&c.to_le_bytes());
    h[28..32].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    h[32..40].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(payload).to_le_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            n_layers: 2,
            block_size: 4,
            kv_dim: 3,
            dtype: KvDtype::Bf16,
        }
    }

    fn share() -> KvShare {
        KvShare {
            node: "3f1c".into(),
            pid: 41,
            device: "GPU-0".into(),
            layout: layout(),
            n_blocks: 512,
            k_handle: (0..64).collect(),
            v_handle: vec![255; 64],
            k_addr: 1 << 40,
            v_addr: (1 << 40) + 4096,
        }
    }

    async fn round_trip(frame: &Frame) -> Frame {
        let mut bytes = Vec::new();
        frame.write(&mut bytes).await.unwrap();
        let (h, p) = frame.encode();
        assert_eq!(bytes, [&h[..], &p[..]].concat(), "write = encode");
        Frame::read(&mut &bytes[..]).await.unwrap().unwrap()
    }

    #[tokio::test]
    async fn every_kind_round_trips() {
        let frames = [
            Frame::Hello {
                handle: 7,
                layout: layout(),
            },
            Frame::Chunk {
                handle: 7,
                first_block: 3,
                n_blocks: 2,
                data: (0..=255).collect(),
            },
            Frame::Done {
                handle: 7,
                blocks: 5,
            },
            Frame::Ack {
                handle: 7,
                ok: false,
                message: "no such reservation".into(),
            },
            Frame::ShareAsk {
                handle: 7,
                share: Box::new(share()),
            },
            Frame::ShareOffer {
                handle: 7,
                target: Box::new(DirectTarget {
                    share: share(),
                    from_block: 2,
                    pages: vec![40, 3, 17],
                    expires_unix_ms: 1_764_000_000_000,
                }),
            },
            Frame::Landed {
                handle: 7,
                first_block: 2,
                n_blocks: 3,
            },
        ];
        for f in &frames {
            assert_eq!(&round_trip(f).await, f);
        }
        // A clean end before a header is the end of the stream.
        assert!(Frame::read(&mut &[][..]).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn corruption_truncation_and_oversize_are_errors() {
        let chunk = Frame::Chunk {
            handle: 1,
            first_block: 0,
            n_blocks: 1,
            data: vec![9; 64],
        };
        let (h, p) = chunk.encode();
        let mut bytes = [&h[..], &p[..]].concat();
        // One flipped payload bit.
        bytes[HEADER_BYTES + 10] ^= 4;
        let e = Frame::read(&mut &bytes[..]).await.unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
        // Cut inside the payload.
        let whole = [&h[..], &p[..]].concat();
        let e = Frame::read(&mut &whole[..whole.len() - 1])
            .await
            .unwrap_err();
        assert!(matches!(e, TransferError::Io(_)), "{e}");
        // Not our magic.
        let mut wrong = whole.clone();
        wrong[0] = b'X';
        assert!(Frame::read(&mut &wrong[..]).await.is_err());
        // A length over the limit is refused before anything is allocated.
        let mut huge = h;
        huge[28..32].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        let e = Frame::read(&mut &huge[..]).await.unwrap_err();
        assert!(e.to_string().contains("over the limit"), "{e}");
    }
}
