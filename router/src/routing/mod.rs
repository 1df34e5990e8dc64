//! Routing policy: which workers serve a request and in which mode. Pure functions over
//! snapshots of worker load, with no I/O, so they are unit-tested here and could move to a
//! crate of their own (as Dynamo's `kv-router` did). `workers` builds the snapshots;
//! `flow` acts on the decisions. `prefix_index` follows what each worker's prefix cache
//! holds, from the block events on its load reports. `slo` holds the latency targets,
//! `cost_view` what a worker's load report and this router's dispatches since say of its
//! costs and queue, `placement` predicts from those views where a request meets them, and
//! `calibration` corrects the predictions by what the requests measured.

pub mod calibration;
pub mod cost_view;
pub mod placement;
pub mod policy;
pub mod prefix_index;
pub mod slo;

pub use calibration::Calibration;
pub use cost_view::{CostView, SinceReport};
pub use placement::{
    Placement, PlacementKind, Prediction, best_split, choose, predict_aggregated,
    predict_disaggregated, predict_split,
};
pub use policy::{
    DecodeCandidate, FallbackReason, ModeDecision, PickRule, PrefillCandidate, blocks_for_tokens,
    decide_after_prefill_failure, decide_mode, pick_decode, pick_prefill,
};
pub use prefix_index::{PrefixIndex, PromptNames};
pub use slo::{RequestSlo, SloAsked, SloPressure, SloTargets};
