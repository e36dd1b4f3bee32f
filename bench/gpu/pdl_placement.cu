// Where a programmatic dependent launch's blocks land (standalone; nvcc on the
// GPU machine: `nvcc -O2 -arch=sm_90 -o pp pdl_placement.cu && ./pp`).
//
// A kernel of 528 blocks that fill the SMs (4 an SM of 512 threads: no room
// for another block until one ends, as the norm + SwiGLU GEMV fills the
// register file) whose blocks end at scattered times, then a kernel of G
// blocks of 256 threads (the QKV, O and down GEMVs' 384 / 256 / 256 row
// tiles: fewer than 3 an SM), the pair captured into a CUDA graph
// with a plain edge or a programmatic one (the second kernel's blocks may
// start as the first's end; each waits with griddepcontrol.wait). Prints how
// many of the second kernel's blocks each SM ran, how many started before the
// first kernel had ended, and the replay's time; with extra dynamic shared
// memory a block, so that an SM holds at most ceil(G / SMs) of them.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#define CHECK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(err_)); exit(1); } } while (0)

__device__ unsigned long long now_ns() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ unsigned smid() { unsigned s; asm volatile("mov.u32 %0, %smid;" : "=r"(s)); return s; }

// Spins 8-16 µs (by block), then records its end.
__global__ void __launch_bounds__(512, 4) first(unsigned long long* end) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const unsigned long long t0 = now_ns(), spin = 8000 + (blockIdx.x * 2654435761u >> 20) % 8000;
    while (now_ns() - t0 < spin) {}
    if (threadIdx.x == 0) atomicMax(end, now_ns());
}

// Records its SM and start, waits for the first kernel, spins 4 µs.
__global__ void __launch_bounds__(256, 4) second(unsigned* sm, unsigned long long* start) {
    const unsigned long long t = now_ns();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) { sm[blockIdx.x] = smid(); start[blockIdx.x] = t; }
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < 4000) {}
}

static void launch(void (*k)(unsigned*, unsigned long long*), int grid, size_t smem, bool pdl, cudaStream_t s,
                   unsigned* a, unsigned long long* b) {
    cudaLaunchConfig_t c = {};
    c.gridDim = grid; c.blockDim = 256; c.dynamicSmemBytes = smem; c.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    c.attrs = at; c.numAttrs = pdl ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&c, k, a, b));
}

int main() {
    int sms; CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int per_sm; CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    CHECK(cudaFuncSetAttribute(second, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    cudaStream_t s; CHECK(cudaStreamCreate(&s));
    unsigned* sm; unsigned long long *start, *end;
    CHECK(cudaMalloc(&sm, 4096 * 4)); CHECK(cudaMalloc(&start, 4096 * 8)); CHECK(cudaMalloc(&end, 8));
    for (int g : {256, 384}) for (int pdl = 0; pdl < 2; pdl++) for (int cap = 0; cap < 2; cap++)
    for (int mode = 0; mode < 16; mode++) {
        // mode bits: 1 no memset ahead of each pair, 2 global capture, 4 no graph (launches on the stream),
        // 8 the first kernel a programmatic launch too.
        if ((cap && !pdl) || (mode && (!pdl || cap || g != 256)) || (mode & 4 && mode & 2)) continue;
        const int most = (g + sms - 1) / sms;
        size_t smem = 0;
        if (cap) { smem = per_sm / (most + 1) - 4096; int b;
            for (;; smem += 256) {
                CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, second, 256, smem));
                if (b <= most) break;
            } }
        auto pairs = [&]() {
            for (int rep = 0; rep < 10; rep++) {
                cudaLaunchConfig_t c = {}; c.gridDim = 528; c.blockDim = 512; c.stream = s;
                cudaLaunchAttribute at[1];
                at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                at[0].val.programmaticStreamSerializationAllowed = 1;
                c.attrs = at; c.numAttrs = mode & 8 ? 1 : 0;
                if (!(mode & 1)) CHECK(cudaMemsetAsync(end, 0, 8, s));
                CHECK(cudaLaunchKernelEx(&c, first, end));
                launch(second, g, smem, pdl, s, sm, start);
            }
        };
        cudaGraph_t graph; cudaGraphExec_t exec;
        if (!(mode & 4)) {
            CHECK(cudaStreamBeginCapture(s, mode & 2 ? cudaStreamCaptureModeGlobal : cudaStreamCaptureModeThreadLocal));
            pairs();
            CHECK(cudaStreamEndCapture(s, &graph));
            CHECK(cudaGraphInstantiate(&exec, graph, 0));
        }
        auto run = [&]() { if (mode & 4) pairs(); else CHECK(cudaGraphLaunch(exec, s)); };
        run(); CHECK(cudaStreamSynchronize(s));
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        cudaEventRecord(e0, s); run(); cudaEventRecord(e1, s); CHECK(cudaStreamSynchronize(s));
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        std::vector<unsigned> h(g); std::vector<unsigned long long> st(g); unsigned long long e;
        CHECK(cudaMemcpy(h.data(), sm, g * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(st.data(), start, g * 8, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(&e, end, 8, cudaMemcpyDeviceToHost));
        std::vector<int> per(sms, 0); int early = 0; long long lo = 1LL << 62, hi = -lo;
        for (int i = 0; i < g; i++) {
            per[h[i]]++; early += st[i] < e;
            lo = std::min(lo, (long long)(st[i] - e)); hi = std::max(hi, (long long)(st[i] - e));
        }
        std::vector<int> hist(9, 0); for (int c : per) hist[std::min(c, 8)]++;
        printf("second kernel %d blocks, %s edge%s%s%s%s%s: SMs with k blocks:", g, pdl ? "programmatic" : "plain",
               cap ? " + shared memory for at most ceil(G/SMs) an SM" : "", mode & 1 ? ", no memsets" : "",
               mode & 2 ? ", global capture" : "", mode & 4 ? ", no graph" : "", mode & 8 ? ", first programmatic too" : "");
        for (int k = 0; k <= 8; k++) if (hist[k]) printf(" %d:%d", k, hist[k]);
        printf("; started before the first ended: %d (start - end %.1f .. %.1f us); 10 pairs %.1f us\n", early,
               lo / 1e3, hi / 1e3, ms * 1000);
        if (!(mode & 4)) { cudaGraphExecDestroy(exec); cudaGraphDestroy(graph); }
    }
}
