//! The transport factory: [`connect`] checks a destination (layout, lease size, the decode
//! worker's identity) and opens the sender of the transport the router chose, looked up in
//! the prefill worker's registry ([`Peers`]). It names no transport.

use tandem_kv::KvLayout;
use tandem_proto::v1::{KvDestination, Transport};

use crate::error::TransferError;
use crate::lease::LeaseToken;
use crate::peers::Peers;
use crate::sender::KvSender;
use crate::stall::stall_limit;
use crate::transport::Opening;

/// Opens a transfer to `dest` for a prompt of `num_tokens` tokens whose blocks from
/// `first_block` on are shipped (0 unless a sliding window leaves earlier ones unread; the
/// lease's blocks are numbered from there). Refuses a destination whose layout differs from
/// ours, or whose decode worker cannot prove it belongs to the deployment, before any byte
/// moves.
pub async fn connect(
    peers: &Peers,
    dest: &KvDestination,
    layout: &KvLayout,
    request_id: &str,
    num_tokens: usize,
    first_block: usize,
) -> Result<Box<dyn KvSender>, TransferError> {
    let ours = layout.hash();
    if dest.kv_layout_hash != ours {
        return Err(TransferError::LayoutMismatch(format!(
            "destination expects layout {}, this worker has {ours}",
            dest.kv_layout_hash
        )));
    }
    let needed = tandem_kv::blocks_for(num_tokens).saturating_sub(first_block);
    if needed == 0 || dest.block_ids.len() != needed {
        return Err(TransferError::Protocol(format!(
            "lease has {} blocks, the prompt needs {needed}",
            dest.block_ids.len()
        )));
    }
    let lease = LeaseToken::from_wire(&dest.lease).map_err(|_| {
        TransferError::Protocol("a KV destination needs its lease's 16-byte capability".into())
    })?;
    let transport = Transport::try_from(dest.transport).unwrap_or(Transport::Unspecified);
    if transport == Transport::Unspecified {
        return Err(no_transport());
    }
    let open = async {
        let decode = peers.verified_decode(dest).await?;
        if decode.info.kv_layout_hash != ours {
            return Err(TransferError::LayoutMismatch(format!(
                "the decode worker has layout {}, this worker {ours}",
                decode.info.kv_layout_hash
            )));
        }
        // Every wire value but `Unspecified` is registered (a device transport this build
        // lacks as a stub that refuses with the feature it needs).
        let chosen = peers.transport(transport).ok_or_else(no_transport)?;
        let op = Opening {
            reach: peers.reach(),
            decode: &decode,
            dest: dest.clone(),
            lease,
            layout,
            request_id,
            num_tokens,
        };
        chosen.open(op).await
    };
    // Reaching the decode worker is part of the transfer: on a link that went silent it
    // ends within the lease period, not after every connection timeout in turn.
    match dest.lease_ttl_ms {
        0 => open.await,
        ms => tokio::time::timeout(stall_limit(ms), open)
            .await
            .unwrap_or_else(|_| {
                Err(TransferError::TimedOut(format!(
                    "could not reach {} within the lease period ({ms} ms)",
                    dest.decode_endpoint
                )))
            }),
    }
}

fn no_transport() -> TransferError {
    TransferError::Protocol("no transport chosen".into())
}
