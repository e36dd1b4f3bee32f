// Where the block scheduler puts the blocks of a grid that fits on the GPU at
// once: each block records its SM (%smid) and spins 50 us so that all are
// resident together. For occupancies of 3 and 4 blocks an SM (set through
// dynamic shared memory, 256 threads a block, as the FP4 GEMVs run) and grids
// of 256-528 blocks it prints how many SMs got k blocks and which blocks
// share block 0's and block 1's SM; at 448 blocks and more, how many of
// gate/up's 1,792 row tiles (Llama 3.1 8B) each SM would take with the
// GEMVs' assignment (block b: tiles b, b + grid, ...).
// Standalone (the device has nvcc; nothing in the build compiles this):
//   cd bench/gpu && nvcc -O2 -arch=sm_90 -o bp block_placement.cu && ./bp
#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

__global__ void record_sm(int* sm, unsigned long long spin_ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    unsigned id;
    asm("mov.u32 %0, %%smid;" : "=r"(id));
    if (threadIdx.x == 0) sm[blockIdx.y] = (int)id;
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < spin_ns);
}

int main() {
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    int* d;
    cudaMalloc(&d, 4096 * sizeof(int));
    cudaFuncSetAttribute(record_sm, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
    for (int per_sm : {3, 4}) {
        const int smem = 228 * 1024 / per_sm - 2048;
        int occupancy;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, record_sm, 256, smem);
        for (int grid : {256, 384, 396, 448, 512, 528}) {
            if (grid > occupancy * sms) continue;
            record_sm<<<dim3(1, grid), 256, smem>>>(d, 50000);
            if (cudaDeviceSynchronize() != cudaSuccess) return 1;
            std::vector<int> sm(grid);
            cudaMemcpy(sm.data(), d, grid * sizeof(int), cudaMemcpyDeviceToHost);
            std::map<int, std::vector<int>> blocks_of;
            for (int b = 0; b < grid; b++) blocks_of[sm[b]].push_back(b);
            std::map<size_t, int> sms_with;
            for (auto& [id, blocks] : blocks_of) sms_with[blocks.size()]++;
            printf("%d an SM, grid %d: %zu SMs used of %d; SMs with k blocks:", occupancy, grid, blocks_of.size(), sms);
            for (auto& [k, count] : sms_with) printf(" %zu:%d", k, count);
            for (int b : {0, 1}) {
                printf("\n  blocks on block %d's SM:", b);
                for (int other : blocks_of[sm[b]]) printf(" %d", other);
            }
            if (grid >= 448) {
                int most = 0, least = 1 << 30;
                for (auto& [id, blocks] : blocks_of) {
                    int tiles = 0;
                    for (int b : blocks) tiles += (1792 - b + grid - 1) / grid;
                    most = std::max(most, tiles);
                    least = std::min(least, tiles);
                }
                printf("\n  gate/up's 1,792 tiles: %d..%d an SM (%.2f on average)", least, most, 1792.0 / sms);
            }
            printf("\n");
        }
    }
}
