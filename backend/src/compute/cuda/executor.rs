//! The engine's executor on a GPU: the scheduler hands it a batch of chunks,
//! it runs `CudaLlama::forward` over the paged KV cache on the device and
//! gives the logits back to the sampler.

use crate::engine::{Executor, Next};
use crate::model::SeqChunk;

use super::device::GpuError;
use super::model::{ChunkResult, CudaKvCache, CudaLlama, Numerics, StepOutput, Workspace};

#[derive(Debug)]
pub struct CudaExecutor {
    pub model: CudaLlama,
    pub kv: CudaKvCache,
    workspace: Workspace,
}

impl CudaExecutor {
    /// A KV cache of `kv_blocks` pages of `block_size` tokens beside the model.
    pub fn new(model: CudaLlama, kv_blocks: usize, block_size: usize) -> Result<Self, GpuError> {
        let kv = CudaKvCache::new(&model.gpu, &model.config, kv_blocks, block_size)?;
        let workspace = Workspace::new(&model.gpu)?;
        Ok(CudaExecutor {
            model,
            kv,
            workspace,
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
