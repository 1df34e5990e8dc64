//! Compiles the .proto files with protox (a pure-Rust protobuf compiler), so building needs
//! no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/tandem/v1/common.proto",
        "proto/tandem/v1/decode.proto",
        "proto/tandem/v1/prefill.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .bytes(".tandem.v1.KvBlocks.payload")
        .compile_fds(fds)?;
    Ok(())
}
