//! The aggregated run: the decode worker prefills the prompt itself and streams from its
//! first token. `run_here` is also how a disaggregated attempt ends when the decode worker
//! chose to run the request itself (its prefix cache held all but a short suffix).

use std::collections::VecDeque;
use std::sync::Arc;

use tandem_proto::v1::{GenerateEvent, Mode};
use tonic::Streaming;

use super::decode::{
    AttemptError, DecodeItem, Live, decode_failure, generate_request, grpc_request, next_item,
};
use super::events::{Head, RunMode, prompt_entries};
use super::outcome::Timing;
use super::request::{FlowContext, FlowRequest};
use crate::routing::FallbackReason;
use crate::workers::Worker;

/// Runs the request on `decode` alone, up to its first token.
pub(super) async fn run_aggregated(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Arc<Worker>,
    fallback: Option<FallbackReason>,
    timing: &mut Timing,
) -> Result<Live, AttemptError> {
    let mut client = decode.decode_client();
    let request = grpc_request(
        generate_request(ctx, req, Mode::Aggregated),
        &req.request_id,
    );
    let stream = client
        .generate(request)
        .await
        .map_err(|s| decode_failure(decode, &s))?
        .into_inner();
    run_here(req, decode, stream, fallback, 0, timing).await
}

/// The rest of a request the decode worker runs itself: its first token and the head.
pub(super) async fn run_here(
    req: &FlowRequest,
    decode: &Arc<Worker>,
    mut stream: Streaming<GenerateEvent>,
    fallback: Option<FallbackReason>,
    decode_cached_tokens: u32,
    timing: &mut Timing,
) -> Result<Live, AttemptError> {
    let mut first = next_item(&mut stream, decode).await?;
    timing.on_token(RunMode::Aggregated);
    let prompt_logprobs = match &mut first {
        DecodeItem::Token(t) => prompt_entries(req, std::mem::take(&mut t.prompt_logprobs)),
        DecodeItem::Finished(_) => Vec::new(),
    };
    Ok(Live {
        head: Head {
            mode: RunMode::Aggregated,
            kv_bytes: 0,
            transport: None,
            fallback,
            prompt_logprobs,
            cached_tokens: 0,
            kv_blocks: 0,
            decode_cached_tokens,
            prefill_pulled_tokens: 0,
        },
        stream,
        decode: Arc::clone(decode),
        early: VecDeque::from([first]),
    })
}
