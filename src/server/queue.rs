//! Admission: the queue limit (`max_queued_requests`), one place per sequence from its
//! submission to its first event, and one request's share of the queue.
//!
//! A request of many sequences (an embeddings request of 256 inputs, completions with many
//! prompts or a large `n`) holds at most [`share`] places at once (a quarter of the queue, at
//! most [`MAX_SHARE`]): its first sequences are
//! submitted, and each later one when an earlier one of the same request leaves the queue (its
//! place passes on, see [`Gate`]). So one request never fills the queue and others are admitted
//! and scheduled beside it.

use super::error::ApiError;
use super::AppState;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Semaphore;

/// One admission-queue place: held from acceptance until the sequence's first event.
pub(crate) struct QueueSlot(Arc<AppState>);

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.metrics.queued.fetch_sub(1, Relaxed);
    }
}

/// The most sequences of one request waiting at once, whatever the queue's size: a request
/// sent behind a large one waits behind at most these of its sequences (the engine schedules
/// first come, first served).
pub(crate) const MAX_SHARE: usize = 8;

/// The most places one request holds at once: a quarter of the queue, at least one and at most
/// [`MAX_SHARE`].
pub(crate) fn share(st: &AppState) -> usize {
    (st.cfg.max_queued_requests / 4).clamp(1, MAX_SHARE)
}

/// Takes `n` places, or answers 503 when the queue already holds `max_queued_requests`. A
/// request is never refused for its own size alone, so a large `n` still runs on an idle server.
pub(crate) fn reserve(st: &Arc<AppState>, n: usize) -> Result<Vec<QueueSlot>, ApiError> {
    let before = st.metrics.queued.fetch_add(n as u64, Relaxed);
    let slots: Vec<QueueSlot> = (0..n).map(|_| QueueSlot(st.clone())).collect();
    if before >= st.cfg.max_queued_requests as u64 {
        return Err(overloaded(st, before));
    }
    Ok(slots)
}

/// 503 while the queue is full: checked before a request's body is parsed, so an overloaded
/// server spends nothing on requests it would refuse (`reserve` checks again).
pub(crate) fn check_queue(st: &AppState) -> Result<(), ApiError> {
    let queued = st.metrics.queued.load(Relaxed);
    if queued >= st.cfg.max_queued_requests as u64 {
        return Err(overloaded(st, queued));
    }
    Ok(())
}

fn overloaded(st: &AppState, queued: u64) -> ApiError {
    st.metrics.rejected_overloaded.fetch_add(1, Relaxed);
    ApiError::unavailable(format!("the server is overloaded ({queued} requests queued); retry later"), "overloaded")
}

/// The places of one request of more sequences than its [`share`], passed from sequence to
/// sequence: a sequence takes one before it is submitted ([`take`](Self::take), waiting while
/// all are in use) and gives it back at its first event ([`give_back`](Self::give_back)); the
/// last ones are let go.
pub(crate) struct Gate {
    free: Semaphore,
    pool: Mutex<Vec<QueueSlot>>,
    /// Sequences of the request not yet submitted.
    waiting: AtomicUsize,
}

impl Gate {
    pub(crate) fn new(places: Vec<QueueSlot>, sequences: usize) -> Gate {
        Gate { free: Semaphore::new(places.len()), pool: Mutex::new(places), waiting: AtomicUsize::new(sequences) }
    }

    /// A place for the next sequence, once one is free.
    pub(crate) async fn take(&self) -> Result<QueueSlot, ApiError> {
        let permit = self.free.acquire().await.map_err(|_| ApiError::internal("the request's queue places closed"))?;
        permit.forget();
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        let slot = self.pool.lock().ok().and_then(|mut p| p.pop());
        slot.ok_or_else(|| ApiError::internal("no queue place left for the request"))
    }

    /// A sequence left the queue: its place goes to the request's next sequence, if any.
    pub(crate) fn give_back(&self, slot: QueueSlot) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Ok(mut p) = self.pool.lock() {
            p.push(slot);
            self.free.add_permits(1);
        }
    }
}
