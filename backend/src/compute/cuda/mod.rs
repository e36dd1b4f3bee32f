//! The CUDA backend: the same Llama forward pass as `compute::cpu`, on one
//! NVIDIA GPU, through cudarc. Kernels (the top-level `kernels/*.cu`) are compiled by NVRTC
//! at first use for the device's architecture and cached (`nvrtc`); BF16 GEMMs
//! go to cuBLAS. Everything is loaded at run time, so machines without a GPU
//! run the rest of sluice and skip the GPU tests.

pub mod bench;
pub mod device;
pub mod executor;
pub mod fp4;
pub mod fp4_blackwell;
pub mod layers;
pub mod model;
pub mod nvrtc;
mod plan;
#[cfg(test)]
mod tests;
pub mod transfer;

pub use device::{Gpu, GpuError, cuda_available, gpu_count};
pub use executor::CudaExecutor;
pub use fp4::{
    FP4_GEMM_MAX_TOKENS, FP4_GEMV_MAX_TOKENS, FP4_SWEEP_TOKENS, Fp4PrefillFigure, Fp4Weights,
    SumOrder, fp4_prefill_sweep, fp4_sweep,
};
pub use model::{ChunkResult, CudaKvCache, CudaLlama, Numerics, StepOutput, Workspace};
