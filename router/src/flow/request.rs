//! What a request brings to the flow and what the flow borrows from the router: the
//! validated, tokenized `FlowRequest` the HTTP layer hands over, and the `FlowContext` (the
//! worker pool and the configuration that decide where and how a request runs).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tandem_proto::v1::{SamplingParams, StopParams};

use crate::config::{FallbackPolicy, PlacementPolicy, RoutingPolicy};
use crate::routing::{Calibration, PickRule, RequestSlo, SloPressure};
use crate::workers::WorkerPool;

/// What the flow needs from the router's configuration.
#[derive(Debug)]
pub struct FlowContext {
    pub pool: Arc<WorkerPool>,
    pub agg_threshold: u32,
    pub placement: PlacementPolicy,
    /// What SLO placement learned of its predictions (see `routing::placement`).
    pub calibration: Mutex<Calibration>,
    /// How close each side runs to its targets, from what requests measured.
    pub pressure: Mutex<SloPressure>,
    pub fallback: FallbackPolicy,
    pub lease_ttl_ms: u32,
    pub routing: RoutingPolicy,
    pub kv_overlap_weight: f64,
    /// Round robin's next turn, per role.
    pub decode_turn: AtomicUsize,
    pub prefill_turn: AtomicUsize,
}

impl FlowContext {
    /// The rule of one pick for `req` (advancing the role's round-robin turn).
    pub(super) fn rule(&self, req: &FlowRequest, turn: &AtomicUsize) -> PickRule {
        PickRule {
            policy: self.routing,
            weight: self.kv_overlap_weight,
            prompt_blocks: u32::try_from(tandem_kv::blocks_for(req.prompt.len()))
                .unwrap_or(u32::MAX),
            prompt_tokens: req.prompt.len() as u64,
            turn: match self.routing {
                RoutingPolicy::RoundRobin => turn.fetch_add(1, Ordering::Relaxed),
                _ => 0,
            },
        }
    }
}

/// A validated, tokenized request.
#[derive(Debug, Clone)]
pub struct FlowRequest {
    pub request_id: String,
    /// Its latency targets (the deployment's, or what its headers asked for).
    pub slo: RequestSlo,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopParams,
    /// Tokens that end generation unless `stop.ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Hold every token until the next event so that the last one always carries the
    /// finish. Needed where a stream must end on a token event (TGI) and the last token
    /// cannot be foreseen (stop strings); it delays each token by one inter-token gap.
    pub hold_every_token: bool,
    pub arrival: Instant,
    pub deadline: Option<Instant>,
}
