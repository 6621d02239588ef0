//! The pool's loading and unloading with stand-in model processes (`sh`, which says it is ready
//! at once and lives until its stdin closes or it is killed): no model, no device.

use super::catalog::Entry;
use super::keep_alive::KeepAlive;
use super::{Pool, PoolConfig, Spawn, Why};
use std::sync::Arc;
use std::time::Duration;

const STAND_IN: &str = "echo 'torus-wgpu serve: listening on http://127.0.0.1:9 (stand-in)' >&2; \
                        echo 'torus-wgpu serve: ready on http://127.0.0.1:9 | stand-in' >&2; exec cat >/dev/null";

fn pool(max_loaded: usize, budget: Option<u64>) -> Arc<Pool> {
    pool_with(max_loaded, budget, STAND_IN)
}

fn pool_with(max_loaded: usize, budget: Option<u64>, script: &str) -> Arc<Pool> {
    let dir = std::env::temp_dir().join(format!("torus-pool-{}-{max_loaded}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Pool::new(PoolConfig {
        dir,
        max_loaded,
        memory_budget: budget,
        per_model_extra: 100,
        spawn: Spawn { exe: "/bin/sh".into(), before: vec!["-c".into(), script.into()], args: vec![] },
        load_timeout: Duration::from_secs(20),
        keep_alive: KeepAlive::Forever,
        max_sequence_length: 64,
    })
    .unwrap()
}

/// A real GGUF file (the stand-in does not read it, but the check before a load does).
const GGUF: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-gemma4.gguf");

/// Model `name` at `path`, counted as no bytes on disk (its estimate is `per_model_extra`).
fn entry_at(name: &str, path: &std::path::Path) -> Arc<Entry> {
    let e = Entry::new(name.into(), path.to_path_buf());
    Arc::new(Entry { size: 0, ..e })
}

fn entry(name: &str) -> Arc<Entry> {
    entry_at(name, std::path::Path::new(GGUF))
}

fn loads(p: &Pool) -> u64 {
    p.counts().iter().map(|(_, c)| c.loads).sum()
}

/// Requests for two models at once with room for one: each model is loaded once and serves all
/// of its requests before it is unloaded for the other (one just loaded is its waiters' first).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_for_two_models_loads_each_once() {
    let p = pool(1, None);
    let (a, b) = (entry("a"), entry("b"));
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let (p, e) = (p.clone(), if i % 2 == 0 { a.clone() } else { b.clone() });
            tokio::spawn(async move {
                let lease = p.acquire(e, Duration::from_secs(20)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(lease);
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(loads(&p), 2, "{:?}", p.counts().iter().map(|(n, c)| (n.clone(), c.loads)).collect::<Vec<_>>());
    p.stop_all();
}

/// The same with loads slower than DRAIN_AFTER (so the other model's requests have waited long
/// enough to drain the model just loaded before its own requests had it): still no model is
/// unloaded before the requests that came before the drain had it, so no thrashing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_loads_do_not_thrash() {
    let slow = format!("sleep 1.3; {STAND_IN}");
    let p = pool_with(1, None, &slow);
    let (a, b) = (entry("a"), entry("b"));
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (p, e) = (p.clone(), if i % 2 == 0 { a.clone() } else { b.clone() });
            tokio::spawn(async move {
                let lease = p.acquire(e, Duration::from_secs(30)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(lease);
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let n = loads(&p);
    assert!(n <= 3, "{n} loads: {:?}", p.counts().iter().map(|(n, c)| (n.clone(), c.loads)).collect::<Vec<_>>());
    p.stop_all();
}

/// A budget that holds one: the idle model is unloaded for the next (reason memory); a busy one
/// is not, and the next waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_model_is_never_unloaded() {
    let p = pool(4, Some(150));
    let (a, b) = (entry("a"), entry("b"));
    let held = p.acquire(a.clone(), Duration::from_secs(20)).await.unwrap();
    let waiting = {
        let (p, b) = (p.clone(), b.clone());
        tokio::spawn(async move { p.acquire(b, Duration::from_secs(20)).await.map(|_| ()) })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "b waits while a serves");
    assert!(p.is_loaded("a") && !p.is_loaded("b"));
    drop(held);
    waiting.await.unwrap().unwrap();
    assert!(!p.is_loaded("a") && p.is_loaded("b"));
    let c = p.counts();
    assert_eq!(c.iter().find(|(n, _)| n == "a").unwrap().1.unloads[Why::Memory as usize], 1);
    p.stop_all();
}

/// Steady traffic to one model (its requests overlap, so it is never idle) does not keep a
/// request for another from loading: after DRAIN_AFTER the busy model takes no new request,
/// drains, and is unloaded; the other loads while the traffic goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn steady_traffic_to_one_model_does_not_starve_another() {
    let p = pool(1, None);
    let (a, b) = (entry("a"), entry("b"));
    let traffic = {
        let (p, a) = (p.clone(), a.clone());
        tokio::spawn(async move {
            let t0 = std::time::Instant::now();
            let mut running = Vec::new();
            while t0.elapsed() < Duration::from_secs(8) {
                let (p, a) = (p.clone(), a.clone());
                running.push(tokio::spawn(async move {
                    let lease = p.acquire(a, Duration::from_secs(30)).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    drop(lease);
                }));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            running
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(p.is_loaded("a"));
    let lease = p.acquire(b, Duration::from_secs(30)).await.unwrap();
    assert!(!traffic.is_finished(), "b loaded while a's traffic went on");
    drop(lease);
    for r in traffic.await.unwrap() {
        r.await.unwrap();
    }
    p.stop_all();
}

/// A load that its own memory plan refuses ("does not fit") unloads an idle model, waits for
/// its process to end, and tries again; with nothing idle to unload, the refusal is the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_that_does_not_fit_unloads_an_idle_model() {
    let lock = std::env::temp_dir().join(format!("torus-pool-fit-{}", std::process::id()));
    let _ = std::fs::remove_file(&lock);
    // One stand-in at a time fits: another, while the first lives, is refused as the engine's
    // memory check refuses a model.
    let script = format!(
        "if [ -f {l} ] && kill -0 $(cat {l}) 2>/dev/null; then \
         echo 'Error: m.gguf: the model does not fit on the device' >&2; exit 1; fi; echo $$ > {l}; {STAND_IN}",
        l = lock.display()
    );
    let p = pool_with(4, None, &script);
    let (a, b, c) = (entry("a"), entry("b"), entry("c"));
    drop(p.acquire(a.clone(), Duration::from_secs(20)).await.unwrap());
    let held = p.acquire(b, Duration::from_secs(20)).await.unwrap();
    assert!(!p.is_loaded("a") && p.is_loaded("b"), "a was unloaded for b");
    assert_eq!(p.counts().iter().find(|(n, _)| n == "a").unwrap().1.unloads[Why::Memory as usize], 1);
    let refused = p.acquire(c, Duration::from_secs(20)).await.err().expect("nothing idle to unload");
    assert!(refused.body()["error"]["message"].as_str().unwrap().contains("does not fit"), "{:?}", refused.body());
    drop(held);
    p.stop_all();
    let _ = std::fs::remove_file(&lock);
}

/// A file that is no model never makes room for itself: with one model loaded and room for one,
/// a request for a broken file is refused at once (its header read), again and again, and the
/// loaded model stays loaded and is never unloaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broken_file_never_unloads_the_loaded_model() {
    let p = pool(1, None);
    let broken = std::env::temp_dir().join(format!("torus-pool-broken-{}.gguf", std::process::id()));
    std::fs::write(&broken, b"GGUF but not really a model file").unwrap();
    let (good, bad) = (entry("good"), entry_at("bad", &broken));
    drop(p.acquire(good.clone(), Duration::from_secs(20)).await.unwrap());
    for _ in 0..3 {
        let e = p.acquire(bad.clone(), Duration::from_secs(20)).await.err().expect("a broken file does not load");
        assert_eq!(e.body()["error"]["code"], "model_load_failed", "{:?}", e.body());
        assert!(!e.body().to_string().contains("/tmp"), "no server path: {:?}", e.body());
        assert!(p.is_loaded("good"));
    }
    let c = p.counts();
    let good_counts = &c.iter().find(|(n, _)| n == "good").unwrap().1;
    assert_eq!((good_counts.loads, good_counts.unloads.iter().sum::<u64>()), (1, 0));
    assert_eq!(loads(&p), 1, "nothing was started for the broken file");
    let _ = std::fs::remove_file(&broken);
    p.stop_all();
}

/// A model whose process fails to load is refused for a while (`FAILED_HOLD`) without making
/// room again: the first failure unloaded the idle model once, the next request for it unloads
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_model_that_just_failed_is_refused_without_unloading() {
    let script = format!(
        "case \"$*\" in *served-model-name=fails*) echo 'Error: the model cannot load' >&2; exit 1;; esac; {STAND_IN}"
    );
    let p = pool_with(1, None, &script);
    let (good, fails) = (entry("good"), entry("fails"));
    drop(p.acquire(good.clone(), Duration::from_secs(20)).await.unwrap());
    let e = p.acquire(fails.clone(), Duration::from_secs(20)).await.err().expect("its process fails");
    assert!(e.body()["error"]["message"].as_str().unwrap().contains("cannot load"), "{:?}", e.body());
    drop(p.acquire(good.clone(), Duration::from_secs(20)).await.unwrap());
    let t0 = std::time::Instant::now();
    let e = p.acquire(fails, Duration::from_secs(20)).await.err().expect("refused");
    assert!(t0.elapsed() < Duration::from_secs(2), "refused at once");
    assert!(e.body()["error"]["message"].as_str().unwrap().contains("failed to load"), "{:?}", e.body());
    assert!(p.is_loaded("good"), "the loaded model stays");
    let c = p.counts();
    assert_eq!(c.iter().find(|(n, _)| n == "good").unwrap().1.unloads.iter().sum::<u64>(), 1, "unloaded once only");
    p.stop_all();
}

/// The memory budget holds for a model alone: one larger than the whole budget is refused
/// (503, saying the sizes) and nothing is started or unloaded for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_model_larger_than_the_budget_is_refused() {
    let p = pool(4, Some(50));
    let e = p.acquire(entry("big"), Duration::from_secs(20)).await.err().expect("100 bytes > a budget of 50");
    assert_eq!(e.status.as_u16(), 503);
    assert_eq!(e.body()["error"]["code"], "model_too_large", "{:?}", e.body());
    assert_eq!(loads(&p), 0);
    p.stop_all();
}
