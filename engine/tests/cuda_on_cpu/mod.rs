//! The client side of the CUDA-on-CPU harness (`harness.cpp` beside this file, over
//! `emu.h`), shared by the integration tests that run tandem's CUDA kernels on the CPU: it
//! compiles the harness once per test binary and runs one kernel launch per process.
#![allow(dead_code)] // each test binary uses its own part of this module

pub mod device;

use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use half::bf16;

/// One kernel argument, tagged as the harness expects.
pub enum Arg {
    /// A buffer for any pointer parameter.
    Buf(Vec<u8>),
    /// Buffers for `float*`, `bf16*` (`unsigned short*`), `int*` and `unsigned int*` only.
    F32s(Vec<u8>),
    Bf16s(Vec<u8>),
    I32s(Vec<u8>),
    U32s(Vec<u8>),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

/// The harness, compiled on first use and kept beside the test binaries under a name that
/// hashes its sources and the compiler, so the two kernel test binaries and later runs share
/// one compile (seconds of C++). Without a C++ compiler the kernel tests cannot run, and fail
/// saying so (every supported build machine has gcc).
pub fn harness() -> &'static Path {
    static HARNESS: OnceLock<PathBuf> = OnceLock::new();
    HARNESS
        .get_or_init(|| {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_on_cpu");
            // $CXX, else the usual names of a C++ compiler.
            let candidates: Vec<String> = match std::env::var("CXX") {
                Ok(cxx) => vec![cxx],
                Err(_) => vec!["c++".into(), "g++".into(), "clang++".into()],
            };
            let mut sources = DefaultHasher::new();
            for file in [
                dir.join("harness.cpp"),
                dir.join("emu.h"),
                dir.join("../../src/backend/cuda/kernels.cu"),
            ] {
                std::fs::read(&file)
                    .unwrap_or_else(|e| panic!("read {}: {e}", file.display()))
                    .hash(&mut sources);
            }
            candidates.hash(&mut sources);
            let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("cuda_on_cpu_harness-{:016x}", sources.finish()));
            if out.is_file() {
                return out;
            }
            // Binaries may compile at once (nextest): each into its own file, then renamed
            // into place, which is atomic.
            let partial = out.with_extension(format!("partial-{}", std::process::id()));
            let mut missing = Vec::new();
            for cxx in &candidates {
                let status = Command::new(cxx)
                    .args([
                        "-std=c++20",
                        "-O2",
                        "-Wall",
                        "-Wno-sign-compare",
                        "-Wno-unknown-pragmas",
                        "-o",
                    ])
                    .arg(&partial)
                    .arg(dir.join("harness.cpp"))
                    .status();
                match status {
                    Ok(s) if s.success() => {
                        std::fs::rename(&partial, &out).expect("harness moved into place");
                        return out;
                    }
                    Ok(s) => panic!("the CUDA-on-CPU harness does not compile with {cxx}: {s}"),
                    Err(e) => missing.push(format!("{cxx}: {e}")),
                }
            }
            panic!(
                "the kernel tests need a C++ compiler ($CXX, c++, g++ or clang++): {}",
                missing.join("; ")
            );
        })
        .as_path()
}

/// Runs `kernel` over `grid` blocks of `threads`; returns every buffer argument afterwards.
pub fn try_launch(
    kernel: &str,
    grid: u32,
    threads: u32,
    args: &[Arg],
) -> Result<Vec<Vec<u8>>, String> {
    let exe = harness();
    let mut req = Vec::new();
    req.extend((kernel.len() as u32).to_le_bytes());
    req.extend(kernel.as_bytes());
    for v in [grid, threads, args.len() as u32] {
        req.extend(v.to_le_bytes());
    }
    for a in args {
        match a {
            Arg::Buf(b) | Arg::F32s(b) | Arg::Bf16s(b) | Arg::I32s(b) | Arg::U32s(b) => {
                req.push(match a {
                    Arg::F32s(_) => b'F',
                    Arg::Bf16s(_) => b'H',
                    Arg::I32s(_) => b'I',
                    Arg::U32s(_) => b'U',
                    _ => b'B',
                });
                req.extend((b.len() as u64).to_le_bytes());
                req.extend(b);
            }
            Arg::I32(v) => {
                req.push(b'i');
                req.extend(v.to_le_bytes());
            }
            Arg::I64(v) => {
                req.push(b'l');
                req.extend(v.to_le_bytes());
            }
            Arg::U64(v) => {
                req.push(b'q');
                req.extend(v.to_le_bytes());
            }
            Arg::F32(v) => {
                req.push(b'f');
                req.extend(v.to_le_bytes());
            }
        }
    }
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the harness");
    let mut stdin = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || stdin.write_all(&req));
    let out = child.wait_with_output().expect("harness output");
    writer.join().expect("writer").expect("request written");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let mut bufs = Vec::new();
    let mut rest = &out.stdout[..];
    while !rest.is_empty() {
        let (len, tail) = rest.split_at(8);
        let len = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
        bufs.push(tail[..len].to_vec());
        rest = &tail[len..];
    }
    Ok(bufs)
}

pub fn launch(kernel: &str, grid: u32, threads: u32, args: &[Arg]) -> Vec<Vec<u8>> {
    try_launch(kernel, grid, threads, args).unwrap_or_else(|e| panic!("{kernel} failed: {e}"))
}

/// `gpu/forward.rs`'s `per_row`: one block per row.
pub fn per_row(rows: usize) -> u32 {
    rows.max(1) as u32
}

/// `gpu/forward.rs`'s `grid`: enough blocks of `threads` for `n` threads.
pub fn blocks_for(n: usize, threads: u32) -> u32 {
    (n as u32).div_ceil(threads).max(1)
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
pub fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}
pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}
pub fn bf16s(b: &[u8]) -> Vec<bf16> {
    b.chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}
pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}
