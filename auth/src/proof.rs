//! Proofs of holding the secret that are not call tokens: a worker's answer to `GetInfo`
//! (so a caller knows the worker is one of the deployment's before sending it KV or prompts)
//! and the hello of a raw TCP KV connection (answering the decode worker's challenge).

use sha2::{Digest, Sha256};
use tandem_proto::v1::WorkerInfo;

/// The fields of a worker's info that peers act on, in a fixed order, each length-prefixed
/// by [`crate::secret::Key::mac`]. The proof covers exactly these, so a man in the middle
/// cannot swap a shared-memory path or a KV port while keeping a valid proof.
pub(crate) fn info_fields(info: &WorkerInfo) -> Vec<Vec<u8>> {
    let transports: Vec<u8> = info
        .transports
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    let layout = info.kv_layout.as_ref().map_or_else(Vec::new, |l| {
        [l.num_layers, l.num_kv_heads, l.head_dim, l.block_size]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .chain(l.dtype.bytes())
            .chain([0])
            .chain(l.model_fingerprint.bytes())
            .collect()
    });
    // The tokenizer and chat template decide what the router sends: cover them by digest.
    let tokenizer = info.tokenizer.as_ref().map_or_else(Vec::new, |t| {
        let mut h = Sha256::new();
        for part in [
            Some(t.tokenizer_json.as_str()),
            t.bos_token.as_deref(),
            t.eos_token.as_deref(),
            t.chat_template.as_deref(),
        ] {
            let part = part.unwrap_or("\u{0}absent");
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        for id in &t.eos_token_ids {
            h.update(id.to_le_bytes());
        }
        h.finalize().to_vec()
    });
    vec![
        info.worker_id.as_bytes().to_vec(),
        info.role.to_le_bytes().to_vec(),
        info.model_name.as_bytes().to_vec(),
        info.kv_layout_hash.as_bytes().to_vec(),
        layout,
        info.context_length.to_le_bytes().to_vec(),
        info.vocab_size.to_le_bytes().to_vec(),
        transports,
        info.shm_path.as_bytes().to_vec(),
        info.shm_bytes.to_le_bytes().to_vec(),
        info.shm_device.to_le_bytes().to_vec(),
        info.shm_inode.to_le_bytes().to_vec(),
        info.kv_tcp_port.to_le_bytes().to_vec(),
        info.advertise_host.as_bytes().to_vec(),
        info.total_blocks.to_le_bytes().to_vec(),
        info.protocol_version.to_le_bytes().to_vec(),
        info.cuda_ipc_handle.clone(),
        info.cuda_pool_blocks.to_le_bytes().to_vec(),
        info.instance_id.clone(),
        tokenizer,
    ]
}
