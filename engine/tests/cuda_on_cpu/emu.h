// Just enough of CUDA's device-side language, on the CPU, to run tandem's kernels
// (engine/src/backend/cuda/kernels.cu) unchanged without a GPU: every CUDA thread of a block is a
// fiber (ucontext) on one OS thread, `__syncthreads` is a barrier of the block, `__shfl_xor_sync`
// exchanges through a barrier of the warp, and blocks run one after another (so `__shared__` can
// be `static`). Threads that return early drop out of both barriers, as on the device.
//
// Fibers rather than OS threads: a kernel meets a barrier every few instructions (five warp
// exchanges per attention key), and waking hundreds of OS threads per barrier on a two-core
// machine made the emulated forward pass minutes of CI; a fiber switch is a function call.
// On x86-64 ELF it is six register pushes and a stack swap (`emu_switch_stack` below); glibc's
// `swapcontext` also saves the signal mask, a system call per switch that cost three quarters of
// the emulator's time. Elsewhere `swapcontext` does it, slower but the same.
//
// It checks what a kernel computes and where it reads and writes (the indexing), not speed,
// and not the device's exact rounding of transcendental functions.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <math.h>  // cosf, sinf, expf, fmaxf in the global namespace, as in CUDA
#include <memory>
#include <vector>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

// Plain globals, set by the scheduler before it resumes a thread's fiber (one OS thread runs
// them all, and a kernel re-reads them after every barrier, which is an opaque call).
inline dim3 threadIdx;
inline dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

// kernels.cu leaves its inline PTX out and takes this file's stand-ins instead.
#define CUDA_ON_CPU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

// CUDA's integer min and max, which device code calls unqualified.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

#if defined(__x86_64__) && defined(__ELF__) && !defined(EMU_UCONTEXT)
#define EMU_STACK_SWITCH 1
// Saves the callee-saved registers on the current stack, stores its pointer in *save_sp,
// switches to resume_sp and pops what was saved there: the System V x86-64 calling convention
// makes the caller keep every other register.
extern "C" void emu_switch_stack(void** save_sp, void* resume_sp);
asm(R"(
    .text
    .globl emu_switch_stack
    .type emu_switch_stack, @function
emu_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_stack, .-emu_switch_stack
)");
#else
#define EMU_STACK_SWITCH 0
#endif

namespace emu {

enum class State { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
#if EMU_STACK_SWITCH
    void* sp = nullptr;
#else
    ucontext_t context;
#endif
    std::unique_ptr<char[]> stack;
    State state = State::Done;
};

// The threads of the block being run, and what each is waiting for.
struct Team {
    std::vector<Fiber> fibers;
    std::vector<float> warp_values;  // 32 per warp, for `__shfl_xor_sync`
    std::vector<unsigned int> mma_fragments;  // 6 words per thread, for `mma_bf16_16816`
#if EMU_STACK_SWITCH
    void* scheduler_sp = nullptr;
#else
    ucontext_t scheduler;
#endif
    unsigned int running = 0;
    std::function<void()> body;
};

inline Team* team = nullptr;

// Kernels keep a few registers' worth of locals; 64 KiB is far more than any frame here.
constexpr size_t kStackBytes = 64 * 1024;

// From the running thread's fiber to the scheduler.
inline void to_scheduler(Fiber& me) {
#if EMU_STACK_SWITCH
    emu_switch_stack(&me.sp, team->scheduler_sp);
#else
    swapcontext(&me.context, &team->scheduler);
#endif
}

// From the scheduler to thread `t`'s fiber, until it waits or returns.
inline void resume(unsigned int t) {
    team->running = t;
    threadIdx = dim3{t, 0, 0};
#if EMU_STACK_SWITCH
    emu_switch_stack(&team->scheduler_sp, team->fibers[t].sp);
#else
    swapcontext(&team->scheduler, &team->fibers[t].context);
#endif
}

inline void wait(State why) {
    Fiber& me = team->fibers[team->running];
    me.state = why;
    to_scheduler(me);
}

// A fiber's first frame: the kernel, then back to the scheduler for good.
inline void fiber_main() {
    team->body();
    Fiber& me = team->fibers[team->running];
    me.state = State::Done;
    to_scheduler(me);
}

// Makes `f` a fresh fiber that starts in `fiber_main`.
inline void start(Fiber& f) {
#if EMU_STACK_SWITCH
    // emu_switch_stack's frame as if `fiber_main` had called it: six zeroed registers, the
    // address `ret` goes to, and a null return address for `fiber_main` (it never returns),
    // leaving the stack 16-byte aligned as the ABI wants at a call.
    auto top = reinterpret_cast<uintptr_t>(f.stack.get() + kStackBytes) & ~uintptr_t{15};
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;
    *--sp = reinterpret_cast<void*>(&fiber_main);
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    f.sp = sp;
#else
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;  // fiber_main never returns
    makecontext(&f.context, fiber_main, 0);
#endif
    f.state = State::Runnable;
}

// Releases the threads whose barrier every live participant has reached; false if none can go
// on, which a kernel whose lanes wait at different barriers would cause (a hang on a device).
inline bool release_a_barrier(unsigned int threads) {
    bool released = false, any_live = false, all_at_block = true;
    for (unsigned int first = 0; first < threads; first += 32) {
        unsigned int end = first + 32 < threads ? first + 32 : threads;
        bool live = false, all_at_warp = true;
        for (unsigned int t = first; t < end; t++) {
            State s = team->fibers[t].state;
            if (s == State::Done) continue;
            live = true;
            all_at_warp = all_at_warp && s == State::AtWarpBarrier;
            all_at_block = all_at_block && s == State::AtBlockBarrier;
        }
        any_live = any_live || live;
        if (live && all_at_warp) {
            for (unsigned int t = first; t < end; t++) {
                if (team->fibers[t].state == State::AtWarpBarrier) team->fibers[t].state = State::Runnable;
            }
            released = true;
        }
    }
    if (!any_live || released) return true;
    if (all_at_block) {
        for (Fiber& f : team->fibers) {
            if (f.state == State::AtBlockBarrier) f.state = State::Runnable;
        }
        return true;
    }
    return false;
}

// Runs `kernel(args...)` over `grid` blocks of `threads` threads: per block, every thread's
// fiber runs until it waits at a barrier or returns, then the barriers all live threads have
// reached open, until every thread has returned.
template <class Kernel, class... Args>
void launch(unsigned int grid, unsigned int threads, Kernel kernel, Args... args) {
    gridDim = dim3{grid, 1, 1};
    blockDim = dim3{threads, 1, 1};
    Team block;
    block.fibers.resize(threads);
    // Uninitialised: only the few pages a kernel's frames touch are ever mapped.
    for (Fiber& f : block.fibers) f.stack.reset(new char[kStackBytes]);
    block.warp_values.assign((threads + 31) / 32 * 32, 0.f);
    block.mma_fragments.assign((threads + 31) / 32 * 32 * 6, 0u);
    block.body = [&] { kernel(args...); };
    team = &block;
    for (unsigned int b = 0; b < grid; b++) {
        blockIdx = dim3{b, 0, 0};
        for (Fiber& f : block.fibers) start(f);
        for (;;) {
            for (unsigned int t = 0; t < threads; t++) {
                if (block.fibers[t].state == State::Runnable) resume(t);
            }
            // Every thread now waits at a barrier or has returned.
            bool live = false;
            for (const Fiber& f : block.fibers) live = live || f.state != State::Done;
            if (!live) break;
            if (!release_a_barrier(threads)) {
                std::fprintf(stderr, "cuda_on_cpu: the threads of a block wait at different barriers\n");
                std::abort();
            }
        }
    }
    team = nullptr;
}

}  // namespace emu

inline void __syncthreads() { emu::wait(emu::State::AtBlockBarrier); }

inline float __shfl_xor_sync(unsigned int, float value, int lane_mask) {
    unsigned int warp = threadIdx.x / 32 * 32, lane = threadIdx.x % 32;
    float* values = emu::team->warp_values.data() + warp;
    values[lane] = value;
    emu::wait(emu::State::AtWarpBarrier);
    float other = values[lane ^ (unsigned int)lane_mask];
    emu::wait(emu::State::AtWarpBarrier);
    return other;
}

// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 of one warp (its fragment layout is described
// in kernels.cu): every lane posts its A and B words, then computes its own four outputs from
// the whole warp's, in f32.
inline void mma_bf16_16816(float* c, const unsigned int* a, const unsigned int* b) {
    unsigned int warp = threadIdx.x / 32 * 32, lane = threadIdx.x % 32;
    unsigned int* words = emu::team->mma_fragments.data() + warp * 6;
    for (int i = 0; i < 4; i++) words[lane * 6 + i] = a[i];
    words[lane * 6 + 4] = b[0];
    words[lane * 6 + 5] = b[1];
    emu::wait(emu::State::AtWarpBarrier);
    auto half_of = [](unsigned int w, int hi) {
        unsigned int bits = (hi ? w >> 16 : w & 0xffffu) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    };
    // A[row][k]: lane 4 * (row % 8) + (k % 8) / 2, word (row >= 8) + 2 * (k >= 8).
    auto a_at = [&](int row, int k) {
        int l = 4 * (row % 8) + (k % 8) / 2;
        return half_of(words[l * 6 + (row >= 8) + 2 * (k >= 8)], k & 1);
    };
    // B[k][col]: lane 4 * col + (k % 8) / 2, word 4 + (k >= 8).
    auto b_at = [&](int k, int col) {
        int l = 4 * col + (k % 8) / 2;
        return half_of(words[l * 6 + 4 + (k >= 8)], k & 1);
    };
    int group = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; i++) {
        int row = group + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        float sum = 0.f;
        for (int k = 0; k < 16; k++) sum += a_at(row, k) * b_at(k, col);
        c[i] += sum;
    }
    emu::wait(emu::State::AtWarpBarrier);
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
