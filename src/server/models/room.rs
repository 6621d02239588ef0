//! Making room for a model: which idle models to unload (least recently used first), and
//! fairness between models. A model just loaded is its waiters' before it can be unloaded; and a
//! request that has waited `DRAIN_AFTER` for room makes the least recently used loaded model
//! *drain*: requests for it that came later wait, so its requests end, it is unloaded, and the
//! waiting model loads (without this, steady traffic to one model would keep another from ever
//! loading). A draining model is unloaded only once the requests that came before the drain
//! have had it: else two models with waiters could unload each other before either served
//! (a load slower than DRAIN_AFTER starts a drain of the model just loaded).

use super::{Child, Pool, Slot, State_};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a model was unloaded (`torus_model_unloads_total`'s `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// For `--max-loaded-models`.
    Count,
    /// For the memory budget, or a load its own memory plan refused.
    Memory,
    /// A client asked (Ollama's `keep_alive: 0`).
    Asked,
    /// Idle past its keep-alive.
    Expired,
    /// Its process ended by itself.
    Exited,
}

impl Why {
    pub const ALL: [Why; 5] = [Why::Count, Why::Memory, Why::Asked, Why::Expired, Why::Exited];

    pub fn label(self) -> &'static str {
        match self {
            Why::Count => "max_loaded_models",
            Why::Memory => "memory",
            Why::Asked => "asked",
            Why::Expired => "expired",
            Why::Exited => "exited",
        }
    }

    fn says(self) -> &'static str {
        match self {
            Why::Count => "least recently used, for --max-loaded-models",
            Why::Memory => "least recently used, for memory",
            Why::Asked => "asked to",
            Why::Expired => "idle past its keep-alive",
            Why::Exited => "its process ended",
        }
    }
}

/// How long a request waits for room before a loaded model is drained for it.
pub const DRAIN_AFTER: Duration = Duration::from_secs(1);

/// A request's place among a model's waiters (and, while it waits for room, among those), for
/// as long as `acquire` runs.
pub(super) struct Waiting<'a> {
    pool: &'a Pool,
    name: &'a str,
    id: u64,
    ticket: Option<u64>,
}

impl<'a> Waiting<'a> {
    /// A request for `name` that arrived at `since`.
    pub fn new(pool: &'a Pool, name: &'a str, since: Instant) -> Waiting<'a> {
        let mut s = pool.state.lock().unwrap_or_else(|e| e.into_inner());
        s.next_ticket += 1;
        let id = s.next_ticket;
        s.waiting.entry(name.to_string()).or_default().insert(id, since);
        Waiting { pool, name, id, ticket: None }
    }

    /// It waits for room (from now, the first time).
    pub fn wait_for_room(&mut self, s: &mut State_) {
        if self.ticket.is_none() {
            s.next_ticket += 1;
            self.ticket = Some(s.next_ticket);
            s.room.insert(s.next_ticket, Instant::now());
        }
    }

    /// It has room now.
    pub fn got_room(&mut self, s: &mut State_) {
        if let Some(t) = self.ticket.take() {
            s.room.remove(&t);
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut s = self.pool.state.lock().unwrap_or_else(|e| e.into_inner());
        self.got_room(&mut s);
        if let Some(w) = s.waiting.get_mut(self.name) {
            w.remove(&self.id);
            if w.is_empty() {
                s.waiting.remove(self.name);
            }
        }
    }
}

impl Pool {
    /// The loaded model being drained, and since when the request it drains for has waited:
    /// the least recently used loaded model once some request has waited DRAIN_AFTER for room.
    pub(super) fn draining(&self, s: &State_) -> Option<(String, Instant)> {
        let since = *s.room.values().min()?;
        if since.elapsed() < DRAIN_AFTER {
            return None;
        }
        let used = |c: &Arc<Child>| *c.last_used.lock().unwrap_or_else(|e| e.into_inner());
        let lru = s
            .slots
            .iter()
            .filter_map(|(n, slot)| match slot {
                Slot::Ready(c) => Some((used(c), n)),
                Slot::Loading { .. } => None,
            })
            .min_by_key(|x| x.0)?;
        Some((lru.1.clone(), since))
    }

    /// Idle loaded models to unload so that one more of `need` bytes fits, least recently
    /// used first; None when the models in the way are busy (or loading) and it must wait.
    /// With nothing else loaded, the model is tried whatever its estimate.
    /// The loaded models that may be unloaded, least recently used first: no request in flight
    /// and none waiting for them, but for the drained model (`drain`: its name, and since when
    /// the request it drains for has waited) none that came before the drain (those that came
    /// after wait on).
    pub(super) fn idle<'s>(s: &'s State_, drain: Option<(&str, Instant)>) -> Vec<(&'s String, &'s Arc<Child>)> {
        let unwaited = |n: &String| match (s.waiting.get(n), drain) {
            (None, _) => true,
            (Some(w), Some((d, since))) if d == n.as_str() => w.values().all(|&t| t > since),
            (Some(_), _) => false,
        };
        let mut idle: Vec<(Instant, &String, &Arc<Child>)> = s
            .slots
            .iter()
            .filter_map(|(n, slot)| match slot {
                Slot::Ready(c) if c.in_flight.load(SeqCst) == 0 && unwaited(n) => {
                    Some((*c.last_used.lock().unwrap_or_else(|e| e.into_inner()), n, c))
                }
                _ => None,
            })
            .collect();
        idle.sort_by_key(|x| x.0);
        idle.into_iter().map(|(_, n, c)| (n, c)).collect()
    }

    pub(super) fn room_for(&self, s: &State_, need: u64, drain: Option<(&str, Instant)>) -> Option<Vec<(String, Why)>> {
        let idle = Pool::idle(s, drain);
        let (mut count, mut used) = (s.slots.len(), s.slots.values().map(Slot::bytes).sum::<u64>());
        let over_count = |count: usize| count >= self.cfg.max_loaded;
        let over_memory = |count: usize, used: u64| {
            count > 0 && self.cfg.memory_budget.is_some_and(|b| used.saturating_add(need) > b)
        };
        let mut out = Vec::new();
        let mut idle = idle.into_iter();
        while over_count(count) || over_memory(count, used) {
            let why = if over_count(count) { Why::Count } else { Why::Memory };
            let (n, c) = idle.next()?;
            out.push((n.clone(), why));
            count -= 1;
            used -= c.bytes;
        }
        Some(out)
    }

    /// Unloads `name` (it is idle), counted by why.
    /// Unloads idle model `name`, counted by why; its process, ending (see `gone`).
    pub(super) fn unload(&self, s: &mut State_, name: &str, why: Why) -> Option<Arc<Child>> {
        let Some(Slot::Ready(c)) = s.slots.remove(name) else { return None };
        eprintln!("torus-wgpu serve: unloading model {name:?} ({})", why.says());
        s.counts.entry(name.to_string()).or_default().unloads[why as usize] += 1;
        c.kill();
        Some(c)
    }

    /// Waits (up to 10 s) until the processes of unloaded models have ended: their device
    /// memory is free only then.
    pub(super) async fn gone(children: &[Arc<Child>]) {
        let t0 = Instant::now();
        while children.iter().any(|c| c.alive()) && t0.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
