//! The checks of `bounds` on files written here: a GGUF directory whose tensors run past the
//! file, overlap or overflow, and safetensors headers that lie about their length.

use std::path::Path;

use tandem_text::gguf::{GgufFile, GgufMetadata, GgufTensorInfo};
use tandem_text::{Ceiling, ModelLimits};

use super::*;

fn file(tensors: Vec<GgufTensorInfo>, file_len: u64) -> GgufFile {
    GgufFile {
        metadata: GgufMetadata {
            version: 3,
            ..GgufMetadata::default()
        },
        tensors,
        data_offset: 64,
        file_len,
    }
}

fn tensor(name: &str, dims: &[u64], type_id: u32, offset: u64) -> GgufTensorInfo {
    GgufTensorInfo {
        name: name.into(),
        dims: dims.to_vec(),
        type_id,
        offset,
    }
}

fn refusal(f: &GgufFile) -> String {
    gguf_content(Path::new("m.gguf"), f)
        .unwrap_err()
        .to_string()
}

#[test]
fn a_gguf_directory_must_fit_its_file() {
    // Two f32 tensors of 8 and 4 values, back to back: 48 bytes after the 64 of the header.
    let ok = file(
        vec![tensor("a", &[4, 2], 0, 0), tensor("b", &[4], 0, 32)],
        112,
    );
    let content = gguf_content(Path::new("m.gguf"), &ok).unwrap();
    assert_eq!(content.tensor_infos["a"].shape.dims(), [2, 4]);
    assert_eq!(gguf_weight_bytes(&ok), 48);
    let short = file(vec![tensor("a", &[4, 2], 0, 0)], 95);
    let e = refusal(&short);
    assert!(
        e.contains("m.gguf") && e.contains("tensor `a`: 32 bytes at offset 0 run past the end"),
        "{e}"
    );
    let far = file(vec![tensor("a", &[4], 0, u64::MAX - 8)], 112);
    assert!(refusal(&far).contains("run past the end"));
    let huge = file(vec![tensor("a", &[1 << 32, 1 << 32, 1 << 32], 0, 0)], 112);
    assert!(refusal(&huge).contains("multiply past 64 bits"));
    let unknown = file(vec![tensor("a", &[4], 99, 0)], 112);
    assert!(refusal(&unknown).contains("GGML type 99"));
    let ragged = file(vec![tensor("a", &[33], 8, 0)], 1 << 20);
    assert!(refusal(&ragged).contains("not whole"));
    let shared = file(
        vec![tensor("a", &[8], 0, 0), tensor("b", &[8], 0, 16)],
        1 << 20,
    );
    assert!(refusal(&shared).contains("tensors `a` and `b` overlap"));
}

#[test]
fn a_config_must_fit_the_bytes_of_weights() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let params = cfg.num_parameters() as u64;
    assert!(check_parameters(&cfg, params * 4, Path::new("c.json")).is_ok());
    let e = check_parameters(&cfg, params / 8, Path::new("c.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("c.json") && e.contains("more than the"), "{e}");
}

#[test]
fn safetensors_headers_must_fit_their_file_and_ceiling() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let header = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut ok = (header.len() as u64).to_le_bytes().to_vec();
    ok.extend_from_slice(header);
    ok.extend_from_slice(&[0; 4]);
    let limits = ModelLimits::default();
    assert_eq!(
        safetensors_header(&write("ok.safetensors", &ok), &limits).unwrap(),
        (ok.len() as u64, 1)
    );
    let mut lying = (1u64 << 60).to_le_bytes().to_vec();
    lying.extend_from_slice(header);
    let e = safetensors_header(&write("lying.safetensors", &lying), &limits)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lying.safetensors") && e.contains("runs past the end"),
        "{e}"
    );
    let few = limits.with(Ceiling::Tensors, 0);
    let e = safetensors_header(&write("ok.safetensors", &ok), &few)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensors in the file: 1 is above the ceiling of 0"),
        "{e}"
    );
}
