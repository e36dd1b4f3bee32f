// KV pages from one cache into another: run on the destination GPU reading
// the source over peer access (NVLink, two GPUs of one process), or on the
// source GPU writing a cache another process shared through CUDA IPC (a
// prefill worker filling a decode worker's pages). One launch moves every
// page of every layer, K and V, where a memcpy per page would pay a call
// each (../shared/GPU.md measured 16 GB/s that way, 366 GB/s with one kernel).
//
// Grid: (page, layer, 0 = K / 1 = V); each block copies one page of one layer,
// 16 bytes per thread per load. page_elems (block_size x kv_dim) is a multiple
// of 8.
extern "C" __global__ void kv_gather_pages(const bf16* __restrict__ src_k, const bf16* __restrict__ src_v,
                                           bf16* __restrict__ dst_k, bf16* __restrict__ dst_v,
                                           const int* __restrict__ src_pages, const int* __restrict__ dst_pages,
                                           u64 page_elems, u64 src_layer_elems, u64 dst_layer_elems) {
    wait_for_previous_kernels();
    const int p = blockIdx.x, layer = blockIdx.y;
    const bf16* src = (blockIdx.z ? src_v : src_k) + layer * src_layer_elems + (u64)src_pages[p] * page_elems;
    bf16* dst = (blockIdx.z ? dst_v : dst_k) + layer * dst_layer_elems + (u64)dst_pages[p] * page_elems;
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    const u64 n = page_elems / 8;
#pragma unroll 4
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}
