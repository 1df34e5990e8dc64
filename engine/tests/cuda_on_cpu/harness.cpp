// Runs one launch of one of tandem's CUDA kernels on the CPU (see emu.h), for the engine's
// integration test `gpu_kernels_on_cpu.rs`, which compares the results with the CPU engine.
//
// Request on stdin (little-endian): u32 name length, name, u32 grid blocks, u32 threads per
// block, u32 argument count, then per argument a tag byte and its value: a buffer as u64
// length and bytes, tagged 'F' (float*), 'H' (bf16*), 'I' (int*), 'U' (unsigned int*) or 'B'
// (any pointer); or 'i' i32, 'l' i64, 'q' u64, 'f' f32. Every argument's tag must match the
// kernel's parameter type (a mismatch is an error, where a real launch would misread it).
// Reply on stdout: each buffer, in argument order, as it is after the kernel ran.
#include "emu.h"

#include "../../src/backend/cuda/kernels.cu"

#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace {

struct Arg {
    char tag = 0;
    std::vector<unsigned char> bytes;
};

void read_exact(void* out, size_t n) {
    if (n > 0 && std::fread(out, 1, n, stdin) != n) throw std::runtime_error("request ended early");
}

template <class T>
T read_value() {
    T value;
    read_exact(&value, sizeof value);
    return value;
}

template <class T>
T take(Arg& arg, size_t index) {
    auto expect = [&](char tag) {
        if (arg.tag != tag) {
            throw std::runtime_error("argument " + std::to_string(index) + " has tag '" +
                                     std::string(1, arg.tag) + "', the kernel wants '" + tag + "'");
        }
    };
    if constexpr (std::is_pointer_v<T>) {
        using Pointee = std::remove_cv_t<std::remove_pointer_t<T>>;
        if (arg.tag != 'B') {
            if constexpr (std::is_same_v<Pointee, float>) expect('F');
            else if constexpr (std::is_same_v<Pointee, bf16>) expect('H');
            else if constexpr (std::is_same_v<Pointee, int>) expect('I');
            else if constexpr (std::is_same_v<Pointee, unsigned int>) expect('U');
            else expect('B');
        }
        return reinterpret_cast<T>(arg.bytes.data());
    } else {
        if constexpr (std::is_same_v<T, int>) expect('i');
        else if constexpr (std::is_same_v<T, long long>) expect('l');
        else if constexpr (std::is_same_v<T, unsigned long long>) expect('q');
        else if constexpr (std::is_same_v<T, float>) expect('f');
        else static_assert(sizeof(T) == 0, "unsupported kernel parameter type");
        T value;
        std::memcpy(&value, arg.bytes.data(), sizeof value);
        return value;
    }
}

template <class... Params, size_t... I>
void call(void (*kernel)(Params...), std::vector<Arg>& args, unsigned grid, unsigned threads,
          std::index_sequence<I...>) {
    emu::launch(grid, threads, kernel, take<Params>(args[I], I)...);
}

template <class... Params>
void dispatch(void (*kernel)(Params...), std::vector<Arg>& args, unsigned grid, unsigned threads) {
    if (args.size() != sizeof...(Params)) {
        throw std::runtime_error("got " + std::to_string(args.size()) + " arguments, the kernel takes " +
                                 std::to_string(sizeof...(Params)));
    }
    call(kernel, args, grid, threads, std::index_sequence_for<Params...>{});
}

using Runner = void (*)(std::vector<Arg>&, unsigned, unsigned);

#define KERNEL(name) \
    {#name, [](std::vector<Arg>& a, unsigned g, unsigned t) { dispatch(name, a, g, t); }}

const std::map<std::string, Runner> kernels = {
    KERNEL(embed_rows),    KERNEL(rms_norm_bf16), KERNEL(rope_kv_write),
    KERNEL(paged_attention), KERNEL(silu_mul_bf16), KERNEL(gather_rows),
    KERNEL(fill_uniform_bf16), KERNEL(gather_kv_blocks), KERNEL(scatter_kv_blocks),
    KERNEL(flash_attention), KERNEL(attention_combine),
};

}  // namespace

int main() {
    try {
        std::string name(read_value<uint32_t>(), '\0');
        read_exact(name.data(), name.size());
        unsigned grid = read_value<uint32_t>();
        unsigned threads = read_value<uint32_t>();
        if (threads == 0 || threads % 32 != 0 || threads > 1024 || grid == 0) {
            throw std::runtime_error("threads per block must be a multiple of 32 up to 1024, grid > 0");
        }
        std::vector<Arg> args(read_value<uint32_t>());
        for (Arg& arg : args) {
            arg.tag = read_value<char>();
            size_t len = 0;
            switch (arg.tag) {
                case 'B': case 'F': case 'H': case 'I': case 'U': len = read_value<uint64_t>(); break;
                case 'i': case 'f': len = 4; break;
                case 'l': case 'q': len = 8; break;
                default: throw std::runtime_error("unknown argument tag");
            }
            arg.bytes.resize(len);
            read_exact(arg.bytes.data(), len);
        }
        auto kernel = kernels.find(name);
        if (kernel == kernels.end()) throw std::runtime_error("no kernel named " + name);
        kernel->second(args, grid, threads);
        for (const Arg& arg : args) {
            if (arg.tag != 'B' && arg.tag != 'F' && arg.tag != 'H' && arg.tag != 'I' && arg.tag != 'U') continue;
            uint64_t len = arg.bytes.size();
            std::fwrite(&len, sizeof len, 1, stdout);
            std::fwrite(arg.bytes.data(), 1, arg.bytes.size(), stdout);
        }
        return std::fflush(stdout) == 0 ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "cuda_on_cpu: %s\n", e.what());
        return 2;
    }
}
