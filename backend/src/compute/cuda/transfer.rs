//! KV pages between two GPUs of one node (the same-node transport of
//! disaggregated prefill/decode): one gather kernel on the destination GPU
//! pulls every page, all layers, K and V, straight out of the source GPU's
//! cache over peer access, instead of one memcpy per page.

use cudarc::driver::sys;

use super::device::{Gpu, GpuError, grid};
use super::model::CudaKvCache;

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
    dst_gpu.bind()?;
    let lists: Vec<i32> = src_pages
        .iter()
        .chain(dst_pages)
        .map(|&p| p as i32)
        .collect();
    let lists = dst_gpu.upload(&lists)?;
    let page_elems = (dst.block_size * dst.kv_dim) as u64;
    let src_layer = src.n_blocks as u64 * page_elems;
    let dst_layer = dst.n_blocks as u64 * page_elems;
    let n = src_pages.len();
    // SAFETY: every page index was checked against its cache; the caches hold
    // n_layers x n_blocks pages of page_elems values, K and V alike; peer
    // access makes src's addresses readable from dst.
    dst_gpu.launch(
        "kv_gather_pages",
        grid((n as u32, dst.n_layers as u32, 2), 256, 0),
        &[
            &src_gpu.ptr(&src.k, 0),
            &src_gpu.ptr(&src.v, 0),
            &dst_gpu.ptr(&dst.k, 0),
            &dst_gpu.ptr(&dst.v, 0),
            &dst_gpu.ptr(&lists, 0),
            &dst_gpu.ptr(&lists, n),
            &page_elems,
            &src_layer,
            &dst_layer,
        ],
    )?;
    // `lists` is freed on the stream after the kernel (async free).
    Ok(())
}
