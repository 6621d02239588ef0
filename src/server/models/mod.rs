//! `serve --models-dir DIR`: one endpoint for every model under DIR (`catalog`). A request names
//! its model (the body's `model`, Ollama's older `name`, or `?model=` on a GET); a model that is
//! not loaded is loaded then (that request waits; requests for loaded models go on), each in a
//! process of its own (`child`), and the request is passed to it (`proxy`). At most
//! `--max-loaded-models` are loaded, and with `--models-memory-gb` their memory stays within it
//! (each counted as its own memory plan once loaded; before, as its weights on disk + the
//! configured KV cache): the least recently used idle model is unloaded to make room, and also
//! when a load fails because the model does not fit (its own memory plan, the authority, said
//! so). Idle models are also unloaded when their keep-alive runs out (`keep_alive`). `/v1/models`,
//! `/api/tags` and `/api/ps` say which are loaded; `/metrics` labels each model's series with
//! `model="NAME"` (`listing`).
//!
//! Owns: the set of loadable models, their processes, loading and unloading, passing requests on.
//! May use: the server's error shapes and body reading; hub (pulled models); formats (a file's
//! header is read before room is made for it).
//! Never uses: engine internals, gpu, model.

pub mod catalog;
pub mod child;
pub mod keep_alive;
mod listing;
#[cfg(test)]
mod pool_tests;
mod proxy;
mod room;
pub mod serve;

pub use child::Spawn;
pub(crate) use listing::{get_model, health, list_models, metrics, ollama_ps, ollama_tags, server_info, show_unloaded};

use super::error::{ApiError, Dialect};
use super::AppState;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use catalog::Entry;
use child::Child;
use room::Waiting;
pub use room::Why;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a models server loads and unloads.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    pub dir: PathBuf,
    /// Most models loaded (or loading) at once (at least 1).
    pub max_loaded: usize,
    /// Bytes the loaded models' estimates may add up to (None: no budget beyond the count).
    pub memory_budget: Option<u64>,
    /// Bytes of KV cache (and scratch) each model is counted as holding beside its weights.
    pub per_model_extra: u64,
    pub spawn: Spawn,
    /// How long a load may take.
    pub load_timeout: Duration,
    /// How long an idle model stays loaded when its last request did not say (`--keep-alive`).
    pub keep_alive: keep_alive::KeepAlive,
    /// The engine's `max_sequence_length` (what `/api/show` of an unloaded model reports).
    pub max_sequence_length: usize,
}

/// What is loaded or loading.
enum Slot {
    Loading { load: u64, bytes: u64 },
    Ready(Arc<Child>),
}

impl Slot {
    fn bytes(&self) -> u64 {
        match self {
            Slot::Loading { bytes, .. } => *bytes,
            Slot::Ready(c) => c.bytes,
        }
    }
}

/// Counters by model for `/metrics`.
#[derive(Default, Clone)]
pub(crate) struct Counts {
    pub loads: u64,
    pub load_failures: u64,
    /// Unloads by `Why` (as its index).
    pub unloads: [u64; Why::ALL.len()],
    pub requests: u64,
}

/// How long a model whose load failed is refused (without unloading anything for it), unless
/// its file changes.
pub const FAILED_HOLD: Duration = Duration::from_secs(60);

/// A load that failed lately.
struct Failure {
    at: Instant,
    why: String,
    /// The file then.
    file: catalog::FileFacts,
}

/// 503 for a model larger than the whole memory budget.
fn too_large(name: &str, need: u64, budget: u64) -> ApiError {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    ApiError::unavailable(
        format!(
            "model {name:?} needs about {:.2} GiB (its weights and KV cache), more than the {:.2} GiB \
             --models-memory-gb allows for all models",
            gib(need),
            gib(budget)
        ),
        "model_too_large",
    )
}

#[derive(Default)]
struct State_ {
    slots: HashMap<String, Slot>,
    /// Why a load failed, by load id (read by the requests that waited on it).
    failed: HashMap<u64, String>,
    /// Loads that failed lately, by model name.
    failures: HashMap<String, Failure>,
    counts: HashMap<String, Counts>,
    /// Requests waiting for each model (by id: since when): a model that was just loaded for
    /// them is not unloaded before they have it, even when it drains (see room.rs).
    waiting: HashMap<String, HashMap<u64, Instant>>,
    /// Requests waiting for room to load their model, by ticket: since when.
    room: HashMap<u64, Instant>,
    next_ticket: u64,
}

/// The models of a models server.
pub struct Pool {
    pub cfg: PoolConfig,
    entries: Mutex<Vec<Arc<Entry>>>,
    /// Hub models pulled while the server runs.
    pulled: Mutex<Vec<Arc<Entry>>>,
    state: Mutex<State_>,
    /// Bumped on every change of `state` (a load ends, a request ends, a process exits).
    changed: tokio::sync::watch::Sender<u64>,
    next_load: AtomicU64,
    /// When DIR was last read for an unknown name.
    last_scan: Mutex<Option<Instant>>,
    pub(crate) http: reqwest::Client,
}

/// A request's hold on a loaded model: while any is held the model is not unloaded.
pub struct Lease {
    pub child: Arc<Child>,
    pool: Arc<Pool>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Ok(mut t) = self.child.last_used.lock() {
            *t = Instant::now();
        }
        let last = self.child.in_flight.fetch_sub(1, SeqCst) == 1;
        if last && self.child.unload_when_idle.load(SeqCst) {
            self.pool.stop(&self.child.name);
        }
        self.pool.bump();
    }
}

impl Pool {
    pub fn new(cfg: PoolConfig) -> anyhow::Result<Arc<Pool>> {
        let http = reqwest::Client::builder().no_proxy().connect_timeout(Duration::from_secs(5)).build()?;
        let pool = Pool {
            cfg,
            entries: Mutex::new(Vec::new()),
            pulled: Mutex::new(Vec::new()),
            state: Mutex::new(State_::default()),
            changed: tokio::sync::watch::Sender::new(0),
            next_load: AtomicU64::new(1),
            last_scan: Mutex::new(None),
            http,
        };
        pool.rescan();
        Ok(Arc::new(pool))
    }

    fn bump(&self) {
        self.changed.send_modify(|g| *g += 1);
    }

    /// Reads DIR again (entries keep their identity where the name and path are unchanged).
    pub fn rescan(&self) {
        let found = catalog::scan(&self.cfg.dir);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let old = std::mem::take(&mut *entries);
        *entries = found
            .into_iter()
            .map(|(name, path)| match old.iter().find(|e| e.name == name && e.path == path) {
                Some(e) => e.clone(),
                None => Arc::new(Entry::new(name, path)),
            })
            .collect();
    }

    /// Every loadable model, DIR's first, then the pulled ones.
    pub fn entries(&self) -> Vec<Arc<Entry>> {
        let mut v = self.entries.lock().unwrap_or_else(|e| e.into_inner()).clone();
        v.extend(self.pulled.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned());
        v
    }

    /// The model a client names (Ollama's `:latest` is no tag); DIR is read again once when
    /// the name is not known.
    pub fn find(&self, name: &str) -> Option<Arc<Entry>> {
        let name = catalog::plain_name(name);
        let look = |p: &Pool| p.entries().into_iter().find(|e| e.name == name);
        look(self)
            .or_else(|| {
                // At most one read of DIR a second, however many unknown names arrive.
                let due = {
                    let mut last = self.last_scan.lock().unwrap_or_else(|e| e.into_inner());
                    let due = last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
                    if due {
                        *last = Some(Instant::now());
                    }
                    due
                };
                if due {
                    off_async(|| self.rescan());
                }
                look(self)
            })
            .or_else(|| {
                // A Hub model already in the cache (pulled earlier, by this or another tool);
                // the look is bounded (see hub::cache).
                let spec = crate::hub::Spec::parse(catalog::hub_name(name)?).ok()?;
                let opts = crate::hub::Options { offline: true, progress: false, ..crate::hub::Options::from_env() };
                let path = off_async(|| crate::hub::pull(&spec, &opts)).ok()?;
                self.add_pulled(name, path);
                look(self)
            })
    }

    /// Adds a Hub model pulled into the cache (`hf.co/...`), servable under that name.
    pub fn add_pulled(&self, name: &str, path: PathBuf) {
        let mut p = self.pulled.lock().unwrap_or_else(|e| e.into_inner());
        let name = catalog::plain_name(name).to_string();
        p.retain(|e| e.name != name);
        p.push(Arc::new(Entry::new(name, path)));
    }

    /// (name, loaded child or None while it loads) of every model loaded or loading.
    pub(crate) fn loaded(&self) -> Vec<(String, Option<Arc<Child>>)> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<_> = s
            .slots
            .iter()
            .filter_map(|(n, slot)| {
                let c = match slot {
                    Slot::Ready(c) if c.alive() => Some(c.clone()),
                    Slot::Ready(_) => return None,
                    Slot::Loading { .. } => None,
                };
                Some((n.clone(), c))
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Whether `name` is loaded (not loading).
    pub(crate) fn is_loaded(&self, name: &str) -> bool {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        matches!(s.slots.get(name), Some(Slot::Ready(c)) if c.alive())
    }

    pub(crate) fn counts(&self) -> Vec<(String, Counts)> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<_> = s.counts.iter().map(|(n, c)| (n.clone(), c.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The bytes a model is counted as holding once loaded.
    fn estimate(&self, e: &Entry) -> u64 {
        e.size + self.cfg.per_model_extra
    }

    /// A hold on model `e`, loading it first if it is not loaded (waiting for room where the
    /// loaded models are busy), within `limit`.
    pub async fn acquire(self: &Arc<Pool>, e: Arc<Entry>, limit: Duration) -> Result<Lease, ApiError> {
        let deadline = Instant::now() + limit;
        let mut waited_on: Option<u64> = None;
        let started = Instant::now();
        let mut waiting = Waiting::new(self, &e.name, started);
        // The file as it was when checked, before any room is made for it.
        let mut checked: Option<catalog::FileFacts> = None;
        loop {
            // Subscribed before looking, so no change after the look is missed.
            let mut rx = self.changed.subscribe();
            let mut check_first = false;
            {
                let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(why) = waited_on.and_then(|l| s.failed.get(&l).cloned()) {
                    return Err(ApiError::internal(format!("model {:?} failed to load: {why}", e.name))
                        .code("model_load_failed"));
                }
                let drain = self.draining(&s);
                match s.slots.get(&e.name) {
                    // A model being drained for a request that waits for room takes no request
                    // that came after that one.
                    Some(Slot::Ready(c))
                        if c.alive() && drain.as_ref().is_some_and(|d| d.0 == e.name && d.1 < started) => {}
                    Some(Slot::Ready(c)) if c.alive() => {
                        let c = c.clone();
                        c.in_flight.fetch_add(1, SeqCst);
                        s.counts.entry(e.name.clone()).or_default().requests += 1;
                        return Ok(Lease { child: c, pool: self.clone() });
                    }
                    Some(Slot::Ready(_)) => {
                        s.slots.remove(&e.name);
                        continue;
                    }
                    Some(Slot::Loading { load, .. }) => waited_on = Some(*load),
                    None if checked.is_none() => check_first = true,
                    None => {
                        let need = self.estimate(&e);
                        if let Some(budget) = self.cfg.memory_budget.filter(|&b| need > b) {
                            return Err(too_large(&e.name, need, budget));
                        }
                        let room = self.room_for(&s, need, drain.as_ref().map(|d| (d.0.as_str(), d.1)));
                        if room.is_none() {
                            waiting.wait_for_room(&mut s);
                        }
                        if let Some(victims) = room {
                            waiting.got_room(&mut s);
                            let gone: Vec<Arc<Child>> =
                                victims.into_iter().filter_map(|(n, why)| self.unload(&mut s, &n, why)).collect();
                            let load = self.next_load.fetch_add(1, SeqCst);
                            s.slots.insert(e.name.clone(), Slot::Loading { load, bytes: need });
                            waited_on = Some(load);
                            let file = checked.unwrap_or((0, std::time::UNIX_EPOCH));
                            tokio::spawn(self.clone().load(e.clone(), load, need, gone, file));
                        }
                    }
                }
            }
            if check_first {
                checked = Some(self.check(&e).await?);
                continue;
            }
            // Also looked at again every quarter second: a drain starts with time, not an event.
            let left = deadline.saturating_duration_since(Instant::now());
            let nap = left.min(Duration::from_millis(250));
            if tokio::time::timeout(nap, rx.changed()).await.is_err() && nap == left {
                return Err(ApiError::unavailable(
                    format!(
                        "model {:?} could not be loaded within {} s: the loaded models are busy",
                        e.name,
                        limit.as_secs()
                    ),
                    "model_busy",
                ));
            }
        }
    }

    /// Before any room is made for `e`: its file must read as a model, and must not be one
    /// whose load failed within [`FAILED_HOLD`] (unless the file changed since). The file's
    /// facts as checked.
    async fn check(&self, e: &Entry) -> Result<catalog::FileFacts, ApiError> {
        let path = e.path.clone();
        let looked = tokio::task::spawn_blocking(move || (catalog::facts(&path), catalog::check_loadable(&path))).await;
        let (file, r) = looked.map_err(|_| ApiError::internal("the model check panicked"))?;
        let failed = |why: &str| {
            ApiError::internal(format!("model {:?} cannot be loaded: {why}", e.name)).code("model_load_failed")
        };
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = s.failures.get(&e.name).filter(|f| f.file == file && f.at.elapsed() < FAILED_HOLD) {
            let ago = f.at.elapsed().as_secs();
            let why = format!("it failed to load {ago} s ago ({}); it is tried again once its file changes", f.why);
            return Err(failed(&why));
        }
        if let Err(why) = r {
            s.counts.entry(e.name.clone()).or_default().load_failures += 1;
            s.failures.insert(e.name.clone(), Failure { at: Instant::now(), why: why.clone(), file });
            return Err(failed(&why));
        }
        Ok(file)
    }

    /// Loads `e` (its slot says Loading with id `load`); where its own memory plan says it does
    /// not fit and an idle model is loaded, that one is unloaded and the load tried again.
    async fn load(
        self: Arc<Pool>,
        e: Arc<Entry>,
        load: u64,
        bytes: u64,
        mut gone: Vec<Arc<Child>>,
        file: catalog::FileFacts,
    ) {
        eprintln!(
            "torus-wgpu serve: loading model {:?} from {}",
            e.name,
            catalog::printable(&e.path.display().to_string())
        );
        let t0 = Instant::now();
        let r = loop {
            let pool = Arc::downgrade(&self);
            let name = e.name.clone();
            let on_exit = move || {
                if let Some(p) = pool.upgrade() {
                    p.exited(&name, load);
                }
            };
            // The models unloaded for this one give their memory back first.
            Pool::gone(&gone).await;
            let r = child::start(&self.cfg.spawn, load, &e.name, &e.path, bytes, self.cfg.load_timeout, on_exit).await;
            match r {
                Err(why) if why.contains("does not fit") || why.contains("not enough host memory") => {
                    let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
                    let victim = Pool::idle(&s, None).first().map(|(n, _)| n.to_string());
                    match victim.and_then(|n| self.unload(&mut s, &n, Why::Memory)) {
                        Some(c) => gone = vec![c],
                        None => break Err(why),
                    }
                }
                r => break r,
            }
        };
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let counts = s.counts.entry(e.name.clone()).or_default();
        match r {
            Ok(c) => {
                counts.loads += 1;
                eprintln!("torus-wgpu serve: model {:?} loaded in {:.1} s", e.name, t0.elapsed().as_secs_f64());
                s.slots.insert(e.name.clone(), Slot::Ready(Arc::new(c)));
                s.failures.remove(&e.name);
            }
            Err(why) => {
                counts.load_failures += 1;
                eprintln!("torus-wgpu serve: model {:?} failed to load: {}", e.name, catalog::printable(&why));
                s.slots.remove(&e.name);
                if s.failures.len() > 1024 {
                    s.failures.clear();
                }
                s.failures.insert(e.name.clone(), Failure { at: Instant::now(), why: why.clone(), file });
                if s.failed.len() > 1024 {
                    s.failed.clear();
                }
                s.failed.insert(load, why);
            }
        }
        drop(s);
        self.bump();
    }

    /// A model's process ended: unloaded by us, or it died (then it is loaded again when next
    /// asked for).
    fn exited(&self, name: &str, load: u64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(s.slots.get(name), Some(Slot::Ready(c)) if c.id == load) {
            eprintln!("torus-wgpu serve: model {name:?} stopped unexpectedly; it loads again when next asked for");
            s.slots.remove(name);
            s.counts.entry(name.to_string()).or_default().unloads[Why::Exited as usize] += 1;
        }
        drop(s);
        self.bump();
    }

    /// Unloads `name` (Ollama's `keep_alive: 0`): now if it is idle, else when its last
    /// request ends. Whether it was loaded.
    pub fn stop(&self, name: &str) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(Slot::Ready(c)) = s.slots.get(name) else { return false };
        if c.in_flight.load(SeqCst) == 0 {
            self.unload(&mut s, name, Why::Asked);
        } else {
            c.unload_when_idle.store(true, SeqCst);
        }
        drop(s);
        self.bump();
        true
    }

    /// Unloads the idle models whose keep-alive has run out.
    pub fn expire(&self) {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let due: Vec<String> = s
            .slots
            .iter()
            .filter_map(|(n, slot)| match slot {
                Slot::Ready(c)
                    if c.in_flight.load(SeqCst) == 0
                        && !s.waiting.contains_key(n)
                        && c.expires().is_some_and(|t| t <= now) =>
                {
                    Some(n.clone())
                }
                _ => None,
            })
            .collect();
        for name in &due {
            self.unload(&mut s, name, Why::Expired);
        }
        drop(s);
        if !due.is_empty() {
            self.bump();
        }
    }

    /// Checks keep-alives every quarter second while the pool lives (inside a runtime).
    pub fn start_expiry(self: &Arc<Pool>) {
        let pool = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                match pool.upgrade() {
                    Some(p) => p.expire(),
                    None => return,
                }
            }
        });
    }

    /// Ends every model's process (the server is stopping).
    pub fn stop_all(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (_, slot) in s.slots.drain() {
            if let Slot::Ready(c) = slot {
                c.kill();
            }
        }
    }
}

/// Runs `f`, which reads the disk, telling the runtime (where it is a multi-threaded one) that
/// this thread blocks, so the other requests go on on other threads.
fn off_async<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// The routes a models server answers itself; every other API route is passed to a model.
fn answered_here(path: &str) -> bool {
    matches!(path, "/v1/models" | "/models" | "/api/tags" | "/api/ps" | "/api/version" | "/api/pull" | "/server_info")
        || path.starts_with("/v1/models/")
        || path.starts_with("/api/blobs/")
        || matches!(path, "/api/delete" | "/api/push" | "/api/create" | "/api/copy")
}

/// The middleware in front of the API routes: on a models server, the request goes to the
/// model it names; elsewhere (and for the routes answered here) it goes on.
pub(crate) async fn dispatch(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(pool) = st.models.clone() else { return next.run(req).await };
    let path = req.uri().path().to_string();
    if answered_here(&path) {
        return next.run(req).await;
    }
    let dialect = Dialect::of_path(&path);
    match proxy::pass(&st, &pool, req).await {
        Ok(r) => r,
        Err(e) => e.response_in(dialect),
    }
}

/// 404 for an unknown model in a models server's words.
pub(crate) fn unknown(pool: &Pool, name: &str) -> ApiError {
    let name = catalog::plain_name(name);
    let mut names: Vec<String> = pool.entries().iter().map(|e| e.name.clone()).collect();
    names.truncate(20);
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("The model `{name}` does not exist here; the models are: {}", names.join(", ")),
    )
    .param("model")
    .code("model_not_found")
}
