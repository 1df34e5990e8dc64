//! The router against scripted fake workers: the disaggregated flow end to end, modes and
//! fallbacks, streaming formats, cancellation, failures, overload, bad input, API keys,
//! workers found through DNS, and the binary itself. Everything listens on loopback
//! (127.0.0.1, and 127.0.0.2-3 for DNS names with several addresses); every wait is bounded.
//!
//! One test binary: the harness is `common/`, the tests are in `cases/` by topic, and each
//! case file takes this file's imports (`use super::*`).

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};
use tandem_proto::v1::{Mode, Transport};
use tandem_router::RoutingPolicy;
use tandem_text::{ChatMessage, ChatTemplate};
use tonic::Code;

#[path = "cases/end_to_end.rs"]
mod end_to_end;

#[path = "cases/modes.rs"]
mod modes;

#[path = "cases/service.rs"]
mod service;

#[path = "cases/validation.rs"]
mod validation;

#[path = "cases/failures.rs"]
mod failures;

#[path = "cases/sampling_api.rs"]
mod sampling_api;

#[path = "cases/discovery.rs"]
mod discovery;

#[path = "cases/prefix_routing.rs"]
mod prefix_routing;

#[path = "cases/tool_calls.rs"]
mod tool_calls;
