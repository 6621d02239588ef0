//! Stages in other processes: `torus-wgpu worker` serves one stage over gRPC (proto/stage.proto),
//! and `RemoteStage` drives it from the scheduler's pipeline.
//!
//! A worker has a random instance id. The scheduler learns it when it connects and sends it
//! with every step; a worker that restarted (new id, empty KV cache) refuses the step, so the
//! engine can recompute instead of reading a cache that is gone.
//!
//! What a worker accepts, checked before anything is written to its cache:
//! - **Who.** With a `worker_token` (config, `--worker-token` or `TORUS_WORKER_TOKEN`), every
//!   call must carry `authorization: Bearer <token>`, compared in constant time (of SHA-256
//!   digests, so neither content nor length leaks); others get UNAUTHENTICATED before their
//!   message is read. A worker without a token serves on loopback addresses only (with a
//!   warning), unless started with `--insecure`. With `tls_cert`/`tls_key` it serves TLS
//!   (rustls), and with `tls_ca` it also requires client certificates signed by that CA. A
//!   scheduler with `tls_ca` reaches its workers over TLS, verified against it, presenting its
//!   own `tls_cert`/`tls_key` when given.
//! - **How much.** Message sizes are capped by `MessageLimits`: the largest step the worker's
//!   budget allows (tokens, sequences, block tables, hidden states, logits) plus slack. Larger
//!   messages are refused by the transport.
//! - **What.** Every count, position, slot, block id and sequence index of a step is checked
//!   against the worker's own cache and budget (`StepBounds::check`): a token may write only
//!   the slot its own sequence's block table gives its position. A bad step gets
//!   INVALID_ARGUMENT and writes nothing.
//! - **Whose.** A worker serves one scheduler at a time: the session (random per scheduler
//!   stage) of the first step it runs owns it; steps of another session get ABORTED, so two
//!   schedulers never interleave writes to one cache. The owner releases the worker when its
//!   pipeline is dropped; an owner idle for `worker_lease_s` may be taken over, and the worker
//!   then takes a new instance id, so the old owner sees a restarted worker and recomputes.
//!   The owner's steps run one at a time, in arrival order.
//!
//! Here: the message limits and what a scheduler expects of a worker; `auth`: the worker
//! token and TLS; `client`: the scheduler's side of one stage; `wire`: the step's wire form;
//! `worker`: the worker process.

mod auth;
mod client;
mod wire;
mod worker;

pub use auth::{Client, Link, SendToken};
pub use client::RemoteStage;
pub use worker::{run_worker, worker_layers};

use super::proto;
use crate::model::StepLimits;
use crate::sampling::MAX_LOGIT_BIAS;
use anyhow::{anyhow, bail, Result};
use std::ops::Range;
use std::time::Duration;

/// The largest gRPC messages of one stage, both ways, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MessageLimits {
    /// A step request (scheduler to worker).
    pub request: usize,
    /// A step reply (worker to scheduler).
    pub reply: usize,
}

impl MessageLimits {
    /// Bounds of the protobuf encoding of the largest step `limits` allow on a model with
    /// `hidden` and `vocab`, plus an eighth and 64 KiB of slack.
    pub fn new(hidden: usize, vocab: usize, l: &StepLimits) -> MessageLimits {
        use crate::sampling::row::MAX_TOP_LOGPROBS;
        let (t, s) = (l.max_tokens, l.max_seqs);
        let max_blocks = l.max_seq_len.div_ceil(l.block_size.max(1));
        // A field's tag and length prefix; a u32 varint; a packed repeated u32 field.
        let (field, v32) = (6, 5);
        let packed = |n: usize| field + v32 * n;
        // Shape (two u64), dtype "f32", raw data.
        let tensor = |bytes: usize| field + (field + 2 * 10) + (2 + 3) + field + bytes;
        // Seven scalars and a u32, then each logit adjustment (id, count, flag, bias).
        let sample_params = field + 7 * (1 + v32) + (1 + v32);
        let adjust = 2 + (1 + v32) * 2 + 2 + 5;
        let adjustments = s * (l.max_seq_len + MAX_LOGIT_BIAS);
        let request = 2 * 11 // instance, session
            + 4 * packed(t) // tokens, positions, slots, seq_of_token
            + s * (field + packed(max_blocks))
            + packed(s)
            + s * sample_params
            + adjustments * adjust
            + s * packed(vocab.div_ceil(32))
            + tensor(t * hidden * 4)
            + 2;
        let sampled = field + (1 + v32) + 5 + MAX_TOP_LOGPROBS * (2 + (1 + v32) + 5);
        let reply = tensor(t * hidden * 4) + s * sampled + tensor(s * vocab * 4);
        let slack = |n: usize| n + n / 8 + (64 << 10);
        MessageLimits { request: slack(request), reply: slack(reply) }
    }
}

/// What the scheduler needs of a worker; checked whenever it (re)connects.
#[derive(Clone, Debug)]
pub struct Expect {
    pub stage: usize,
    pub layers: Range<usize>,
    pub total_layers: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub limits: StepLimits,
    pub num_blocks: usize,
    /// Longest wait for one step's answer.
    pub timeout: Duration,
}

impl Expect {
    fn check(&self, info: &proto::InfoReply) -> Result<()> {
        let l = &self.limits;
        let got = info.start_layer as usize..info.end_layer as usize;
        if got != self.layers || info.total_layers as usize != self.total_layers {
            bail!(
                "the worker serves layers {}..{} of {}, this stage is layers {}..{} of {}",
                got.start,
                got.end,
                info.total_layers,
                self.layers.start,
                self.layers.end,
                self.total_layers
            );
        }
        if info.hidden as usize != self.hidden || info.vocab as usize != self.vocab {
            bail!(
                "the worker's model has hidden size {} and vocab {}, expected {} and {} (a different model?)",
                info.hidden,
                info.vocab,
                self.hidden,
                self.vocab
            );
        }
        if info.block_size as usize != l.block_size {
            bail!("the worker's block_size is {}, the scheduler's {}", info.block_size, l.block_size);
        }
        if (info.num_blocks as usize) < self.num_blocks {
            bail!(
                "the worker holds {} KV blocks, the scheduler's block tables use {}; give it a larger total_cache_size",
                info.num_blocks,
                self.num_blocks
            );
        }
        for (name, have, need) in [
            ("max_num_batched_tokens", info.max_tokens as usize, l.max_tokens),
            ("max sequences per step", info.max_seqs as usize, l.max_seqs),
            ("max_sequence_length", info.max_seq_len as usize, l.max_seq_len),
        ] {
            if have < need {
                bail!("the worker's {name} is {have}, below the scheduler's {need}");
            }
        }
        Ok(())
    }
}

pub(super) fn status_text(s: &tonic::Status) -> String {
    let m = s.message();
    let m = if m.is_empty() { format!("{:?}", s.code()) } else { m.to_string() };
    // The client's own deadline (stage_timeout_s) ends a call as Cancelled("Timeout expired").
    let timed_out = s.code() == tonic::Code::DeadlineExceeded || m.contains("Timeout expired");
    match s.code() {
        _ if timed_out => format!("timed out (no answer within stage_timeout_s): {m}"),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
            // Transport errors keep their cause (a refused TLS handshake, a reset connection).
            let cause = std::error::Error::source(s).map(|e| format!(" ({e})")).unwrap_or_default();
            format!("unreachable: {m}{cause}")
        }
        tonic::Code::Unauthenticated => format!("the worker refused this scheduler's worker_token: {m}"),
        _ => m,
    }
}

/// A random non-zero id.
pub(super) fn random_id() -> u64 {
    crate::sampling::Rng::from_entropy().next_u64() | 1
}

/// Asks the worker at `addr` what it serves (for /health); fails within `timeout`.
pub async fn probe(addr: &str, link: &Link, timeout: Duration) -> Result<proto::InfoReply> {
    let ep = link.endpoint(addr)?.connect_timeout(timeout).timeout(timeout);
    let ch = tokio::time::timeout(timeout, ep.connect()).await.map_err(|_| anyhow!("timed out"))?;
    let ch = ch.map_err(|e| anyhow!("unreachable: {e}"))?;
    let mut c = link.client(ch);
    let r = c.info(proto::InfoRequest {}).await.map_err(|s| anyhow!(status_text(&s)))?;
    Ok(r.into_inner())
}
