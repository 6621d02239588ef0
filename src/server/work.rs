//! The work a request needs before it is queued (parsing its body, rendering the chat
//! template, tokenizing, compiling its grammar) runs here: on a fixed pool of threads, one per
//! core, never on the async threads and never on tokio's blocking pool.
//!
//! So at most `threads` requests are parsed, rendered or tokenized at once, whatever arrives:
//! the memory and CPU of pre-submit work are bounded by the pool's size times one request's
//! bound (see `body` and `tokenizer`). A request waits for a thread within its own time limit
//! (the caller wraps [`WorkPool::run`] in it); a job the request stopped waiting for still runs
//! to its end, which its own bounds (template fuel, token limits, grammar bounds) keep short,
//! and holds its thread until then, so slow jobs cannot pile up beyond the pool.

use super::error::ApiError;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send>;

/// Bodies at least this large have their memory handed back to the system once their job is
/// done (glibc keeps freed memory in per-thread arenas otherwise).
pub const TRIM_AFTER_BYTES: usize = 1 << 20;

/// The stack of each pool thread (a chat template may nest macros up to minijinja's limit).
const STACK_BYTES: usize = 16 << 20;

pub(crate) struct WorkPool {
    tx: Mutex<Sender<Job>>,
    permits: Arc<tokio::sync::Semaphore>,
    threads: usize,
}

impl WorkPool {
    /// A pool of `threads` threads (at least 1).
    pub fn new(threads: usize) -> WorkPool {
        let threads = threads.max(1);
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("torus-work-{i}"))
                .stack_size(STACK_BYTES)
                .spawn(move || worker(rx));
            if let Err(e) = spawned {
                tracing::warn!("cannot start a request worker thread: {e}");
            }
        }
        WorkPool { tx: Mutex::new(tx), permits: Arc::new(tokio::sync::Semaphore::new(threads)), threads }
    }

    /// One thread per available core.
    pub fn per_core() -> WorkPool {
        WorkPool::new(std::thread::available_parallelism().map_or(2, |n| n.get()))
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on a pool thread once one is free. Dropping the future stops the wait (for a
    /// thread, or for the result); a job already running finishes, and its result is dropped.
    pub async fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
        self.run_sized(0, f).await
    }

    /// [`run`](Self::run) for a job over `bytes` of input: at [`TRIM_AFTER_BYTES`] or more, the
    /// memory the process no longer uses is given back to the system after it.
    pub async fn run_sized<T: Send + 'static>(
        &self,
        bytes: usize,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::internal("the request workers have stopped"))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r);
            if bytes >= TRIM_AFTER_BYTES {
                trim();
            }
            drop(permit);
        });
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| ApiError::internal("the request workers have stopped"))?;
        match rx.await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(p)) => {
                let what = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!("a request worker panicked: {what}");
                Err(ApiError::internal("the request could not be prepared (an internal error)"))
            }
            Err(_) => Err(ApiError::internal("the request workers have stopped")),
        }
    }
}

/// Gives memory freed by the process back to the system (glibc: every arena).
fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn worker(rx: Arc<Mutex<Receiver<Job>>>) {
    loop {
        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        job();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_most_threads_jobs_run_and_abandoned_ones_finish() {
        let pool = Arc::new(WorkPool::new(2));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicUsize::new(0));
        let mut waits = Vec::new();
        for _ in 0..6 {
            let (pool, running, most, done) = (pool.clone(), running.clone(), most.clone(), done.clone());
            waits.push(tokio::spawn(async move {
                // Each caller gives up after 10 ms; the jobs still run, two at a time.
                let job = pool.run(move || {
                    let now = running.fetch_add(1, SeqCst) + 1;
                    most.fetch_max(now, SeqCst);
                    std::thread::sleep(Duration::from_millis(50));
                    running.fetch_sub(1, SeqCst);
                    done.fetch_add(1, SeqCst);
                });
                let _ = tokio::time::timeout(Duration::from_millis(10), job).await;
            }));
        }
        for w in waits {
            w.await.unwrap();
        }
        // Abandoned waits never started their jobs; started ones finish.
        let t = std::time::Instant::now();
        while running.load(SeqCst) > 0 {
            assert!(t.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(most.load(SeqCst) <= 2, "{} jobs at once", most.load(SeqCst));
        assert!(done.load(SeqCst) >= 2);
        // The pool is free again, and a panic is an error, not a lost thread.
        assert_eq!(pool.run(|| 7).await.unwrap(), 7);
        assert_eq!(pool.run(|| -> u8 { panic!("boom") }).await.unwrap_err().status.as_u16(), 500);
        assert_eq!(pool.run(|| 8).await.unwrap(), 8);
    }
}
