//! Tests of the lease table: transfers that land, bad ones refused, the device and shared-memory
//! commits, capabilities that nothing else reaches, and the per-caller quota.

use super::*;
use tandem_kv::{KvCache, KvDtype, KvLayout};

fn setup() -> (KvCache, LeaseTable) {
    let layout = KvLayout {
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 4,
        block_size: 16,
        dtype: KvDtype::F32,
        model_fingerprint: "m".into(),
    };
    let hash = layout.hash();
    let cache = KvCache::with_budget(layout.clone(), 8 * layout.block_bytes()).unwrap();
    let table = LeaseTable::new(cache.block_writer(), hash, None);
    (cache, table)
}

fn commit_msg(table: &LeaseTable, lease: &Lease, transport: Transport) -> KvCommit {
    KvCommit {
        lease: lease.token().as_bytes().to_vec(),
        kv_layout_hash: table.layout_hash().into(),
        first_token: 7,
        first_logprob: -0.5,
        num_tokens: lease.num_tokens as u32,
        transport: transport as i32,
        ..Default::default()
    }
}

#[test]
fn full_transfer_commits_and_lands_in_the_blocks() {
    let (cache, table) = setup();
    let bb = cache.layout().block_layer_bytes();
    let (lease, mut rx) = table.create(vec![5, 2], 20, "r1").unwrap();
    let payload =
        |layer: usize| -> Vec<u8> { (0..2 * bb).map(|i| (i % 200) as u8 + layer as u8).collect() };
    for layer in 0..2 {
        let p = payload(layer);
        let crcs = [crc32(&p[..bb]), crc32(&p[bb..])];
        table
            .write_blocks(&lease, layer, &[0, 1], &crcs, &p)
            .unwrap();
    }
    assert_eq!(
        table
            .commit(&commit_msg(&table, &lease, Transport::Tcp))
            .unwrap(),
        4 * bb as u64
    );
    let c = rx.try_recv().unwrap().unwrap();
    assert_eq!((c.first_token, c.bytes), (7, 4 * bb as u64));
    assert_eq!(
        cache.block_layer_bytes(1, 2).unwrap(),
        &payload(1)[bb..],
        "logical 1 of layer 1 went to block 2"
    );
    assert_eq!(cache.block_layer_bytes(0, 5).unwrap(), &payload(0)[..bb]);
    assert!(table.is_empty());
    assert!(
        table.cancel(lease.token()).is_none(),
        "a committed lease cannot be cancelled"
    );
}

#[test]
fn a_commit_with_more_alternatives_than_any_request_asks_for_fails_its_lease() {
    let (cache, table) = setup();
    let bb = cache.layout().block_layer_bytes();
    let (lease, mut rx) = table.create(vec![1], 10, "r").unwrap();
    for layer in 0..2 {
        let p = vec![3u8; bb];
        table
            .write_blocks(&lease, layer, &[0], &[crc32(&p)], &p)
            .unwrap();
    }
    let mut commit = commit_msg(&table, &lease, Transport::Grpc);
    commit.first_top_logprobs = (0..=tandem_proto::limits::MAX_TOP_LOGPROBS as u32)
        .map(|id| tandem_proto::v1::TopLogprob { id, logprob: -1.0 })
        .collect();
    assert!(matches!(
        table.commit(&commit),
        Err(TransferError::Protocol(_))
    ));
    assert!(
        rx.try_recv().unwrap().is_err(),
        "the waiting request hears of it"
    );
    assert!(table.is_empty());
}

#[test]
fn bad_transfers_are_refused() {
    let (cache, table) = setup();
    let bb = cache.layout().block_layer_bytes();
    let payload = vec![1u8; bb];
    let good = crc32(&payload);
    let bad_cases: [(usize, u32, u32, &[u8]); 4] = [
        (0, 0, good ^ 1, &payload),
        (0, 3, good, &payload),
        (9, 0, good, &payload),
        (0, 0, good, &payload[1..]),
    ];
    for (layer, lb, crc, data) in bad_cases {
        let (lease, _rx) = table.create(vec![0], 5, "r").unwrap();
        assert!(matches!(
            table.write_blocks(&lease, layer, &[lb], &[crc], data),
            Err(TransferError::Corrupt(_))
        ));
    }
    let (lease, mut rx) = table.create(vec![0], 5, "r").unwrap();
    assert!(
        table
            .write_blocks(&lease, 0, &[0], &[good ^ 1], &payload)
            .is_err()
    );
    assert!(matches!(
        table.check_header(lease.token().as_bytes(), "other"),
        Err(TransferError::LayoutMismatch(_))
    ));
    assert!(matches!(
        table.check_header(&[7u8; 16], table.layout_hash()),
        Err(TransferError::UnknownLease)
    ));
    // The first corrupt piece failed the lease and told the waiting request why.
    let why = rx.try_recv().unwrap().unwrap_err();
    assert!(why.contains("checksum"), "{why}");
    assert!(matches!(
        table.write_blocks(&lease, 0, &[0], &[good], &payload),
        Err(TransferError::Cancelled)
    ));
    assert!(table.cancel(lease.token()).is_none(), "already ended");

    // An incomplete transfer fails at commit.
    let (lease, mut rx) = table.create(vec![1], 5, "r2").unwrap();
    table
        .write_blocks(&lease, 0, &[0], &[good], &payload)
        .unwrap();
    let mut wrong_len = commit_msg(&table, &lease, Transport::Grpc);
    wrong_len.num_tokens = 6;
    assert!(table.commit(&wrong_len).is_err());
    assert!(rx.try_recv().unwrap().is_err());

    // Cancel returns the blocks once; writes after it are refused.
    let (lease, _rx) = table.create(vec![2], 5, "r3").unwrap();
    table
        .write_blocks(&lease, 0, &[0], &[good], &payload)
        .unwrap();
    assert!(matches!(
        table.commit(&commit_msg(&table, &lease, Transport::Grpc)),
        Err(TransferError::Incomplete(_))
    ));
    let (lease, _rx) = table.create(vec![2], 5, "r4").unwrap();
    assert_eq!(table.cancel(lease.token()), Some(vec![2]));
    assert!(table.cancel(lease.token()).is_none());
    assert!(matches!(
        table.write_blocks(&lease, 1, &[0], &[good], &payload),
        Err(TransferError::Cancelled)
    ));
}

#[test]
fn cuda_ipc_commits_must_cover_the_device_pieces() {
    let (_cache, table) = setup();
    let (lease, _rx) = table.create(vec![1, 2], 20, "r").unwrap();
    let refused = table.commit(&commit_msg(&table, &lease, Transport::CudaIpc));
    assert!(
        refused
            .unwrap_err()
            .to_string()
            .contains("no device KV pool"),
        "a worker without a device pool refuses cuda-ipc"
    );

    let (_cache, table) = setup();
    let table = table.with_device_pool(100);
    let (lease, mut rx) = table.create(vec![1, 2], 20, "r").unwrap();
    let mut short = commit_msg(&table, &lease, Transport::CudaIpc);
    short.bytes = 2 * 2 * 100 - 1;
    let why = table.commit(&short).unwrap_err().to_string();
    assert!(why.contains("covers 399 bytes"), "{why}");
    assert!(
        rx.try_recv().unwrap().is_err(),
        "a short commit fails the lease"
    );

    let (lease, mut rx) = table.create(vec![3, 4], 20, "r").unwrap();
    let mut whole = commit_msg(&table, &lease, Transport::CudaIpc);
    whole.bytes = 2 * 2 * 100;
    assert_eq!(table.commit(&whole).unwrap(), 400);
    let commit = rx.try_recv().unwrap().unwrap();
    assert_eq!(commit.transport, Transport::CudaIpc);
}

#[test]
fn shm_commits_are_verified_by_checksum_in_place() {
    let (mut cache, table) = setup();
    let bb = cache.layout().block_layer_bytes();
    let (lease, mut rx) = table.create(vec![3], 16, "r").unwrap();
    let mut checksums = Vec::new();
    for layer in 0..2 {
        let data = vec![layer as u8 + 9; bb];
        cache.write_block_layer_bytes(layer, 3, &data).unwrap();
        checksums.push(crc32(&data));
    }
    let mut c = commit_msg(&table, &lease, Transport::Shm);
    c.checksums = vec![checksums[0], checksums[1] ^ 0xff];
    assert!(matches!(table.commit(&c), Err(TransferError::Corrupt(_))));
    assert!(
        rx.try_recv().unwrap().is_err(),
        "a bad checksum fails the lease"
    );
    let (lease, mut rx) = table.create(vec![3], 16, "r2").unwrap();
    let mut c = commit_msg(&table, &lease, Transport::Shm);
    c.checksums = checksums;
    table.commit(&c).unwrap();
    assert_eq!(rx.try_recv().unwrap().unwrap().transport, Transport::Shm);
}

#[test]
fn only_the_holder_of_the_capability_reaches_a_lease() {
    let (cache, table) = setup();
    let bb = cache.layout().block_layer_bytes();
    let (lease, mut rx) = table.create(vec![1], 5, "victim").unwrap();
    let (other, _rx) = table.create(vec![2], 5, "other").unwrap();
    assert_ne!(lease.token(), other.token(), "capabilities are random");
    assert_ne!(lease.token().fence(), 0);
    assert_eq!(format!("{:?}", lease.token()), "LeaseToken(<redacted>)");
    // Guesses and near misses name no lease, whatever their length, and fail nothing.
    let mut near = *lease.token().as_bytes();
    near[15] ^= 1;
    for guess in [&near[..], &[0u8; 16], &[], &lease.token().as_bytes()[..15]] {
        assert!(matches!(
            table.check_header(guess, table.layout_hash()),
            Err(TransferError::UnknownLease)
        ));
        let forged = KvCommit {
            lease: guess.to_vec(),
            kv_layout_hash: table.layout_hash().into(),
            num_tokens: 5,
            transport: Transport::Grpc as i32,
            ..Default::default()
        };
        let e = table.commit(&forged).unwrap_err();
        assert!(matches!(e, TransferError::UnknownLease));
        assert!(
            !e.to_string().contains('5'),
            "the error describes no request: {e}"
        );
        assert!(!table.renew(guess));
    }
    assert!(rx.try_recv().is_err(), "the victim's lease is still open");
    let payload = vec![3u8; bb];
    table
        .write_blocks(&lease, 0, &[0], &[crc32(&payload)], &payload)
        .unwrap();
    table
        .write_blocks(&lease, 1, &[0], &[crc32(&payload)], &payload)
        .unwrap();
    table
        .commit(&commit_msg(&table, &lease, Transport::Grpc))
        .unwrap();
    assert!(rx.try_recv().unwrap().is_ok(), "and it completes");
}

#[test]
fn a_caller_holds_at_most_its_quota_until_its_leases_end() {
    let (_cache, table) = setup();
    let table = table.with_caller_quota(3);
    let a = table.claim("10.0.0.1", 2).unwrap();
    let e = table.claim("10.0.0.1", 2).unwrap_err();
    assert!(matches!(e, TransferError::QuotaExceeded(_)), "{e}");
    let never = table.claim("10.0.0.1", 4).unwrap_err();
    assert!(matches!(never, TransferError::BeyondQuota(_)), "{never}");
    assert!(
        table.claim("10.0.0.2", 3).is_ok(),
        "another caller has its own"
    );
    let (lease, _rx) = table
        .create_claimed(Some(a), vec![1, 2], Vec::new(), 20, "r")
        .unwrap();
    assert!(
        table.claim("10.0.0.1", 2).is_err(),
        "the lease holds the claim"
    );
    assert!(table.cancel(lease.token()).is_some());
    let b = table
        .claim("10.0.0.1", 3)
        .expect("an ended lease gives its claim back");
    drop(b);
    assert!(table.claim("10.0.0.1", 3).is_ok(), "a dropped claim too");
}

/// Renewals keep a lease whose KV has not begun alive (its prompt is queued), but once the
/// sender has begun, only KV is progress: a transfer that stalls expires on time.
#[test]
fn renewals_stop_counting_once_the_kv_has_begun() {
    let (_cache, table) = setup();
    let (lease, _rx) = table.create(vec![1], 10, "r").unwrap();
    let token = lease.token().as_bytes().to_vec();
    std::thread::sleep(std::time::Duration::from_millis(30));
    assert!(table.renew(&token));
    assert!(
        lease.progress().idle < std::time::Duration::from_millis(30),
        "a renewal before any KV is progress"
    );
    lease.note_sending();
    std::thread::sleep(std::time::Duration::from_millis(30));
    assert!(table.renew(&token), "the lease is still open");
    assert!(
        lease.progress().idle >= std::time::Duration::from_millis(30),
        "a renewal once the KV has begun is not progress"
    );
}
