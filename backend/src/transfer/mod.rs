//! KV movement between prefill and decode workers (disaggregation): what a
//! block of KV looks like outside its worker (`KvLayout`), the chunks a
//! prefill engine exports (`KvExport`), the `KvTransport` trait that carries
//! them to the decode worker's reserved blocks, its TCP implementation
//! (`tcp`, binary frames from `wire`), and worker roles.
//!
//! The flow: the decode worker admits a request with `remote_prefill` set,
//! reserves its prompt's blocks and answers a handle (the `awaiting_kv`
//! event); the prefill worker runs (chunked) prefill of the prompt without
//! its last token and, after each step, exports the blocks that step
//! finished; a transport pushes them into the reserved blocks; when the last
//! one has landed the decode worker runs the last prompt token itself and
//! samples, so sampling (seed, logprobs, stops) stays in one place.
//!
//! Within one node the blocks need not cross the host at all (direct
//! copies): a decode worker whose cache another process can map (CUDA IPC,
//! `compute::cuda::transfer`) describes it as a [`KvShare`]; a prefill
//! worker that can write into it asks the decode side for the reserved
//! pages first ([`KvTransport::direct`]), its engine copies each step's
//! blocks straight into them (one gather kernel for all layers), and the
//! transport only says which blocks landed. Everything else (the reservation,
//! the order, the acknowledgement, the failure rules) is the same protocol.

pub mod tcp;
pub mod wire;

use std::fmt;
use std::str::FromStr;

/// The element type of K and V on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    /// The CPU reference's cache.
    F32,
    /// The CUDA backend's cache.
    Bf16,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }

    pub fn code(self) -> u32 {
        match self {
            KvDtype::F32 => 1,
            KvDtype::Bf16 => 2,
        }
    }

    pub fn from_code(code: u32) -> Option<KvDtype> {
        match code {
            1 => Some(KvDtype::F32),
            2 => Some(KvDtype::Bf16),
            _ => None,
        }
    }
}

/// The shape of one KV block outside its worker. A block's bytes are, for
/// each layer in order, K then V, each `block_size * kv_dim` elements
/// (position-major), little-endian. Both ends must agree on everything but
/// the dtype (converted on arrival).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvLayout {
    pub n_layers: u32,
    pub block_size: u32,
    /// K (or V) elements per token per layer; 0 for the simulator, whose
    /// blocks carry no data.
    pub kv_dim: u32,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Elements of K (or V) in one block of one layer.
    pub fn block_elements(&self) -> usize {
        self.block_size as usize * self.kv_dim as usize
    }

    /// Bytes of one block, every layer, K and V.
    pub fn block_bytes(&self) -> usize {
        2 * self.n_layers as usize * self.block_elements() * self.dtype.bytes()
    }

    /// Why `other` cannot be written into blocks of this layout, if it cannot.
    pub fn mismatch(&self, other: &KvLayout) -> Option<String> {
        (self.n_layers != other.n_layers
            || self.block_size != other.block_size
            || self.kv_dim != other.kv_dim)
            .then(|| {
                format!(
                    "KV layout {} layers x {} tokens x {} does not match this worker's {} x {} x {}",
                    other.n_layers,
                    other.block_size,
                    other.kv_dim,
                    self.n_layers,
                    self.block_size,
                    self.kv_dim
                )
            })
    }
}

/// Converts block bytes from one dtype to another (BF16 rounds to nearest
/// even; F32 from BF16 is exact; the same dtype is a copy).
pub fn convert(data: &[u8], from: KvDtype, to: KvDtype) -> Vec<u8> {
    match (from, to) {
        (KvDtype::F32, KvDtype::F32) | (KvDtype::Bf16, KvDtype::Bf16) => data.to_vec(),
        (KvDtype::F32, KvDtype::Bf16) => data
            .chunks_exact(4)
            .flat_map(|b| {
                let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                half::bf16::from_f32(x).to_bits().to_le_bytes()
            })
            .collect(),
        (KvDtype::Bf16, KvDtype::F32) => data
            .chunks_exact(2)
            .flat_map(|b| {
                half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
                    .to_f32()
                    .to_le_bytes()
            })
            .collect(),
    }
}

/// Blocks a prefill engine finished in one step, in the request's own block
/// numbering (block `i` holds positions `i * block_size..`), which is the
/// same on the decode worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvExport {
    pub first_block: u32,
    pub n_blocks: u32,
    /// `n_blocks` blocks in the [`KvLayout`] format; empty when `in_place`.
    pub data: Vec<u8>,
    /// The blocks were copied into the decode worker's cache already (a
    /// direct transfer): only the fact travels.
    pub in_place: bool,
}

/// A KV cache that other processes of the same node can write into: what a
/// decode worker offers a prefill worker for direct copies. On a GPU the
/// handles are CUDA IPC memory handles of the K and V buffers (each
/// `n_layers x n_blocks` pages of `block_size x kv_dim` values, layer-major),
/// and the addresses serve a peer in the same process, which cannot open
/// its own process's handles.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvShare {
    /// The operating system instance (Linux's boot id): handles mean
    /// nothing on another node.
    pub node: String,
    pub pid: u32,
    /// The device holding the cache (a GPU's UUID).
    pub device: String,
    pub layout: KvLayout,
    /// Pages per layer: the stride between layers.
    pub n_blocks: u32,
    pub k_handle: Vec<u8>,
    pub v_handle: Vec<u8>,
    pub k_addr: u64,
    pub v_addr: u64,
}

/// This machine's boot id (what [`KvShare::node`] holds), or "" where the
/// system has none to read (no direct copies are offered then).
pub fn node_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Where a prefill engine copies a request's blocks directly: the decode
/// worker's cache and its reserved pages, `pages[i]` for block
/// `from_block + i`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DirectTarget {
    pub share: KvShare,
    pub from_block: u32,
    pub pages: Vec<u32>,
    /// The reservation's deadline, Unix ms (one clock: one node). The
    /// decode side keeps the pages of a failed or cancelled direct import
    /// out of use until [`DIRECT_GRACE`] after it, and the prefill side
    /// starts no copy later than [`DIRECT_MARGIN`] before it, so that a
    /// late copy never lands in pages another request holds.
    pub expires_unix_ms: u64,
}

/// How long after a direct reservation's deadline its pages stay unused.
pub const DIRECT_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
/// How close to the deadline a prefill worker stops copying (then bytes).
pub const DIRECT_MARGIN: std::time::Duration = std::time::Duration::from_secs(1);

/// Now, in Unix ms.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Where a prefill worker sends a request's KV: the decode worker's
/// transfer address, the handle its `awaiting_kv` event named, and the
/// first block it wants (the blocks before are cached there already).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvTarget {
    pub addr: String,
    pub handle: u64,
    pub from_block: u32,
}

/// What a finished push moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Pushed {
    pub blocks: u32,
    /// Bytes that crossed the connection (none for blocks copied in place).
    pub bytes: u64,
    /// Of `blocks`, those copied straight into the decode worker's cache.
    #[serde(default)]
    pub in_place: u32,
    /// From connecting to the decode side's acknowledgement.
    pub seconds: f64,
}

/// Why a push failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("the transfer connection failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the transfer timed out after {0:?}")]
    Timeout(std::time::Duration),
    #[error("bad frame: {0}")]
    Protocol(String),
    #[error("the decode worker refused the KV: {0}")]
    Refused(String),
    #[error("the prefill ended before its KV was complete")]
    Incomplete,
}

/// Carries a request's exported KV to the decode worker's reserved blocks.
/// `push` resolves when the decode side has acknowledged every block;
/// dropping its future abandons the transfer (the decode side then releases
/// the reservation).
pub trait KvTransport: Send + Sync + fmt::Debug {
    fn push(
        &self,
        target: KvTarget,
        layout: KvLayout,
        chunks: tokio::sync::mpsc::UnboundedReceiver<KvExport>,
    ) -> futures_util::future::BoxFuture<'static, Result<Pushed, TransferError>>;

    /// Asks the decode worker whether this worker (whose cache is `local`)
    /// may copy the request's blocks straight into its cache, and where:
    /// `None` when it may not (another node, another kind of cache, or a
    /// transport without direct copies), and the blocks then travel as bytes.
    fn direct(
        &self,
        target: &KvTarget,
        local: &KvShare,
    ) -> futures_util::future::BoxFuture<'static, Result<Option<DirectTarget>, TransferError>> {
        let _ = (target, local);
        Box::pin(async { Ok(None) })
    }
}

/// What a worker does in a disaggregated fleet (every worker can do both;
/// the role says which hops the gateway routes to it, and which halves of
/// the protocol it accepts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill for decode workers (`/internal/prefill`); no KV reservations.
    Prefill,
    /// Decode, with KV from prefill workers, and whole requests (short
    /// prompts skip the prefill hop).
    Decode,
    /// Everything.
    #[default]
    Both,
}

impl Role {
    pub fn can_prefill(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    pub fn can_decode(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        })
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            other => Err(format!("unknown role {other:?} (prefill, decode or both)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_conversion_round_trips_bf16_values() {
        let values = [0.0f32, 1.0, -2.5, 3.140625, 65280.0];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        let bf = convert(&f32_bytes, KvDtype::F32, KvDtype::Bf16);
        assert_eq!(bf.len(), values.len() * 2);
        // Every value is exactly representable in BF16: the way back is exact.
        assert_eq!(convert(&bf, KvDtype::Bf16, KvDtype::F32), f32_bytes);
        // 1 + 2^-9 rounds to 1 (nearest even).
        let near_one = convert(
            &(1.0f32 + 1.0 / 512.0).to_le_bytes(),
            KvDtype::F32,
            KvDtype::Bf16,
        );
        assert_eq!(near_one, half::bf16::from_f32(1.0).to_bits().to_le_bytes());
    }

    #[test]
    fn layouts_must_agree_except_for_dtype() {
        let a = KvLayout {
            n_layers: 30,
            block_size: 16,
            kv_dim: 192,
            dtype: KvDtype::F32,
        };
        assert_eq!(a.block_bytes(), 2 * 30 * 16 * 192 * 4);
        assert!(
            a.mismatch(&KvLayout {
                dtype: KvDtype::Bf16,
                ..a
            })
            .is_none()
        );
        let other = KvLayout {
            block_size: 32,
            ..a
        };
        assert!(a.mismatch(&other).unwrap().contains("32"));
        assert_eq!("decode".parse::<Role>(), Ok(Role::Decode));
        assert!("both ".parse::<Role>().is_err());
        assert!(Role::Both.can_prefill() && Role::Both.can_decode());
        assert!(!Role::Prefill.can_decode() && !Role::Decode.can_prefill());
    }
}
