//! Which compute backend runs an engine: the CPU (the reference) or a CUDA
//! GPU. `auto` takes GPU 0 where a CUDA driver and a GPU are present.

use std::sync::Arc;

use super::core::{Engine, EngineConfig};
use crate::compute::cuda::nvrtc::nvrtc_present;
use crate::compute::cuda::{CudaExecutor, CudaLlama, Gpu, GpuError, Numerics, cuda_available};
use crate::model::{Llama, Tokenizer};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// CUDA GPU 0 when there is one, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// The CUDA GPU of this ordinal.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: auto, cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Device {
    /// `Auto` made concrete for this machine: a GPU needs the CUDA driver
    /// and NVRTC (which compiles the kernels); without NVRTC, the CPU, said
    /// in the log.
    pub fn resolve(self) -> Device {
        match self {
            Device::Auto if cuda_available() && nvrtc_present() => Device::Cuda(0),
            Device::Auto if cuda_available() => {
                tracing::warn!(
                    "a GPU is present but libnvrtc.so.13 is not on LD_LIBRARY_PATH \
                     (`make nvrtc` fetches it): running on the CPU"
                );
                Device::Cpu
            }
            Device::Auto => Device::Cpu,
            other => other,
        }
    }
}

impl Engine {
    /// Starts the engine over `model` on `device`: the CPU forward pass, or the
    /// weights copied to the GPU with a KV cache of `config.kv_blocks` pages,
    /// computing with `numerics` (the CPU's are batch-invariant already).
    pub fn start_on(
        device: Device,
        numerics: Numerics,
        model: Arc<Llama>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
    ) -> Result<Engine, GpuError> {
        match device.resolve() {
            Device::Cuda(ordinal) => {
                let started = std::time::Instant::now();
                let gpu = Gpu::open(ordinal)?;
                let cuda = CudaLlama::from_host(gpu.clone(), &model)?;
                let weights_mb = cuda.weight_bytes() / 1_000_000;
                let mut executor =
                    CudaExecutor::new(cuda, config.kv_blocks as usize, config.block_size)?;
                executor.set_numerics(numerics);
                tracing::info!(
                    gpu = %gpu.name,
                    arch = %gpu.arch,
                    ?numerics,
                    weights_mb,
                    load_ms = started.elapsed().as_millis() as u64,
                    "engine on CUDA"
                );
                Ok(Engine::start_with(Box::new(executor), tokenizer, config))
            }
            _ => Ok(Engine::start(model, tokenizer, config)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:1".parse::<Device>(), Ok(Device::Cuda(1)));
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert!("gpu".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert_eq!("fast".parse::<Numerics>(), Ok(Numerics::Fast));
        assert_eq!(
            "batch-invariant".parse::<Numerics>(),
            Ok(Numerics::BatchInvariant)
        );
        assert!("exact".parse::<Numerics>().is_err());
    }
}
