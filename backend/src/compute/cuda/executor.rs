//! The engine's executor on a GPU: the scheduler hands it a batch of chunks,
//! it runs `CudaLlama::forward` over the paged KV cache on the device and
//! gives the logits back to the sampler. Its cache is shared with prefill
//! workers of the same node (CUDA IPC), and it copies its own blocks into
//! a decode worker's cache the same way (`super::transfer`).

use crate::engine::{Executor, Next};
use crate::model::SeqChunk;
use crate::transfer::{DirectTarget, KvLayout, KvShare};

use super::device::GpuError;
use super::model::{ChunkResult, CudaKvCache, CudaLlama, Numerics, StepOutput, Workspace};
use super::transfer::{PeerCaches, share_of};

#[derive(Debug)]
pub struct CudaExecutor {
    pub model: CudaLlama,
    pub kv: CudaKvCache,
    workspace: Workspace,
    /// `kv` as other processes map it; `None` where the driver gave no
    /// IPC handles (then transfers into this worker go as bytes).
    share: Option<KvShare>,
    peers: PeerCaches,
}

impl CudaExecutor {
    /// A KV cache of `kv_blocks` pages of `block_size` tokens beside the model.
    pub fn new(model: CudaLlama, kv_blocks: usize, block_size: usize) -> Result<Self, GpuError> {
        let kv = CudaKvCache::new(&model.gpu, &model.config, kv_blocks, block_size)?;
        let workspace = Workspace::new(&model.gpu)?;
        let share = share_of(&model.gpu, &kv)
            .inspect_err(|e| tracing::info!(error = %e, "the KV cache cannot be shared (CUDA IPC)"))
            .ok();
        Ok(CudaExecutor {
            model,
            kv,
            workspace,
            share,
            peers: PeerCaches::default(),
        })
    }

    /// Whether pure-decode steps replay as CUDA graphs (on by default).
    pub fn set_graphs(&mut self, on: bool) {
        self.workspace.use_graphs = on;
    }

    /// How steps are computed (batch-invariant by default).
    pub fn set_numerics(&mut self, numerics: Numerics) {
        self.workspace.numerics = numerics;
    }

    pub(crate) fn workspace(&self) -> &Workspace {
        &self.workspace
    }

    pub(crate) fn workspace_mut(&mut self) -> &mut Workspace {
        &mut self.workspace
    }

    /// One step, with the output asked for.
    pub fn step(
        &mut self,
        chunks: &[SeqChunk<'_>],
        output: StepOutput,
    ) -> Result<Vec<ChunkResult>, GpuError> {
        self.model
            .forward(&mut self.kv, &mut self.workspace, chunks, output)
    }
}

impl Executor for CudaExecutor {
    fn context(&self) -> usize {
        self.model.config.context
    }

    fn vocab(&self) -> usize {
        self.model.config.vocab
    }

    fn kv_layout(&self) -> KvLayout {
        self.kv.layout()
    }

    /// Staged through the host, one copy per block, layer and K/V: this is
    /// the TCP transport's side (bound by the network); same-node GPU
    /// transfers use the gather kernel instead (`super::transfer`).
    fn read_kv(&mut self, blocks: &[u32]) -> Vec<u8> {
        let span = self.kv.block_size * self.kv.kv_dim;
        let mut host = vec![0u16; blocks.len() * self.kv.n_layers * 2 * span];
        let mut parts = host.chunks_exact_mut(span);
        let stream = &self.model.gpu.stream;
        for &block in blocks {
            for layer in 0..self.kv.n_layers {
                let at = (layer * self.kv.n_blocks + block as usize) * span;
                for cache in [&self.kv.k, &self.kv.v] {
                    let dst = parts.next().expect("sized for every part");
                    stream
                        .memcpy_dtoh(&cache.slice(at..at + span), dst)
                        .unwrap_or_else(|e| panic!("reading KV blocks from the GPU failed: {e}"));
                }
            }
        }
        stream
            .synchronize()
            .unwrap_or_else(|e| panic!("reading KV blocks from the GPU failed: {e}"));
        host.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn write_kv(&mut self, blocks: &[u32], data: &[u8]) {
        let span = self.kv.block_size * self.kv.kv_dim;
        let host: Vec<u16> = data
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let mut parts = host.chunks_exact(span);
        let stream = self.model.gpu.stream.clone();
        for &block in blocks {
            for layer in 0..self.kv.n_layers {
                let at = (layer * self.kv.n_blocks + block as usize) * span;
                for cache in [&mut self.kv.k, &mut self.kv.v] {
                    let src = parts.next().expect("the engine checked the data's length");
                    stream
                        .memcpy_htod(src, &mut cache.slice_mut(at..at + span))
                        .unwrap_or_else(|e| panic!("writing KV blocks to the GPU failed: {e}"));
                }
            }
        }
        // The host buffer must outlive the copies.
        stream
            .synchronize()
            .unwrap_or_else(|e| panic!("writing KV blocks to the GPU failed: {e}"));
    }

    fn kv_share(&self) -> Option<KvShare> {
        self.share.clone()
    }

    fn copy_kv_into(
        &mut self,
        target: &DirectTarget,
        offset: usize,
        blocks: &[u32],
    ) -> Result<(), String> {
        self.peers
            .copy_into(&self.model.gpu, &self.kv, target, offset, blocks)
            .map_err(|e| e.to_string())
    }

    fn run(&mut self, chunks: &[SeqChunk<'_>]) -> Vec<Next> {
        // A failed step leaves no way to go on: the device state is unknown.
        let results = self
            .step(chunks, StepOutput::Logits)
            .unwrap_or_else(|e| panic!("CUDA step failed: {e}"));
        results
            .into_iter()
            .map(|r| match r {
                ChunkResult::Logits(l) if l.is_empty() => Next::Pending,
                ChunkResult::Logits(l) => Next::Logits(l),
                ChunkResult::Tokens(t) => t.first().map_or(Next::Pending, |&t| Next::Token(t)),
            })
            .collect()
    }
}
