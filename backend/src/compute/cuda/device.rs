//! One GPU as the engine uses it: the context and its one stream, every kernel
//! loaded (compiled for this device's architecture, or taken from the cache),
//! cuBLAS for the BF16 GEMMs, and small helpers for launches and copies.
//!
//! Device buffers are `CudaSlice`s owned by whoever allocated them; launches
//! take raw device addresses (`DevPtr`), so that sub-ranges (a layer of the KV
//! cache, one part of a fused weight) need no borrows. Event tracking is off:
//! everything runs on the one stream, in order.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::cublas::{CudaBlas, sys as blas};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    DriverError, LaunchConfig, ValidAsZeroBits,
};

use super::nvrtc::{self, CompileError, KERNEL_FILES};

/// A device address (what a kernel's pointer parameter receives).
pub type DevPtr = u64;

/// Token rows of every cuBLAS call (see `Gpu::gemm_bf16`).
pub const GEMM_ROW_TILE: usize = 128;

/// Bytes of cuBLAS workspace (its guide suggests 32 MiB on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver (libcuda) on this machine")]
    NoDriver,
    #[error("CUDA: {0}")]
    Driver(#[from] DriverError),
    #[error("cuBLAS: {0:?}")]
    Blas(cudarc::cublas::result::CublasError),
    #[error(transparent)]
    Compile(#[from] CompileError),
    #[error("{0}")]
    Other(String),
}

/// True when the CUDA driver library can be loaded and sees at least one GPU.
pub fn cuda_available() -> bool {
    gpu_count() > 0
}

/// The GPUs the CUDA driver sees (0 without the driver library).
pub fn gpu_count() -> usize {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// The architecture NVRTC compiles for on a device of compute capability
/// `major.minor`: the arch-specific target (`sm_90a`) where there is one.
pub fn arch_for(major: i32, minor: i32) -> String {
    match (major, minor) {
        (9, 0) | (10, 0) | (10, 3) | (12, 0) => format!("sm_{major}{minor}a"),
        _ => format!("sm_{major}{minor}"),
    }
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// e.g. "NVIDIA H200".
    pub name: String,
    /// What the kernels were compiled for, e.g. "sm_90a".
    pub arch: String,
    pub sm_count: u32,
    blas: CudaBlas,
    /// cuBLAS's workspace (kept alive with the handle).
    #[allow(dead_code)]
    blas_workspace: CudaSlice<u8>,
    functions: HashMap<String, CudaFunction>,
    /// Launch kernels as programmatic dependent launches (`launch`): on
    /// from compute capability 9.0, off with `SLUICE_PDL=0` or
    /// `set_dependent_launch(false)` (to measure what it gives).
    dependent_launch: AtomicBool,
    /// Thread block clusters (`launch_cluster_early`): from compute capability
    /// 9.0 on, off with `SLUICE_CLUSTERS=0` (to measure what they give).
    clusters: bool,
    /// True while `capture` records: launches inside decode graphs are plain
    /// (programmatic edges there measured 2% slower at batch 1), those of
    /// `launch_early` aside.
    capturing: AtomicBool,
    /// Whether `launch_early` makes programmatic edges inside graphs too (off
    /// with `SLUICE_GRAPH_PDL=0`, to measure what they give).
    early_in_graphs: bool,
    /// An SM's shared memory, and the most one block may opt in to
    /// (`shared_for_at_most`).
    shared_per_sm: u32,
    shared_per_block: u32,
    /// `shared_for_at_most`'s answers by kernel, threads, shared bytes and
    /// blocks an SM (occupancy queries are driver calls).
    spread_shared: std::sync::Mutex<HashMap<(String, u32, u32, u32), u32>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .field("sm_count", &self.sm_count)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens GPU `ordinal` and loads every kernel.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, GpuError> {
        if !cuda_available() {
            return Err(GpuError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: one stream does all the work, in order; no cross-stream
        // hazards for the events to guard.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured
        // into CUDA graphs.
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = arch_for(major, minor);
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        let shared_per_sm = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )? as u32;
        let shared_per_block = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as u32;
        let mut functions = HashMap::new();
        for file in KERNEL_FILES.iter().filter(|f| f.builds_for(&arch)) {
            let started = std::time::Instant::now();
            let cubin = nvrtc::compile_cached(file, &arch)?;
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
            for name in kernel_names(file.source) {
                // A name read wrong from the source (`kernel_names`) fails here.
                let f = module.load_function(&name).map_err(|e| {
                    GpuError::Other(format!("kernel `{name}` of {}: {e}", file.name))
                })?;
                functions.insert(name, f);
            }
            tracing::debug!(file = file.name, %arch, ms = started.elapsed().as_millis() as u64, "kernels loaded");
        }
        let blas = CudaBlas::new(stream.clone()).map_err(GpuError::Blas)?;
        // cuBLAS gets a workspace of its own, so that it allocates nothing
        // while a graph is being captured.
        let blas_workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE)?;
        {
            let (ptr, _guard) = blas_workspace.device_ptr(&stream);
            // SAFETY: a live handle; the buffer outlives it (both in Gpu).
            let status = unsafe {
                blas::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut c_void, BLAS_WORKSPACE)
            };
            if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(GpuError::Other(format!("cublasSetWorkspace: {status:?}")));
            }
        }
        Ok(Arc::new(Gpu {
            blas_workspace,
            name: ctx.name()?,
            ctx,
            stream,
            arch,
            sm_count,
            blas,
            functions,
            capturing: AtomicBool::new(false),
            early_in_graphs: std::env::var("SLUICE_GRAPH_PDL").map_or(true, |v| v != "0"),
            shared_per_sm,
            shared_per_block,
            spread_shared: Default::default(),
            clusters: major >= 9 && std::env::var("SLUICE_CLUSTERS").map_or(true, |v| v != "0"),
            dependent_launch: AtomicBool::new(
                major >= 9 && std::env::var("SLUICE_PDL").map_or(true, |v| v != "0"),
            ),
        }))
    }

    /// A loaded kernel; panics on a name no kernel file defines (a bug here).
    pub fn function(&self, name: &str) -> &CudaFunction {
        self.functions
            .get(name)
            .unwrap_or_else(|| panic!("no kernel named {name}"))
    }

    /// How many blocks of kernel `name` an SM runs at once with `threads`
    /// threads and `shared` bytes of dynamic shared memory each (the
    /// driver's occupancy calculator: registers, shared memory, bounds).
    pub fn blocks_per_sm(&self, name: &str, threads: u32, shared: u32) -> Result<u32, GpuError> {
        let f = self.function(name);
        opt_in_shared(f, shared)?;
        Ok(f.occupancy_max_active_blocks_per_multiprocessor(threads, shared as usize, None)?)
    }

    /// The dynamic shared memory, `shared` or more, with which an SM runs at
    /// most `most` blocks of kernel `name` (`threads` a block) at once; the
    /// extra is never used. For a grid of `most` blocks an SM or fewer that
    /// is a programmatic launch: its blocks start as those of the kernel ahead
    /// end, and the block scheduler fills the SM that frees first up to its
    /// limit, so without a cap the SMs that finish early take more than their
    /// share while others take none (`bench/gpu/pdl_placement.cu`; the fused
    /// FP4 GEMVs 2% slower at batch 1, BENCHMARKS.md). `shared` where it is
    /// already so, or where no size a block may have is enough.
    pub fn shared_for_at_most(
        &self,
        name: &str,
        threads: u32,
        shared: u32,
        most: u32,
    ) -> Result<u32, GpuError> {
        let key = (name.to_string(), threads, shared, most);
        if let Some(&found) = self.spread_shared.lock().expect("not poisoned").get(&key) {
            return Ok(found);
        }
        let found = if self.blocks_per_sm(name, threads, shared)? <= most {
            shared
        } else {
            // From a little under an SM's share for most + 1 blocks (the
            // block's static shared memory and the driver's reserve come on
            // top), up.
            let mut s =
                shared.max((self.shared_per_sm / (most + 1)).saturating_sub(4096) / 256 * 256);
            loop {
                if s > self.shared_per_block {
                    break shared;
                }
                if self.blocks_per_sm(name, threads, s)? <= most {
                    break s;
                }
                s += 256;
            }
        };
        self.spread_shared
            .lock()
            .expect("not poisoned")
            .insert(key, found);
        Ok(found)
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<(), GpuError> {
        Ok(self.ctx.bind_to_thread()?)
    }

    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, GpuError> {
        Ok(self.stream.alloc_zeros::<T>(len.max(1))?)
    }

    /// `len` zeroed values from `cuMemAlloc` rather than the stream-ordered
    /// pool, so that other processes can map them (`cuIpcGetMemHandle`
    /// refuses pool memory). The slice must not be dropped as it is (its
    /// drop frees into the pool): free it with [`free_shareable`].
    pub fn alloc_shareable<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, GpuError> {
        use cudarc::driver::sys;
        let bytes = len.max(1) * std::mem::size_of::<T>();
        self.bind()?;
        let mut ptr = 0;
        // SAFETY: an out-pointer; this thread holds the context.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }.result()?;
        // SAFETY: `ptr` holds `bytes` bytes (just allocated); zero is a valid T.
        unsafe {
            sys::cuMemsetD8_v2(ptr, 0, bytes).result()?;
            Ok(self.stream.upgrade_device_ptr(ptr, len.max(1)))
        }
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, GpuError> {
        if data.is_empty() {
            // SAFETY: a one-element allocation nobody reads.
            return Ok(unsafe { self.stream.alloc::<T>(1)? });
        }
        Ok(self.stream.clone_htod(data)?)
    }

    /// Copies `data` to the start of `dst`.
    pub fn upload_into<T: DeviceRepr>(
        &self,
        data: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), GpuError> {
        if !data.is_empty() {
            self.stream
                .memcpy_htod(data, &mut dst.slice_mut(..data.len()))?;
        }
        Ok(())
    }

    /// The first `len` elements of `src`, on the host (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
        len: usize,
    ) -> Result<Vec<T>, GpuError> {
        let mut out = vec![T::default(); len];
        if len > 0 {
            self.stream.memcpy_dtoh(&src.slice(..len), &mut out)?;
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    pub fn synchronize(&self) -> Result<(), GpuError> {
        Ok(self.stream.synchronize()?)
    }

    /// The kernels `record` enqueues on the stream, captured into a graph
    /// (not run). A capture broken by another thread is reported as the
    /// driver's error (`capture_broken_by_another_thread`), whatever the
    /// call that met it said (cuBLAS reports an execution failure).
    pub fn capture(
        &self,
        record: impl FnOnce() -> Result<(), GpuError>,
    ) -> Result<CudaGraph, GpuError> {
        self.stream.begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )?;
        self.capturing.store(true, Ordering::Relaxed);
        let recorded = record();
        self.capturing.store(false, Ordering::Relaxed);
        let graph = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        match (recorded, graph) {
            (_, Err(e)) if capture_broken_by_another_thread(e) => Err(GpuError::Driver(e)),
            (Err(e), _) => Err(e),
            (Ok(()), graph) => graph?.ok_or_else(|| GpuError::Other("empty CUDA graph".into())),
        }
    }

    /// Whether `launch` makes programmatic dependent launches.
    pub fn dependent_launch(&self) -> bool {
        self.dependent_launch.load(Ordering::Relaxed)
    }

    /// Turns programmatic dependent launches on or off (on only where the
    /// GPU has them, compute capability 9.0 on); graphs captured before
    /// keep what they were captured with.
    pub fn set_dependent_launch(&self, on: bool) -> Result<(), GpuError> {
        let (major, _) = self.ctx.compute_capability()?;
        self.dependent_launch
            .store(on && major >= 9, Ordering::Relaxed);
        Ok(())
    }

    /// Launches kernel `name` with `args` (each passed by reference), as a
    /// programmatic dependent launch where `dependent_launch()` is on and no
    /// graph is being captured: the kernel may start while the one ahead of
    /// it on the stream finishes, and waits for it inside
    /// (`wait_for_previous_kernels` in common.cuh, which every kernel calls
    /// first).
    pub fn launch(
        &self,
        name: &str,
        config: LaunchConfig,
        args: &[&dyn KernelArg],
    ) -> Result<(), GpuError> {
        self.launch_with(name, config, None, false, args)
    }

    /// `launch`, programmatic inside graphs too (unless `SLUICE_GRAPH_PDL=0`):
    /// for a kernel whose blocks do useful work before their wait, as the
    /// fused one-token and the 16-token FP4 GEMVs copy their first weights
    /// (`fp4_gemv`), with its blocks held to their share of each SM
    /// (`shared_for_at_most`). (Every kernel so: 2% slower at batch 1,
    /// BENCHMARKS.md.)
    pub fn launch_early(
        &self,
        name: &str,
        config: LaunchConfig,
        args: &[&dyn KernelArg],
    ) -> Result<(), GpuError> {
        self.launch_with(name, config, None, true, args)
    }

    /// Whether `launch_early` makes a programmatic launch (where capturing
    /// or not), so that its caller spreads the grid.
    pub fn launches_early(&self) -> bool {
        self.dependent_launch() && (self.early_in_graphs || !self.capturing.load(Ordering::Relaxed))
    }

    /// Whether the GPU runs thread block clusters of up to 16 blocks
    /// (compute capability 9.0 on), for `launch_cluster_early`.
    pub fn has_clusters(&self) -> bool {
        self.clusters
    }

    /// `launch_early`, with the grid in clusters of `cluster` blocks (x, y,
    /// z; each a divisor of the grid's; at most 16 blocks in all, where
    /// `has_clusters`): a cluster's blocks run at once and read each other's
    /// shared memory. For the decode attention kernels, which load their
    /// first keys before they wait (`attention.cu`, EARLY). Not spread by
    /// `shared_for_at_most`: a 128-dim block's registers hold it to one an
    /// SM already (154 registers a thread, 256 threads).
    pub fn launch_cluster_early(
        &self,
        name: &str,
        config: LaunchConfig,
        cluster: (u32, u32, u32),
        args: &[&dyn KernelArg],
    ) -> Result<(), GpuError> {
        self.launch_with(name, config, Some(cluster), true, args)
    }

    fn launch_with(
        &self,
        name: &str,
        config: LaunchConfig,
        cluster: Option<(u32, u32, u32)>,
        early: bool,
        args: &[&dyn KernelArg],
    ) -> Result<(), GpuError> {
        use cudarc::driver::sys;
        let f = self.function(name);
        opt_in_shared(f, config.shared_mem_bytes)?;
        self.ctx.bind_to_thread()?;
        let mut params: Vec<*mut c_void> = args.iter().map(|a| a.as_param()).collect();
        // SAFETY: a zeroed attribute is a valid "ignore" value; the fields
        // set are the ones the attribute id names.
        let mut attributes: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut count = 0;
        if let Some((x, y, z)) = cluster {
            if x * y * z > 8 {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                )?;
            }
            let a = &mut attributes[count];
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            a.value.clusterDim.x = x;
            a.value.clusterDim.y = y;
            a.value.clusterDim.z = z;
            count += 1;
        }
        let programmatic = if early {
            self.launches_early()
        } else {
            self.dependent_launch() && !self.capturing.load(Ordering::Relaxed)
        };
        if programmatic {
            let a = &mut attributes[count];
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            a.value.programmaticStreamSerializationAllowed = 1;
            count += 1;
        }
        let launch = sys::CUlaunchConfig {
            gridDimX: config.grid_dim.0,
            gridDimY: config.grid_dim.1,
            gridDimZ: config.grid_dim.2,
            blockDimX: config.block_dim.0,
            blockDimY: config.block_dim.1,
            blockDimZ: config.block_dim.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attributes.as_mut_ptr(),
            numAttrs: count as u32,
        };
        // SAFETY: the kernel's parameters are, in order, the values in
        // `params` (each points at a live u64, i32, u32 or f32 for the
        // call); every pointer among them is a live device buffer of the
        // size the kernel reads (each call site says why).
        unsafe {
            sys::cuLaunchKernelEx(
                &launch,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()?;
        }
        Ok(())
    }

    /// `y[n, rows] = x[n, cols] . w[rows, cols]^T (+ y when accumulate)`:
    /// BF16 weights and activations (row-major), f32 output and accumulation,
    /// through cuBLAS in calls of exactly `GEMM_ROW_TILE` token rows.
    ///
    /// Batch invariance: every call has the same shape whatever the batch, so
    /// cuBLAS runs the same kernel and a token's row comes out bit-identical
    /// whether it ran alone or beside 200 others (the engine's continuous
    /// batching must not change greedy answers). x and y must have room for n
    /// rounded up to the tile; the extra rows are scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16(
        &self,
        w: DevPtr,
        x: DevPtr,
        y: DevPtr,
        n: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        for first in (0..n).step_by(GEMM_ROW_TILE) {
            self.cublas_gemm_bf16(
                w,
                x + (first * cols * 2) as u64,
                y + (first * rows * 4) as u64,
                GEMM_ROW_TILE,
                rows,
                cols,
                accumulate,
            )?;
        }
        Ok(())
    }

    /// The fastest GEMM for `n` tokens, batch invariance aside: our GEMV
    /// for one token, cuBLAS at the batch's own size otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16_fast(
        &self,
        w: DevPtr,
        x: DevPtr,
        y: DevPtr,
        n: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        if n == 1 && cols.is_multiple_of(8) {
            return self.gemv_bf16(w, x, y, n, rows, cols, accumulate);
        }
        self.cublas_gemm_bf16(w, x, y, n, rows, cols, accumulate)
    }

    /// One to eight tokens through our GEMV kernel (cols a multiple of 8):
    /// bandwidth-bound decode without tensor cores, the base of the FP4
    /// kernels. Not batch-invariant against `gemm_bf16`, so the model does
    /// not mix the two.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_bf16(
        &self,
        w: DevPtr,
        x: DevPtr,
        y: DevPtr,
        n: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        // Kernel and rows per block (gemv.cu).
        let (name, rows_per_block) = match n {
            1 => ("gemv_bf16_n1", 2),
            2 => ("gemv_bf16_n2", 4),
            3 | 4 => ("gemv_bf16_n4", 4),
            5..=8 => ("gemv_bf16_n8", 8),
            _ => return Err(GpuError::Other(format!("GEMV of {n} tokens"))),
        };
        // SAFETY: as for cuBLAS below; the kernel reads whole 16-byte groups
        // of columns (cols is a multiple of 8).
        self.launch(
            name,
            grid((rows.div_ceil(rows_per_block) as u32, 1, 1), 128, 0),
            &[
                &w,
                &x,
                &y,
                &(n as i32),
                &(rows as i32),
                &(cols as i32),
                &i32::from(accumulate),
            ],
        )
    }

    /// `gemm_bf16` through cuBLAS.
    #[allow(clippy::too_many_arguments)]
    pub fn cublas_gemm_bf16(
        &self,
        w: DevPtr,
        x: DevPtr,
        y: DevPtr,
        n: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0 };
        // Column-major view: y^T[rows, n] = w[cols, rows]^T . x^T[cols, n].
        // SAFETY: w holds rows x cols bf16, x n x cols bf16, y n x rows f32.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                n as i32,
                cols as i32,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                blas::cudaDataType::CUDA_R_16BF,
                cols as i32,
                x as *const c_void,
                blas::cudaDataType::CUDA_R_16BF,
                cols as i32,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                blas::cudaDataType::CUDA_R_32F,
                rows as i32,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(GpuError::Blas)
    }

    /// The device address of `s`, `offset` elements in.
    pub fn ptr<T>(&self, s: &CudaSlice<T>, offset: usize) -> DevPtr {
        let (p, _guard) = s.device_ptr(&self.stream);
        p + (offset * std::mem::size_of::<T>()) as u64
    }
}

/// Frees what [`Gpu::alloc_shareable`] gave, once its stream is done with it.
pub fn free_shareable<T>(slice: CudaSlice<T>) -> Result<(), GpuError> {
    let stream = slice.stream().clone();
    stream.synchronize()?;
    stream.context().bind_to_thread()?;
    let ptr = slice.leak();
    // SAFETY: `ptr` came from cuMemAlloc and nothing uses it any more.
    unsafe { cudarc::driver::sys::cuMemFree_v2(ptr) }.result()?;
    Ok(())
}

/// Lets kernel `f` take `shared` bytes of dynamic shared memory: past 48 KB,
/// static and dynamic together, a kernel must opt in (a kernel's dynamic
/// stages may sit beside static shared memory of its own); once would be
/// enough, and the call is cheap.
fn opt_in_shared(f: &CudaFunction, shared: u32) -> Result<(), GpuError> {
    if shared > 0 {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )?;
    }
    Ok(())
}

/// Whether a capture failed because it was invalidated: with several engines
/// on one GPU (in-process workers, a prefill and a decode engine), another
/// thread's CUDA call can break this thread's capture even in thread-local
/// mode. Seen on the H200 in 4 of 22 runs of `backend/tests/cuda.rs`, whose
/// tests run engines in parallel (never in 5 runs one test at a time), as a
/// step failing with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED or cuBLAS's
/// EXECUTION_FAILED; with the fallback, 14 of 14 runs passed. Nothing
/// captured has run, so the step can run without a graph.
pub fn capture_broken_by_another_thread(e: cudarc::driver::DriverError) -> bool {
    use cudarc::driver::sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            | CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            | CUDA_ERROR_STREAM_CAPTURE_UNJOINED
            | CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    )
}

/// A value a kernel takes: passed to a launch by reference.
pub trait KernelArg {
    /// Where the value is, as the driver's kernel-parameter array holds it.
    fn as_param(&self) -> *mut c_void;
}

macro_rules! kernel_arg {
    ($($t:ty),*) => {$(
        impl KernelArg for $t {
            fn as_param(&self) -> *mut c_void {
                self as *const $t as *mut c_void
            }
        }
    )*};
}
kernel_arg!(u64, i32, u32, f32);

/// Grid of `blocks` blocks of `threads`, with `shared` bytes of dynamic shared memory.
pub fn grid(blocks: (u32, u32, u32), threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: blocks,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// A grid-stride launch over `n` elements.
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_535) as u32;
    grid((blocks, 1, 1), 256, 0)
}

/// The names of the `extern "C" __global__` functions in a kernel source,
/// read from the text: each kernel must be written out, not made by a macro
/// (whose parameter would be read as the name; a test checks the files).
pub fn kernel_names(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    for part in source.split("extern \"C\" __global__").skip(1) {
        // `void [__launch_bounds__(n)] name(`
        let head = part.split('(').collect::<Vec<_>>();
        let before_paren = if part.trim_start().starts_with("void __launch_bounds__") {
            head.get(1).copied()
        } else {
            head.first().copied()
        };
        if let Some(name) = before_paren.and_then(|s| s.split_whitespace().last()) {
            let name = name.trim_start_matches(')');
            names.push(name.to_string());
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_kernel_name() {
        let names = kernel_names(include_str!("../../../../kernels/attention.cu"));
        assert_eq!(
            names,
            [
                "attention_decode_mma_hd64",
                "attention_decode_mma_hd128",
                "attention_decode_cluster_hd64",
                "attention_decode_cluster_hd128",
                "attention_prefill_hd64",
                "attention_prefill_hd128",
                "attention_combine"
            ]
        );
        let names = kernel_names(include_str!("../../../../kernels/layers.cu"));
        assert_eq!(
            names,
            [
                "embed_rows",
                "rms_norm",
                "rope_store_kv",
                "silu_mul",
                "argmax_rows"
            ]
        );
    }

    /// The body of each `extern "C" __global__` function of `source`, after
    /// its parameter list (braces matched).
    fn kernel_bodies(source: &str) -> Vec<&str> {
        let mut bodies = Vec::new();
        for (at, _) in source.match_indices("extern \"C\" __global__") {
            let rest = &source[at..];
            let (mut depth, mut open) = (0i32, None);
            for (i, ch) in rest.char_indices() {
                match ch {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    '{' if depth == 0 && open.is_none() => {
                        open = Some(i + 1);
                        depth = 0;
                    }
                    _ => {}
                }
                if open.is_some() {
                    break;
                }
            }
            let open = open.expect("a kernel body");
            let mut braces = 1;
            let end = rest[open..]
                .char_indices()
                .find_map(|(i, ch)| {
                    match ch {
                        '{' => braces += 1,
                        '}' => braces -= 1,
                        _ => {}
                    }
                    (braces == 0).then_some(open + i)
                })
                .expect("a closed kernel body");
            bodies.push(&rest[open..end]);
        }
        bodies
    }

    /// A kernel body's lines that are not blank or comments, trimmed.
    fn statements(body: &str) -> Vec<&str> {
        body.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("//"))
            .collect()
    }

    /// Asserts that kernel file `file` has `lines`, in this order, from the
    /// first one's first place on.
    fn assert_in_order(file: &str, lines: &[&str]) {
        let source = KERNEL_FILES.iter().find(|f| f.name == file).unwrap().source;
        let from = source.find(lines[0]).expect(lines[0]);
        let at: Vec<usize> = lines
            .iter()
            .map(|l| from + source[from..].find(l).expect(l))
            .collect();
        assert!(
            at.windows(2).all(|w| w[0] < w[1]),
            "{file}: {lines:?} in order"
        );
    }

    /// Kernels are launched as programmatic dependent launches, so each must
    /// wait for the kernels ahead of it before anything else (common.cuh),
    /// but for the fused one-token and the 16-token FP4 GEMVs, which copy
    /// only weights first and wait inside `fp4_gemv`, and the decode
    /// attention kernels in clusters, which load earlier steps' keys first
    /// and wait inside `attention_decode_mma`.
    #[test]
    fn every_kernel_waits_for_the_kernels_ahead_first() {
        let mut kernels = 0;
        let mut waiting_inside = 0;
        for file in KERNEL_FILES {
            let names = kernel_names(file.source);
            let bodies = kernel_bodies(file.source);
            assert_eq!(names.len(), bodies.len(), "{}", file.name);
            for (name, body) in names.iter().zip(bodies) {
                kernels += 1;
                // The kernels that wait inside: one statement, a call whose
                // prologue waits after reads no kernel ahead writes.
                let waits_inside: Option<fn(&str) -> bool> =
                    if file.name == "fp4.cu" && (name.ends_with("_n1") || name.contains("_n16")) {
                        // fp4_gemv of a fused mode or of two 8-token tiles, which
                        // waits after the weights' copies.
                        Some(|call| {
                            ["fp4_gemv<false, ", "fp4_gemv<true, "].iter().any(|f| {
                                let args = call.strip_prefix(f).unwrap_or_default();
                                args.starts_with("2, ")
                                    || (args.starts_with("1, FP4_") && !args.contains("FP4_PLAIN"))
                            })
                        })
                    } else if file.name == "attention.cu"
                        && name.starts_with("attention_decode_cluster_")
                    {
                        // attention_decode_mma with EARLY, which waits after the
                        // earlier steps' keys.
                        Some(|call| {
                            call.starts_with("attention_decode_mma<")
                                && call.contains(", 8, true, true>(")
                        })
                    } else {
                        None
                    };
                if let Some(waits_inside) = waits_inside {
                    let call = statements(body);
                    assert!(call.len() == 1 && waits_inside(call[0]), "{name}: {body}");
                    waiting_inside += 1;
                    continue;
                }
                assert!(
                    body.trim_start()
                        .starts_with("wait_for_previous_kernels();"),
                    "{}: {name} does not wait first: {}",
                    file.name,
                    body.trim_start().lines().next().unwrap_or_default()
                );
            }
        }
        assert!(kernels > 30, "{kernels} kernels");
        assert_eq!(
            waiting_inside,
            6 + 6 + 2,
            "the fused and 16-token FP4 kernels, the cluster decode kernels"
        );
        // fp4_gemv's prologue there: the first item's weights, the wait, x.
        assert_in_order(
            "fp4.cu",
            &[
                "issue(fp4_int<1>{});",
                "wait_for_previous_kernels();",
                "issue(fp4_int<2>{});",
            ],
        );
        // attention_decode_mma's with EARLY: keys before the query's, the
        // wait, then the rest of the first step's keys.
        assert_in_order(
            "attention.cu",
            &[
                "if (EARLY) {",
                "load_kv(n0, 0, min(k_end, q_pos));",
                "wait_for_previous_kernels();",
                "load_kv(n0, q_pos, k_end);",
            ],
        );
        // The bodies are found whole: a body that writes before it waits is
        // told apart from one that waits first.
        let late = "extern \"C\" __global__ void __launch_bounds__(128) k(int* p) {\n    p[0] = 1;\n    wait_for_previous_kernels();\n}";
        assert_eq!(
            kernel_bodies(late)[0].trim(),
            "p[0] = 1;\n    wait_for_previous_kernels();"
        );
    }

    /// The first line (1-based) of `source` that defines a kernel inside a
    /// macro: on a `#define` line or one that a backslash continues.
    fn kernel_inside_a_macro(source: &str) -> Option<usize> {
        let mut continued = false;
        for (i, line) in source.lines().enumerate() {
            let in_macro = continued || line.trim_start().starts_with("#define");
            if in_macro && line.contains("extern \"C\" __global__") {
                return Some(i + 1);
            }
            continued = line.trim_end().ends_with('\\');
        }
        None
    }

    /// A kernel defined inside a macro would be read under the macro's
    /// parameter name and fail to load with every other kernel of its file.
    #[test]
    fn no_kernel_is_defined_inside_a_macro() {
        for file in KERNEL_FILES {
            assert_eq!(kernel_inside_a_macro(file.source), None, "{}", file.name);
        }
        let made =
            "#define K(NAME) \\\n    extern \"C\" __global__ void NAME(int* p) { \\\n    }\nK(a)\n";
        assert_eq!(kernel_names(made), ["NAME"]);
        assert_eq!(kernel_inside_a_macro(made), Some(2));
        let one_line = "#define K extern \"C\" __global__ void k(int* p) {}\n";
        assert_eq!(kernel_inside_a_macro(one_line), Some(1));
        let after_a_macro =
            "#define X(a) \\\n    (a)\nextern \"C\" __global__ void k(int* p) {\n}\n";
        assert_eq!(kernel_inside_a_macro(after_a_macro), None);
        assert_eq!(kernel_names(after_a_macro), ["k"]);
    }

    #[test]
    fn arch_names() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(10, 3), "sm_103a");
        assert_eq!(arch_for(8, 9), "sm_89");
    }
}
