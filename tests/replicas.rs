//! Replicas behind a router, end to end on this machine: scripts/replicas.sh starts two
//! `torus-wgpu serve` replicas of the tiny model and the Shepherd Model Gateway (`smg`, a pip
//! package that scripts/setup.sh installs) in front of them. Requests of two long shared
//! prefixes, interleaved: with `cache_aware` each prefix's requests are all served by one replica
//! (they hit its prefix cache); with `round_robin` both replicas serve both prefixes. One replica
//! stopped mid-run: the router sends the rest to the other and no request is lost.
//!
//! Which replica served what is read from each replica's own /metrics (vLLM's names): the
//! prefixes have different prompt lengths, so `vllm:request_prompt_tokens` (sum and count) tells
//! how many requests of each a replica served.

mod common;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A base port with base, base + 1..=n and base + 100 (the router's metrics) free.
fn free_ports(n: u16) -> u16 {
    let mut rng = torus_wgpu::sampling::Rng::from_entropy();
    for _ in 0..200 {
        let base = 20000 + (rng.next_u64() % 20000) as u16;
        let ports: Vec<u16> = (0..=n).map(|i| base + i).chain([base + 100]).collect();
        if ports.iter().all(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return base;
        }
    }
    panic!("no free ports");
}

fn require_smg() {
    let ok = Command::new("smg").arg("--help").output().is_ok_and(|o| o.status.success());
    if !ok {
        panic!("the `smg` command is missing: run scripts/setup.sh (python3 -m pip install smg==1.13.0)");
    }
}

struct Fleet {
    script: Child,
    base: u16,
    /// (port, pid) of each replica.
    replicas: Vec<(u16, u32)>,
    logs: std::path::PathBuf,
}

impl Fleet {
    fn start(policy: &str) -> Fleet {
        require_smg();
        let base = free_ports(2);
        let dir = std::env::temp_dir().join(format!("torus-replicas-test-{}-{base}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pids = dir.join("pids");
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut script = Command::new("bash")
            .arg(root.join("scripts/replicas.sh"))
            .arg("2")
            .env("MODEL", common::tiny())
            .env("PORT", base.to_string())
            .env("POLICY", policy)
            .env("TORUS_BIN", env!("CARGO_BIN_EXE_torus-wgpu"))
            .env("PIDS_FILE", &pids)
            .env("LOG_DIR", &dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start scripts/replicas.sh");
        let out = script.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("[replicas.sh] {line}");
                let _ = tx.send(line);
            }
        });
        let t = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_secs(120).saturating_sub(t.elapsed())) {
                Ok(l) if l.contains("replicas: ready") => break,
                Ok(_) => {}
                Err(_) => {
                    let _ = script.kill();
                    let log = std::fs::read_to_string(dir.join("router.log")).unwrap_or_default();
                    panic!("replicas.sh never became ready; router log:\n{log}");
                }
            }
        }
        let replicas = std::fs::read_to_string(&pids)
            .unwrap()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f[0] == "replica").then(|| (f[2].parse().unwrap(), f[3].parse().unwrap()))
            })
            .collect();
        Fleet { script, base, replicas, logs: dir }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.base)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // SIGTERM: the script stops its replicas and the router.
        let _ = Command::new("kill").arg(self.script.id().to_string()).status();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.script.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.script.kill();
        for &(_, pid) in &self.replicas {
            let _ = Command::new("kill").arg(pid.to_string()).stderr(Stdio::null()).status();
        }
        let _ = std::fs::remove_dir_all(&self.logs);
    }
}

async fn complete(http: &reqwest::Client, base: &str, prompt: &str) -> Value {
    let body = json!({"model": "tiny-qwen2", "prompt": prompt, "max_tokens": 2, "temperature": 0});
    let r = http.post(format!("{base}/v1/completions")).json(&body).send().await.expect("the router answers");
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    v
}

/// (requests of prompt length `la`, of length `lb`) a replica has served so far.
async fn served(http: &reqwest::Client, port: u16, la: u64, lb: u64) -> (u64, u64) {
    let text = http.get(format!("http://127.0.0.1:{port}/metrics")).send().await.unwrap().text().await.unwrap();
    let get = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{text}")) as u64
    };
    let (sum, count) = (get("vllm:request_prompt_tokens_sum{"), get("vllm:request_prompt_tokens_count{"));
    // a + b = count, a la + b lb = sum.
    let b = (sum - la * count) / (lb - la);
    assert_eq!(la * (count - b) + lb * b, sum, "prompt lengths other than {la} and {lb}");
    (count - b, b)
}

fn prefixes() -> (String, String) {
    ("alpha ".repeat(60), "beta gamma ".repeat(40))
}

/// Sends A, A, B, B three times (so that round robin over two replicas gives each replica
/// both prefixes); returns the prompt lengths (tokens) of A's and B's requests.
async fn run_interleaved(http: &reqwest::Client, base: &str) -> (u64, u64) {
    let (a, b) = prefixes();
    let (mut la, mut lb) = (0, 0);
    for i in 0..6 {
        la = complete(http, base, &format!("{a}q{i}")).await["usage"]["prompt_tokens"].as_u64().unwrap();
        if i % 2 == 1 {
            for j in i - 1..=i {
                lb = complete(http, base, &format!("{b}q{j}")).await["usage"]["prompt_tokens"].as_u64().unwrap();
            }
        }
    }
    assert_ne!(la, lb);
    (la, lb)
}

/// Starts the fleet with `policy` and runs the interleaved requests: the fleet, the two prompt
/// lengths, and what each replica served (requests of prefix A, B).
async fn route(http: &reqwest::Client, policy: &str) -> (Fleet, (u64, u64), [(u64, u64); 2]) {
    let fleet = Fleet::start(policy);
    let (la, lb) = run_interleaved(http, &fleet.url()).await;
    let s1 = served(http, fleet.replicas[0].0, la, lb).await;
    let s2 = served(http, fleet.replicas[1].0, la, lb).await;
    eprintln!("{policy}: replica 1 served {s1:?}, replica 2 {s2:?} (requests of prefix A, B)");
    (fleet, (la, lb), [s1, s2])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_routing_keeps_prefixes_together_and_survives_a_lost_replica() {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let (fleet, (la, lb), [s1, s2]) = route(&http, "cache_aware").await;
    assert_eq!((s1.0 + s2.0, s1.1 + s2.1), (6, 6));
    assert!(s1.0 == 0 || s2.0 == 0, "prefix A went to both replicas: {s1:?} {s2:?}");
    assert!(s1.1 == 0 || s2.1 == 0, "prefix B went to both replicas: {s1:?} {s2:?}");

    // The replica that served the prefixes stopped mid-run: every request still succeeds (the
    // router retries on the other, which serves the rest).
    let (victim, keep, kept) = if s1.0 + s1.1 >= s2.0 + s2.1 { (0, 1, s2) } else { (1, 0, s1) };
    let (a, b) = prefixes();
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (http, url) = (http.clone(), fleet.url());
        let p = format!("{}q{}", if i % 2 == 0 { &a } else { &b }, i % 10);
        tasks.push(tokio::spawn(async move { complete(&http, &url, &p).await }));
        if i == 3 {
            let (port, pid) = fleet.replicas[victim];
            assert!(Command::new("kill").arg("-9").arg(pid.to_string()).status().unwrap().success());
            eprintln!("stopped the replica on port {port}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for t in tasks {
        let v = t.await.unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    }
    // The 8 requests sent after the stop were all served by the remaining replica.
    let after = served(&http, fleet.replicas[keep].0, la, lb).await;
    eprintln!("the remaining replica served {after:?} (before: {kept:?})");
    assert!(after.0 + after.1 >= kept.0 + kept.1 + 8, "before {kept:?}, after {after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_spreads_each_prefix() {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let (_fleet, _, [s1, s2]) = route(&http, "round_robin").await;
    assert_eq!((s1.0 + s2.0, s1.1 + s2.1), (6, 6));
    assert!(s1.0 > 0 && s2.0 > 0 && s1.1 > 0 && s2.1 > 0, "{s1:?} {s2:?}");
}
