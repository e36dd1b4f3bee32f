// What a batch-1 decode step's weight stream can reach on this GPU, with no
// arithmetic: every kernel only reads its matrix (and folds the bytes into a
// checksum so nothing is optimized away). The step is the Llama 3.1 8B shape
// in MXFP4 (per layer: QKV 13.4 MB, O 8.9, gate/up 62.4, down 31.2; 32
// layers) plus the BF16 head (1.05 GB), one kernel a matrix, replayed from a
// CUDA graph as the engine does. Variants:
//   ldg        plain 16-byte loads, 8 in flight a thread, blocks over contiguous ranges
//   tma        a block an SM: one producer lane streams its range through a ring
//              of shared-memory stages (cp.async.bulk + mbarriers), consumer warps
//              read each stage from shared memory
//   tma_pdl    the same launched as programmatic dependent launches: a kernel's
//              producer starts streaming before the kernel ahead has ended, its
//              consumers wait (griddepcontrol.wait) as a GEMV waits for x
// Standalone (the device has nvcc; nothing in the build compiles this):
//   cd bench/gpu && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o sc stream_ceiling.cu && ./sc
// Prints JSON lines: the copy bandwidth, then per variant the step's time and
// TB/s, its percent of the copy bandwidth and of 4.25 TB/s (the H200's copy,
// BENCHMARKS.md's roofline), and each matrix kind's time in graphs of 32.
// Measured (BENCHMARKS.md, "What a step's stream can reach"): on an H100,
// ldg 86% of the copy bandwidth, tma 80-83%, tma_pdl 97-99%.
#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#endif

#define CK(x)                                                                               \
    do {                                                                                    \
        cudaError_t e = (x);                                                                \
        if (e != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Each block reads bytes [b * per, (b + 1) * per) of the matrix, 8 loads a thread in flight.
__global__ void __launch_bounds__(256) k_ldg(const uint4* src, u64 n16, u32* out) {
    u64 per = (n16 + gridDim.x - 1) / gridDim.x;
    u64 lo = blockIdx.x * per, hi = min(lo + per, n16);
    u32 acc = 0;
    u64 i = lo + threadIdx.x;
    for (; i + 7 * 256 < hi; i += 8 * 256) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = ldg_stream(src + i + k * 256);
#pragma unroll
        for (int k = 0; k < 8; k++) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < hi; i += 256) {
        uint4 v = ldg_stream(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* b, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count));
}
__device__ __forceinline__ void mbar_wait(u64* b, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(smem_u32(b)), "r"(parity)
            : "memory");
    }
}
__device__ __forceinline__ void mbar_arrive(u64* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* b, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* b) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(b))
        : "memory");
}

constexpr int CONSUMERS = 4;  // consumer warps; warp CONSUMERS is the producer

// A ring of `stages` stages of `stage_bytes` in dynamic shared memory. PDL:
// the producer streams at once; the consumers wait for the kernels ahead.
template <bool PDL>
__global__ void __launch_bounds__(32 * (CONSUMERS + 1)) k_tma(const char* src, u64 bytes, u32 stage_bytes, int stages,
                                                            u32* out) {
    extern __shared__ __align__(128) char smem[];
    u64* full = (u64*)smem;
    u64* empty = full + stages;
    char* ring = smem + 1024;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Whole stages a block, contiguous.
    u64 nstage = (bytes + stage_bytes - 1) / stage_bytes;
    u64 per = (nstage + gridDim.x - 1) / gridDim.x;
    u64 lo = blockIdx.x * per, hi = min(lo + per, nstage);
    if (warp == CONSUMERS) {
        if (PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        if (lane == 0) {
            for (u64 i = lo; i < hi; i++) {
                int s = (int)((i - lo) % stages);
                u32 round = (u32)((i - lo) / stages);
                if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
                u64 off = i * stage_bytes;
                u32 n = (u32)min((u64)stage_bytes, bytes - off);
                mbar_expect_tx(&full[s], n);
                bulk_copy(ring + (u64)s * stage_bytes, src + off, n, &full[s]);
            }
        }
        return;
    }
    if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    u32 acc = 0;
    for (u64 i = lo; i < hi; i++) {
        int s = (int)((i - lo) % stages);
        u32 round = (u32)((i - lo) / stages);
        mbar_wait(&full[s], round & 1);
        const uint4* st = (const uint4*)(ring + (u64)s * stage_bytes);
        u32 n16 = stage_bytes / 16;
        for (u32 k = warp * 32 + lane; k < n16; k += 32 * CONSUMERS) {
            uint4 v = st[k];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
    }
    if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

#ifndef __CUDACC_RTC__
struct Mat {
    char* p;
    u64 bytes;
};

struct Variant {
    const char* name;
    int kind;  // 0 ldg, 1 tma, 2 tma_pdl
    u32 stage_bytes;
    int stages;
    int blocks_per_sm;
};

static void launch(const Variant& v, const Mat& m, int sms, u32* out, cudaStream_t st) {
    if (v.kind == 0) {
        int grid = sms * v.blocks_per_sm;
        k_ldg<<<grid, 256, 0, st>>>((const uint4*)m.p, m.bytes / 16, out);
        return;
    }
    size_t smem = 1024 + (size_t)v.stage_bytes * v.stages;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(sms * v.blocks_per_sm);
    cfg.blockDim = dim3(32 * (CONSUMERS + 1));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    if (v.kind == 2) {
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        CK(cudaLaunchKernelEx(&cfg, k_tma<true>, (const char*)m.p, m.bytes, v.stage_bytes, v.stages, out));
    } else {
        CK(cudaLaunchKernelEx(&cfg, k_tma<false>, (const char*)m.p, m.bytes, v.stage_bytes, v.stages, out));
    }
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Times `reps` replays of a graph of the given matrices, returns the median ms.
static float time_graph(const Variant& v, const std::vector<Mat>& seq, int sms, u32* out, cudaStream_t st) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (const Mat& m : seq) launch(v, m, sms, out, st);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) CK(cudaGraphLaunch(ge, st));
    std::vector<float> ms;
    for (int i = 0; i < 15; i++) {
        CK(cudaEventRecord(a, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float t;
        CK(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t);
    }
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return median(ms);
}

int main() {
    int dev = 0, sms = 0;
    CK(cudaSetDevice(dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cudaFuncSetAttribute(k_tma<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(k_tma<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));

    // The copy bandwidth (read + write counted), as GPU.md measured it.
    u64 cb = 1ull << 30;
    char *ca, *cb2;
    CK(cudaMalloc(&ca, cb));
    CK(cudaMalloc(&cb2, cb));
    CK(cudaMemset(ca, 1, cb));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> cms;
    for (int i = 0; i < 8; i++) {
        CK(cudaEventRecord(a, st));
        CK(cudaMemcpyAsync(cb2, ca, cb, cudaMemcpyDeviceToDevice, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float t;
        CK(cudaEventElapsedTime(&t, a, b));
        if (i >= 2) cms.push_back(t);
    }
    double copy_tbs = 2.0 * cb / (median(cms) * 1e-3) / 1e12;
    CK(cudaFree(ca));
    CK(cudaFree(cb2));
    printf("{\"device\":\"%s\",\"sms\":%d,\"copy_tb_per_s\":%.3f}\n", prop.name, sms, copy_tbs);

    // The step's matrices, each its own allocation (4.76 GB in all).
    const u64 layer_bytes[4] = {13369344ull, 8912896ull, 62390272ull, 31195136ull};
    const char* names[4] = {"qkv", "o", "gate_up", "down"};
    std::vector<Mat> step;
    std::vector<Mat> by_kind[4];
    for (int l = 0; l < 32; l++)
        for (int k = 0; k < 4; k++) {
            Mat m;
            m.bytes = layer_bytes[k];
            CK(cudaMalloc(&m.p, m.bytes));
            CK(cudaMemset(m.p, l + k, m.bytes));
            step.push_back(m);
            by_kind[k].push_back(m);
        }
    Mat head;
    head.bytes = 128256ull * 4096 * 2;
    CK(cudaMalloc(&head.p, head.bytes));
    CK(cudaMemset(head.p, 7, head.bytes));
    step.push_back(head);
    u64 step_bytes = 0;
    for (const Mat& m : step) step_bytes += m.bytes;
    u32* out;
    CK(cudaMalloc(&out, 1 << 20));

    std::vector<Variant> vs = {
        {"ldg_b4", 0, 0, 0, 4},
        {"ldg_b8", 0, 0, 0, 8},
        {"tma_16k_x6_b1", 1, 16384, 6, 1},
        {"tma_32k_x6_b1", 1, 32768, 6, 1},
        {"tma_16k_x6_b2", 1, 16384, 6, 2},
        {"tma_8k_x12_b2", 1, 8192, 12, 2},
        {"tma_pdl_16k_x6_b1", 2, 16384, 6, 1},
        {"tma_pdl_32k_x3_b1", 2, 32768, 3, 1},
        {"tma_pdl_16k_x6_b2", 2, 16384, 6, 2},
        {"tma_pdl_8k_x12_b1", 2, 8192, 12, 1},
        {"tma_pdl_32k_x6_b1", 2, 32768, 6, 1},
    };
    for (const Variant& v : vs) {
        float ms = time_graph(v, step, sms, out, st);
        printf("{\"variant\":\"%s\",\"what\":\"step\",\"step_us\":%.1f,\"tb_per_s\":%.3f,\"percent_of_copy\":%.1f,"
               "\"percent_of_4_25\":%.1f",
               v.name, ms * 1e3, step_bytes / (ms * 1e-3) / 1e12, 100.0 * step_bytes / (ms * 1e-3) / 1e12 / copy_tbs,
               100.0 * step_bytes / (ms * 1e-3) / 4.25e12);
        for (int k = 0; k < 4; k++) {
            float mk = time_graph(v, by_kind[k], sms, out, st);
            printf(",\"%s_us\":%.2f,\"%s_tb_per_s\":%.3f", names[k], mk * 1e3 / 32, names[k],
                   32.0 * layer_bytes[k] / (mk * 1e-3) / 1e12);
        }
        printf("}\n");
        fflush(stdout);
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    return 0;
}
#endif
