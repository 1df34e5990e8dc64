// Just enough of CUDA's device-side language, on the CPU, to run tandem's kernels
// (engine/src/backend/cuda/kernels.cu) unchanged without a GPU: every CUDA thread of a block is an OS
// thread, `__syncthreads` is a barrier of the block, `__shfl_xor_sync` exchanges through a
// barrier of the warp, and blocks run one after another (so `__shared__` can be `static`).
// Threads that return early drop out of both barriers, as on the device.
//
// It checks what a kernel computes and where it reads and writes (the indexing), not speed,
// and not the device's exact rounding of transcendental functions.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>  // cosf, sinf, expf, fmaxf in the global namespace, as in CUDA
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

namespace emu {

struct Warp {
    explicit Warp(std::ptrdiff_t lanes) : barrier(lanes) {}
    std::barrier<> barrier;
    float values[32] = {};
};

struct Block {
    explicit Block(unsigned int threads) : barrier(threads) {
        for (unsigned int first = 0; first < threads; first += 32) {
            warps.push_back(std::make_unique<Warp>(threads - first < 32 ? threads - first : 32));
        }
    }
    std::barrier<> barrier;
    std::vector<std::unique_ptr<Warp>> warps;
};

inline Block* current_block = nullptr;

// Runs `kernel(args...)` over `grid` blocks of `threads` threads. One OS thread per CUDA
// thread of a block, reused block after block (starting threads is the emulator's main
// cost); a barrier between blocks swaps in the next block's barriers.
template <class Kernel, class... Args>
void launch(unsigned int grid, unsigned int threads, Kernel kernel, Args... args) {
    gridDim = dim3{grid, 1, 1};
    blockDim = dim3{threads, 1, 1};
    auto block = std::make_unique<Block>(threads);
    current_block = block.get();
    auto next_block = [&]() noexcept {
        block = std::make_unique<Block>(threads);
        current_block = block.get();
    };
    std::barrier end_of_block(threads, next_block);
    std::vector<std::thread> team;
    team.reserve(threads);
    for (unsigned int t = 0; t < threads; t++) {
        team.emplace_back([&, t] {
            threadIdx = dim3{t, 0, 0};
            for (unsigned int b = 0; b < grid; b++) {
                blockIdx = dim3{b, 0, 0};
                Block* mine = current_block;
                kernel(args...);
                // Done with this block (returned early or not): leave its barriers.
                mine->barrier.arrive_and_drop();
                mine->warps[t / 32]->barrier.arrive_and_drop();
                end_of_block.arrive_and_wait();
            }
        });
    }
    for (auto& thread : team) thread.join();
    current_block = nullptr;
}

}  // namespace emu

inline void __syncthreads() { emu::current_block->barrier.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned int, float value, int lane_mask) {
    emu::Warp& warp = *emu::current_block->warps[threadIdx.x / 32];
    unsigned int lane = threadIdx.x % 32;
    warp.values[lane] = value;
    warp.barrier.arrive_and_wait();
    float other = warp.values[lane ^ (unsigned int)lane_mask];
    warp.barrier.arrive_and_wait();
    return other;
}

inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
inline float __int_as_float(int i) { return __uint_as_float((unsigned int)i); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
