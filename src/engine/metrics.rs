//! Counters the engine keeps for the server to export.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Default, Debug)]
pub struct EngineMetrics {
    pub waiting: AtomicU64,
    pub running: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_free: AtomicU64,
    /// Recurrent-state slots (hybrid models) in all, and held by running sequences.
    pub state_slots_total: AtomicU64,
    pub state_slots_used: AtomicU64,
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    /// Prompt tokens of admitted requests, and those of them found in the prefix cache (vLLM's
    /// token-based prefix-cache queries and hits).
    pub prefix_query_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub preemptions: AtomicU64,
    pub prefill_tokens: AtomicU64,
    pub decode_tokens: AtomicU64,
    pub steps: AtomicU64,
    pub requests_finished: AtomicU64,
    pub requests_aborted: AtomicU64,
    pub requests_failed: AtomicU64,
    /// Pipeline stage failures (worker down or restarted).
    pub stage_failures: AtomicU64,
    /// Steps submitted while another was still in flight (pipeline overlap).
    pub steps_overlapped: AtomicU64,
    /// Steps that failed (a panic, a GPU error, a result under the wrong step id): their
    /// requests ended with an error, the engine went on.
    pub step_failures: AtomicU64,
    /// KV-cache events (`--kv-events-endpoint`): events and batches (messages) published,
    /// subscribers with a subscription, and messages dropped for subscribers too far behind.
    pub kv_events: std::sync::Arc<crate::kv_events::Counters>,
    /// Speculative decoding: verifications (a sequence's proposals checked in a step),
    /// proposed tokens, accepted ones, and accepted ones by position in their proposal.
    pub spec_drafts: AtomicU64,
    pub spec_draft_tokens: AtomicU64,
    pub spec_accepted_tokens: AtomicU64,
    pub spec_accepted_per_pos: [AtomicU64; crate::config::MAX_SPECULATIVE_TOKENS],
    /// Why the engine can no longer serve (its thread stopped, or its device was lost).
    down: std::sync::Mutex<Option<String>>,
}

/// A plain copy of the counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    pub waiting: u64,
    pub running: u64,
    pub kv_blocks_total: u64,
    pub kv_blocks_used: u64,
    pub kv_blocks_free: u64,
    pub state_slots_total: u64,
    pub state_slots_used: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub prefix_query_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub preemptions: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub steps: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    pub requests_failed: u64,
    pub stage_failures: u64,
    pub steps_overlapped: u64,
    pub step_failures: u64,
    pub kv_events_published: u64,
    pub kv_event_batches_published: u64,
    pub kv_events_subscribers: u64,
    pub kv_events_dropped: u64,
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub spec_accepted_per_pos: [u64; crate::config::MAX_SPECULATIVE_TOKENS],
    /// False once the engine can no longer serve (see `EngineMetrics::down`).
    pub healthy: bool,
}

impl EngineMetrics {
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            waiting: self.waiting.load(Relaxed),
            running: self.running.load(Relaxed),
            kv_blocks_total: self.kv_blocks_total.load(Relaxed),
            kv_blocks_used: self.kv_blocks_used.load(Relaxed),
            kv_blocks_free: self.kv_blocks_free.load(Relaxed),
            state_slots_total: self.state_slots_total.load(Relaxed),
            state_slots_used: self.state_slots_used.load(Relaxed),
            prefix_queries: self.prefix_queries.load(Relaxed),
            prefix_hits: self.prefix_hits.load(Relaxed),
            prefix_query_tokens: self.prefix_query_tokens.load(Relaxed),
            prefix_hit_tokens: self.prefix_hit_tokens.load(Relaxed),
            preemptions: self.preemptions.load(Relaxed),
            prefill_tokens: self.prefill_tokens.load(Relaxed),
            decode_tokens: self.decode_tokens.load(Relaxed),
            steps: self.steps.load(Relaxed),
            requests_finished: self.requests_finished.load(Relaxed),
            requests_aborted: self.requests_aborted.load(Relaxed),
            requests_failed: self.requests_failed.load(Relaxed),
            stage_failures: self.stage_failures.load(Relaxed),
            steps_overlapped: self.steps_overlapped.load(Relaxed),
            step_failures: self.step_failures.load(Relaxed),
            kv_events_published: self.kv_events.events_published.load(Relaxed),
            kv_event_batches_published: self.kv_events.batches_published.load(Relaxed),
            kv_events_subscribers: self.kv_events.subscribers.load(Relaxed),
            kv_events_dropped: self.kv_events.dropped.load(Relaxed),
            spec_drafts: self.spec_drafts.load(Relaxed),
            spec_draft_tokens: self.spec_draft_tokens.load(Relaxed),
            spec_accepted_tokens: self.spec_accepted_tokens.load(Relaxed),
            spec_accepted_per_pos: std::array::from_fn(|i| self.spec_accepted_per_pos[i].load(Relaxed)),
            healthy: self.down().is_none(),
        }
    }

    /// Marks the engine as unable to serve (the first reason is kept).
    pub fn set_down(&self, why: String) {
        let mut g = self.down.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert(why);
    }

    /// Why the engine cannot serve, once it cannot.
    pub fn down(&self) -> Option<String> {
        self.down.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
