//! KV pages between caches of one node (the same-node transports of
//! disaggregated prefill/decode), one gather kernel for every page, all
//! layers, K and V, instead of one memcpy per page: between two GPUs of one
//! process over peer access (`copy_pages`, run on the destination), and
//! into another process's cache over CUDA IPC (`share_of` on the decode
//! side, `PeerCaches::copy_into` on the prefill side, run on the source:
//! the kernel reads local pages and writes the mapped ones).

use std::collections::HashMap;

use cudarc::driver::sys;

use super::device::{DevPtr, Gpu, GpuError, grid};
use super::model::CudaKvCache;
use crate::transfer::{DirectTarget, KvShare, node_id};

/// Lets kernels on `dst` read `src`'s memory. Errors where the two GPUs have
/// no peer path.
pub fn enable_peer_access(dst: &Gpu, src: &Gpu) -> Result<(), GpuError> {
    let (mut can, d, s) = (0, dst.ctx.cu_device(), src.ctx.cu_device());
    // SAFETY: an out-pointer to a live integer and two valid devices.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, d, s) }.result()?;
    if can == 0 {
        return Err(GpuError::Other(format!(
            "GPU {} cannot read GPU {}'s memory (no peer access)",
            dst.ctx.ordinal(),
            src.ctx.ordinal()
        )));
    }
    dst.bind()?;
    // SAFETY: dst's context is current; src's context is alive (in src).
    let result = unsafe { sys::cuCtxEnablePeerAccess(src.ctx.cu_ctx(), 0) };
    match result {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
        other => return Err(GpuError::Other(format!("cuCtxEnablePeerAccess: {other:?}"))),
    }
    // Buffers come from src's stream-ordered allocator (its default memory
    // pool), which peer access alone does not open: grant dst read and write
    // on the pool too.
    let mut pool = std::ptr::null_mut();
    // SAFETY: an out-pointer and a valid device.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, s) }.result()?;
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: d,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: a live pool and one access descriptor.
    unsafe { sys::cuMemPoolSetAccess(pool, &access, 1) }.result()?;
    Ok(())
}

/// Copies pages `src_pages[i]` of `src` (on `src_gpu`) into pages
/// `dst_pages[i]` of `dst` (on `dst_gpu`), every layer, K and V, in one
/// launch on `dst_gpu`'s stream. Waits for `src_gpu`'s stream first (the
/// pages must be written); returns once the copy is queued (the next work on
/// `dst_gpu`'s stream sees it). Peer access must be on (`enable_peer_access`).
pub fn copy_pages(
    dst_gpu: &Gpu,
    dst: &mut CudaKvCache,
    dst_pages: &[u32],
    src_gpu: &Gpu,
    src: &CudaKvCache,
    src_pages: &[u32],
) -> Result<(), GpuError> {
    if (src.n_layers, src.block_size, src.kv_dim) != (dst.n_layers, dst.block_size, dst.kv_dim) {
        return Err(GpuError::Other(
            "the two KV caches have different shapes".into(),
        ));
    }
    if src_pages.len() != dst_pages.len() {
        return Err(GpuError::Other("page lists of different lengths".into()));
    }
    let bad =
        |pages: &[u32], cache: &CudaKvCache| pages.iter().any(|&p| p as usize >= cache.n_blocks);
    if bad(src_pages, src) || bad(dst_pages, dst) {
        return Err(GpuError::Other("a page is outside its cache".into()));
    }
    if src_pages.is_empty() {
        return Ok(());
    }
    src_gpu.synchronize()?;
    gather(
        dst_gpu,
        [src_gpu.ptr(&src.k, 0), src_gpu.ptr(&src.v, 0)],
        [dst_gpu.ptr(&dst.k, 0), dst_gpu.ptr(&dst.v, 0)],
        src_pages,
        dst_pages,
        src,
        dst.n_blocks,
    )
}

/// Launches the gather on `gpu`'s stream: page `src_pages[i]` of the cache
/// at `src` (K, V base addresses; `shape`'s layers, pages and sizes) into
/// page `dst_pages[i]` of the one at `dst` (`dst_blocks` pages a layer).
/// Both must be addressable from `gpu` and the pages checked.
fn gather(
    gpu: &Gpu,
    src: [DevPtr; 2],
    dst: [DevPtr; 2],
    src_pages: &[u32],
    dst_pages: &[u32],
    shape: &CudaKvCache,
    dst_blocks: usize,
) -> Result<(), GpuError> {
    gpu.bind()?;
    let lists: Vec<i32> = src_pages
        .iter()
        .chain(dst_pages)
        .map(|&p| p as i32)
        .collect();
    let lists = gpu.upload(&lists)?;
    let page_elems = (shape.block_size * shape.kv_dim) as u64;
    let src_layer = shape.n_blocks as u64 * page_elems;
    let dst_layer = dst_blocks as u64 * page_elems;
    let n = src_pages.len();
    // SAFETY: the caller checked every page index against its cache; the
    // caches hold n_layers x blocks pages of page_elems values, K and V
    // alike, at addresses `gpu` can reach.
    gpu.launch(
        "kv_gather_pages",
        grid((n as u32, shape.n_layers as u32, 2), 256, 0),
        &[
            &src[0],
            &src[1],
            &dst[0],
            &dst[1],
            &gpu.ptr(&lists, 0),
            &gpu.ptr(&lists, n),
            &page_elems,
            &src_layer,
            &dst_layer,
        ],
    )?;
    // `lists` is freed on the stream after the kernel (async free).
    Ok(())
}

/// The cache as another process of this node may map it: CUDA IPC handles
/// of K and V (allocated outside the stream-ordered pool for this), the
/// GPU's UUID, this node's boot id.
pub fn share_of(gpu: &Gpu, kv: &CudaKvCache) -> Result<KvShare, GpuError> {
    gpu.bind()?;
    let handle = |ptr: DevPtr| -> Result<Vec<u8>, GpuError> {
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: an out-pointer; `ptr` is the base of a cuMemAlloc allocation.
        unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) }.result()?;
        Ok(h.reserved.iter().map(|&b| b as u8).collect())
    };
    let (k_addr, v_addr) = (gpu.ptr(&kv.k, 0), gpu.ptr(&kv.v, 0));
    let uuid = gpu.ctx.uuid()?;
    Ok(KvShare {
        node: node_id(),
        pid: std::process::id(),
        device: uuid_string(&uuid.bytes),
        layout: kv.layout(),
        n_blocks: kv.n_blocks as u32,
        k_handle: handle(k_addr)?,
        v_handle: handle(v_addr)?,
        k_addr,
        v_addr,
    })
}

/// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi writes it.
fn uuid_string(bytes: &[std::ffi::c_char; 16]) -> String {
    let hex: String = bytes.iter().map(|&b| format!("{:02x}", b as u8)).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// Other processes' caches this one has mapped (CUDA IPC), by their K
/// handle; each is opened once and closed when this goes away.
#[derive(Debug, Default)]
pub struct PeerCaches {
    mapped: HashMap<Vec<u8>, Mapped>,
}

#[derive(Debug)]
struct Mapped {
    k: DevPtr,
    v: DevPtr,
    /// Opened with cuIpcOpenMemHandle (closed on drop); false: the peer is
    /// in this process and its addresses are used as they are.
    opened: bool,
}

impl PeerCaches {
    /// Copies `blocks` of `src` (on `gpu`) into the target's pages from
    /// block `target.from_block + offset` on, every layer, K and V, and
    /// waits for the copy: when this returns the pages hold the blocks.
    pub fn copy_into(
        &mut self,
        gpu: &Gpu,
        src: &CudaKvCache,
        target: &DirectTarget,
        offset: usize,
        blocks: &[u32],
    ) -> Result<(), GpuError> {
        let peer = &target.share;
        if peer.layout != src.layout() {
            return Err(GpuError::Other(format!(
                "KV layouts differ: {:?} here, {:?} there",
                src.layout(),
                peer.layout
            )));
        }
        let pages = target
            .pages
            .get(offset..offset + blocks.len())
            .ok_or_else(|| {
                GpuError::Other(format!(
                    "blocks {offset}..{} are past the {} pages reserved",
                    offset + blocks.len(),
                    target.pages.len()
                ))
            })?;
        if blocks.iter().any(|&b| b as usize >= src.n_blocks)
            || pages.iter().any(|&p| p >= peer.n_blocks)
        {
            return Err(GpuError::Other("a page is outside its cache".into()));
        }
        if blocks.is_empty() {
            return Ok(());
        }
        let dst = self.map(gpu, peer)?;
        gather(
            gpu,
            [gpu.ptr(&src.k, 0), gpu.ptr(&src.v, 0)],
            dst,
            blocks,
            pages,
            src,
            peer.n_blocks as usize,
        )?;
        gpu.synchronize()
    }

    /// The peer's K and V base addresses in this process.
    fn map(&mut self, gpu: &Gpu, peer: &KvShare) -> Result<[DevPtr; 2], GpuError> {
        if let Some(m) = self.mapped.get(&peer.k_handle) {
            return Ok([m.k, m.v]);
        }
        let mapped = if peer.pid == std::process::id() {
            // A process cannot open its own handles; the addresses are
            // good here (one address space), on the same GPU.
            let ours = uuid_string(&gpu.ctx.uuid()?.bytes);
            if ours != peer.device {
                return Err(GpuError::Other(format!(
                    "a cache on another GPU of this process ({}) needs peer access: copy_pages",
                    peer.device
                )));
            }
            Mapped {
                k: peer.k_addr,
                v: peer.v_addr,
                opened: false,
            }
        } else {
            gpu.bind()?;
            let open = |bytes: &[u8]| -> Result<DevPtr, GpuError> {
                let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
                if bytes.len() != h.reserved.len() {
                    return Err(GpuError::Other(format!(
                        "a CUDA IPC handle of {} bytes (64 expected)",
                        bytes.len()
                    )));
                }
                for (d, &b) in h.reserved.iter_mut().zip(bytes) {
                    *d = b as std::ffi::c_char;
                }
                let mut ptr = 0;
                // SAFETY: an out-pointer and a handle of the right size; the
                // driver checks that it names a live allocation.
                unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut ptr,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                }
                .result()?;
                Ok(ptr)
            };
            let k = open(&peer.k_handle)?;
            let v = open(&peer.v_handle).inspect_err(|_| {
                // SAFETY: `k` was opened just above and is not used.
                let _ = unsafe { sys::cuIpcCloseMemHandle(k) };
            })?;
            tracing::info!(pid = peer.pid, device = %peer.device, "mapped a decode worker's KV cache (CUDA IPC)");
            Mapped { k, v, opened: true }
        };
        let addrs = [mapped.k, mapped.v];
        self.mapped.insert(peer.k_handle.clone(), mapped);
        Ok(addrs)
    }
}

impl Drop for PeerCaches {
    fn drop(&mut self) {
        for m in self.mapped.values().filter(|m| m.opened) {
            // SAFETY: opened by `map`, and nothing copies into it any more
            // (the executor that owns this has stopped).
            unsafe {
                let _ = sys::cuIpcCloseMemHandle(m.k);
                let _ = sys::cuIpcCloseMemHandle(m.v);
            }
        }
    }
}
