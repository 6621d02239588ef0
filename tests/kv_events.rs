//! KV-cache events (`kv_events_endpoint`): an engine on the tiny model with a small KV pool and
//! the prefix cache publishes vLLM's ZeroMQ/msgpack events; an independent subscriber (Python
//! pyzmq + msgpack + msgspec, tests/kv_events_sub.py; scripts/setup.sh installs them) decodes
//! them (msgspec with structs of vLLM's shape re-encodes each payload to the same bytes). The
//! set of cached blocks rebuilt from the events equals the block manager's, after prefix hits
//! and LRU evictions and again after the prefix cache is dropped; every published hash is the
//! first 8 bytes of the block's SHA-256 chain key, recomputed here from the event's parent and
//! token ids.

mod common;
use common::{greedy_req, tiny};

use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::engine::{load_model, EngineHandle, FinishReason, Request};
use torus_wgpu::exec::{Fault, FaultInjector};
use torus_wgpu::gpu::Gpu;
use torus_wgpu::kv::{block_key, external_hash, root_key, BlockKey};

const BLOCK: usize = 4;

fn prompts(n: usize, seed: u64) -> Vec<Vec<u32>> {
    // A 3-block shared prefix, then 9 tokens of each prompt's own.
    let mut rng = torus_wgpu::sampling::Rng::new(seed);
    let mut draw = |k: usize| -> Vec<u32> { (0..k).map(|_| (rng.next_u64() % 500) as u32).collect() };
    let prefix = draw(12);
    (0..n).map(|_| [prefix.clone(), draw(9)].concat()).collect()
}

fn run_alone(e: &EngineHandle, reqs: &[Request]) {
    for r in reqs {
        let c = e.submit(r.clone()).unwrap().collect_blocking();
        assert_eq!(c.reason, FinishReason::Length, "{c:?}");
    }
}

fn run_together(e: &EngineHandle, reqs: &[Request]) {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    for s in streams {
        let c = s.collect_blocking();
        assert_eq!(c.reason, FinishReason::Length, "{c:?}");
    }
}

/// Replays decoded batches: the cached set they describe, with checks of every event.
struct Replay {
    cached: HashSet<u64>,
    /// Every hash ever stored, with the full key recomputed from its parent and tokens.
    keys: HashMap<u64, BlockKey>,
    stored: usize,
    removed: usize,
    cleared: usize,
}

impl Replay {
    fn new() -> Replay {
        Replay { cached: HashSet::new(), keys: HashMap::new(), stored: 0, removed: 0, cleared: 0 }
    }

    fn u64s(v: &Value, what: &str) -> Vec<u64> {
        v.as_array()
            .unwrap_or_else(|| panic!("{what}: not an array: {v}"))
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    }

    fn apply(&mut self, payload: &Value) {
        let batch = payload.as_array().expect("the payload is an array (array-like EventBatch)");
        assert_eq!(batch.len(), 3, "[ts, events, data_parallel_rank]: {payload}");
        let ts = batch[0].as_f64().expect("ts is a float");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        assert!((now - 600.0..=now + 1.0).contains(&ts), "ts {ts} is Unix seconds");
        assert_eq!(batch[2], 0, "data_parallel_rank");
        let events = batch[1].as_array().expect("events is an array");
        assert!(!events.is_empty(), "only non-empty batches are published");
        for ev in events {
            let a = ev.as_array().unwrap_or_else(|| panic!("an event is a tagged array: {ev}"));
            match a[0].as_str() {
                Some("BlockStored") => {
                    assert_eq!(a.len(), 8, "{ev}");
                    let hashes = Self::u64s(&a[1], "block_hashes");
                    let tokens = Self::u64s(&a[3], "token_ids");
                    assert_eq!(a[4].as_u64(), Some(BLOCK as u64), "block_size: {ev}");
                    assert_eq!(tokens.len(), hashes.len() * BLOCK, "token ids of whole blocks: {ev}");
                    assert!(a[5].is_null() && a[7].is_null(), "lora_id, lora_name: {ev}");
                    assert_eq!(a[6], "GPU", "medium: {ev}");
                    // The parent: nil for a sequence's first block, else a hash stored before.
                    let mut parent = match a[2].as_u64() {
                        None => {
                            assert!(a[2].is_null(), "{ev}");
                            root_key(None)
                        }
                        Some(p) => *self.keys.get(&p).unwrap_or_else(|| panic!("parent {p} was never stored: {ev}")),
                    };
                    for (h, toks) in hashes.iter().zip(tokens.chunks(BLOCK)) {
                        let toks: Vec<u32> = toks.iter().map(|&t| t as u32).collect();
                        let key = block_key(&parent, &toks);
                        assert_eq!(external_hash(&key), *h, "hash = first 8 bytes of the SHA-256 chain key: {ev}");
                        self.keys.insert(*h, key);
                        assert!(self.cached.insert(*h), "block {h} stored while cached: {ev}");
                        self.stored += 1;
                        parent = key;
                    }
                }
                Some("BlockRemoved") => {
                    assert_eq!(a.len(), 3, "{ev}");
                    assert_eq!(a[2], "GPU", "medium: {ev}");
                    for h in Self::u64s(&a[1], "block_hashes") {
                        assert!(self.cached.remove(&h), "block {h} removed but not cached: {ev}");
                        self.removed += 1;
                    }
                }
                Some("AllBlocksCleared") => {
                    assert_eq!(a.len(), 1, "{ev}");
                    self.cached.clear();
                    self.cleared += 1;
                }
                _ => panic!("unknown event {ev}"),
            }
        }
    }
}

/// tests/kv_events_sub.py with `args`; a missing python3, pyzmq, msgpack or msgspec fails the
/// test (run scripts/setup.sh).
fn subscriber(args: &[&str]) -> Child {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kv_events_sub.py");
    Command::new("python3")
        .arg(&script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3 tests/kv_events_sub.py (scripts/setup.sh installs pyzmq, msgpack, msgspec)")
}

/// Waits until the subscriber's subscription reached the publisher (a PUB socket drops
/// messages for nobody).
fn wait_subscribed(e: &EngineHandle, sub: &mut Child) {
    let t0 = Instant::now();
    while e.metrics.snapshot().kv_events_subscribers == 0 {
        if let Ok(Some(st)) = sub.try_wait() {
            let mut err = String::new();
            std::io::Read::read_to_string(sub.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("the subscriber exited ({st}) before subscribing (pip install pyzmq msgpack msgspec?): {err}");
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the subscription never reached the publisher");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn hashes(keys: &[BlockKey]) -> HashSet<u64> {
    keys.iter().map(external_hash).collect()
}

/// An engine on tiny-qwen2 with a 24-block pool (a 4-token block of K+V over 2 layers = 2 * 2
/// * 4 * 32 * 2 bytes (f16) = 1 KiB), the prefix cache, and events on a free loopback port.
fn publisher() -> (EngineHandle, EngineConfig) {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let cfg = EngineConfig {
        max_num_batched_tokens: 64,
        max_sequence_length: 256,
        total_cache_size: 24 * 1024,
        block_size: BLOCK,
        enable_prefix_cache: true,
        kv_events_endpoint: Some("tcp://127.0.0.1:0".into()),
        ..Default::default()
    };
    let (model, tok) = load_model(&tiny(), &cfg, gpu, &|_, _| {}).unwrap();
    (EngineHandle::try_start(FaultInjector::new(model), tok, &cfg).expect("bind the KV-events endpoint"), cfg)
}

#[test]
fn kv_events_rebuild_the_cached_set() {
    let (e, cfg) = publisher();
    assert_eq!(e.info.num_blocks, 24);
    let addr = e.info.kv_events_addr.expect("the bound address");

    let mut sub = subscriber(&[&format!("tcp://{addr}")]);
    wait_subscribed(&e, &mut sub);
    assert_eq!(e.metrics.snapshot().kv_event_batches_published, 0, "nothing published before the requests");

    // Phase 1: prompts sharing a prefix, alone (prefix hits), then together (more blocks than
    // the pool: evictions, preemptions).
    let reqs: Vec<Request> = prompts(10, 1).iter().map(|p| greedy_req(p, 6)).collect();
    run_alone(&e, &reqs[..6]);
    let m = e.metrics.snapshot();
    assert!(m.prefix_hits >= 15, "the shared prefix hits: {m:?}");
    run_together(&e, &reqs[4..]);
    let (keys1, batches1) = e.cached_blocks().expect("the engine runs");
    assert!(!keys1.is_empty());

    // Phase 2: a step whose result cannot be trusted drops the prefix cache; then more requests.
    e.inject_fault(Fault::StepIdMismatch);
    let failed = e.submit(greedy_req(&prompts(1, 2)[0], 6)).unwrap().collect_blocking();
    assert!(matches!(failed.reason, FinishReason::Error(_)), "{failed:?}");
    let more: Vec<Request> = prompts(4, 3).iter().map(|p| greedy_req(p, 6)).collect();
    run_alone(&e, &more[..2]);
    run_together(&e, &more);
    let (keys2, batches2) = e.cached_blocks().expect("the engine runs");
    assert!(batches2 > batches1);

    // The subscriber gets the count and prints what it received.
    writeln!(sub.stdin.take().unwrap(), "{batches2}").unwrap();
    let out = sub.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the subscriber failed: {err}");
    let msgs: Vec<Value> = serde_json::from_slice(&out.stdout).expect("the subscriber's JSON");
    assert_eq!(msgs.len() as u64, batches2, "exactly the batches published, nothing more: {msgs:?}");

    let mut replay = Replay::new();
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m["frames"], 3, "topic, sequence number, payload: {m}");
        assert_eq!(m["topic"], "", "vLLM's default topic is empty");
        assert_eq!(m["seq_len"], 8, "an 8-byte sequence number");
        assert_eq!(m["seq"].as_u64(), Some(i as u64), "sequence numbers count from 0 by 1");
        assert_eq!(
            m["msgspec_roundtrip"], true,
            "msgspec decodes vLLM's event structs and re-encodes the same bytes: {err}"
        );
        replay.apply(&m["payload"]);
        if i as u64 + 1 == batches1 {
            assert_eq!(replay.cached, hashes(&keys1), "the cached set after phase 1");
            assert!(replay.removed > 0, "the small pool evicts cached blocks");
            assert_eq!(replay.cleared, 0);
        }
    }
    assert_eq!(replay.cleared, 1, "dropping the prefix cache publishes AllBlocksCleared");
    assert_eq!(replay.cached, hashes(&keys2), "the cached set at the end");
    let m = e.metrics.snapshot();
    assert_eq!(m.kv_event_batches_published, batches2);
    assert_eq!(
        m.kv_events_published as usize,
        msgs.iter().map(|m| m["payload"][1].as_array().unwrap().len()).sum::<usize>()
    );
    assert_eq!(m.kv_events_dropped, 0);
    eprintln!(
        "{} batches: {} blocks stored, {} removed, {} cleared; {} cached at the end",
        batches2,
        replay.stored,
        replay.removed,
        replay.cleared,
        keys2.len()
    );

    // /metrics reports the counters.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let text = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let scfg = torus_wgpu::server::ServerConfig::new("tiny", &cfg);
        let server = torus_wgpu::server::start(l, scfg, Some(e.clone())).unwrap();
        let url = format!("http://{}/metrics", server.addr);
        let text =
            reqwest::Client::builder().no_proxy().build().unwrap().get(url).send().await.unwrap().text().await.unwrap();
        server.shutdown().await;
        text
    });
    assert!(text.contains(&format!("torus_kv_events_published_total {}\n", m.kv_events_published)), "{text}");
    assert!(text.contains(&format!("torus_kv_event_batches_published_total {batches2}\n")), "{text}");
    assert!(text.contains("torus_kv_events_subscribers 0\n"), "the subscriber has gone: {text}");
}

/// Off by default: no endpoint, no address; a bad endpoint is refused by validation, and one
/// that cannot be bound by `try_start`.
#[test]
fn kv_events_endpoint_config() {
    assert_eq!(EngineConfig::default().kv_events_endpoint, None);
    let bad = EngineConfig { kv_events_endpoint: Some("ipc:///tmp/x".into()), ..Default::default() };
    assert!(bad.validate().unwrap_err().to_string().contains("tcp://HOST:PORT"));
    let cfg: EngineConfig = serde_json::from_str(r#"{"kv_events_endpoint": "tcp://*:5557"}"#).unwrap();
    assert_eq!(cfg.kv_events_endpoint.as_deref(), Some("tcp://*:5557"));
    cfg.validate().unwrap();

    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let cfg = EngineConfig {
        max_sequence_length: 64,
        total_cache_size: 1 << 20,
        kv_events_endpoint: Some(format!("tcp://{}", taken.local_addr().unwrap())),
        ..Default::default()
    };
    let (model, tok) = load_model(&tiny(), &cfg, gpu.clone(), &|_, _| {}).unwrap();
    let err = EngineHandle::try_start(model, tok, &cfg).err().expect("the port is taken");
    assert!(format!("{err:#}").contains("cannot bind"), "{err:#}");
    let off = EngineConfig { max_sequence_length: 64, total_cache_size: 1 << 20, ..Default::default() };
    let (model, tok) = load_model(&tiny(), &off, gpu, &|_, _| {}).unwrap();
    let e = EngineHandle::start(model, tok, &off);
    assert_eq!(e.info.kv_events_addr, None);
    assert_eq!(e.cached_blocks().unwrap().1, 0, "no events without an endpoint");
    e.shutdown(false);
}

/// llm-d's topology: the subscriber (its endpoint picker) binds, and each replica's PUB socket
/// connects to it with a topic naming the pod. The subscriber, bound first and subscribed to
/// the topic's prefix after the publisher started (which retries until it connects), receives
/// every batch with that topic and consecutive sequence numbers.
#[test]
fn kv_events_connect_to_a_bound_subscriber_with_a_topic() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let topic = "kv@10.1.2.3@tiny-qwen2";
    let cfg = EngineConfig {
        max_num_batched_tokens: 64,
        max_sequence_length: 256,
        total_cache_size: 24 * 1024,
        block_size: BLOCK,
        kv_events_endpoint: Some(endpoint.clone()),
        kv_events_topic: topic.into(),
        kv_events_connect: true,
        ..Default::default()
    };
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter"));
    let (model, tok) = load_model(&tiny(), &cfg, gpu, &|_, _| {}).unwrap();
    // The publisher first: its first attempts find nobody bound, and it retries.
    let e = EngineHandle::try_start(model, tok, &cfg).expect("start the publisher");
    std::thread::sleep(Duration::from_millis(300));
    let mut sub = subscriber(&[&endpoint, "--bind", "--topic", "kv@"]);
    wait_subscribed(&e, &mut sub);
    let reqs: Vec<Request> = prompts(4, 5).iter().map(|p| greedy_req(p, 6)).collect();
    run_alone(&e, &reqs);
    let (_, batches) = e.cached_blocks().expect("the engine runs");
    assert!(batches > 0);
    writeln!(sub.stdin.take().unwrap(), "{batches}").unwrap();
    let out = sub.wait_with_output().unwrap();
    assert!(out.status.success(), "the subscriber failed: {}", String::from_utf8_lossy(&out.stderr));
    let msgs: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(msgs.len() as u64, batches, "{msgs:?}");
    let hex: String = topic.bytes().map(|b| format!("{b:02x}")).collect();
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m["frames"], 3);
        assert_eq!(m["topic"], hex.as_str());
        assert_eq!(m["seq"].as_u64(), Some(i as u64));
        assert_eq!(m["msgspec_roundtrip"], true);
    }
    e.shutdown(false);
    // Without an endpoint, a topic or connect is a config error.
    let bad = EngineConfig { kv_events_connect: true, ..Default::default() };
    assert!(bad.validate().unwrap_err().to_string().contains("need kv_events_endpoint"));
}

/// This process's thread count.
/// The publishers' threads (named torus-kv-events*; /proc keeps 15 bytes of a name): the tests
/// of this file run in parallel, and their engines and devices start threads of their own.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("torus-kv-events"))
        .count()
}

/// The ZMTP 3.0 greeting of a NULL-security client.
fn zmtp_greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A command frame (short form).
fn zmtp_command(name: &str, data: &[u8]) -> Vec<u8> {
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    let mut out = if body.len() > 255 {
        let mut o = vec![4 | 2];
        o.extend_from_slice(&(body.len() as u64).to_be_bytes());
        o
    } else {
        vec![4, body.len() as u8]
    };
    out.extend_from_slice(&body);
    out
}

/// A subscriber that did the whole handshake (greeting, READY as SUB).
fn zmtp_sub(addr: std::net::SocketAddr) -> std::net::TcpStream {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&zmtp_greeting()).unwrap();
    let mut g = [0u8; 64];
    s.read_exact(&mut g).unwrap();
    let mut props = vec![11u8];
    props.extend_from_slice(b"Socket-Type");
    props.extend_from_slice(&3u32.to_be_bytes());
    props.extend_from_slice(b"SUB");
    s.write_all(&zmtp_command("READY", &props)).unwrap();
    let mut h = [0u8; 2];
    s.read_exact(&mut h).unwrap();
    let mut ready = vec![0u8; h[1] as usize];
    s.read_exact(&mut ready).unwrap();
    assert_eq!(&ready[1..6], b"READY");
    s
}

/// Reads until the peer closes (Ok) or `limit` passes (Err); the bytes read.
fn until_closed(s: &mut std::net::TcpStream, limit: Duration) -> Result<Vec<u8>, Vec<u8>> {
    use std::io::Read;
    let t = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    while t.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return Ok(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return Ok(got),
        }
    }
    Err(got)
}

/// Hostile subscribers stay within the publisher's caps (connections, threads, handshake time,
/// subscriptions), and a request with a `cache_salt` is published by block hash only: its
/// token ids (its prompt) never reach a subscriber.
#[test]
fn kv_events_hostile_peers_and_salted_prompts() {
    use torus_wgpu::kv_events::{MAX_SUBSCRIBERS, MAX_SUBSCRIPTIONS};
    let (e, _) = publisher();
    let addr = e.info.kv_events_addr.unwrap();
    let threads0 = threads();

    // 1. Many silent peers: MAX_SUBSCRIBERS are taken (they get the greeting), the others
    // closed at once; the silent ones are dropped at the handshake deadline (5 s).
    let mut peers: Vec<std::net::TcpStream> =
        (0..MAX_SUBSCRIBERS + 36).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(500));
    let most = threads();
    assert!(most <= threads0 + MAX_SUBSCRIBERS + 4, "{threads0} threads before, {most} with the silent peers");
    let t = Instant::now();
    let (mut greeted, mut closed_at_once) = (0, 0);
    for p in &mut peers {
        match until_closed(p, Duration::from_secs(12)) {
            Ok(got) if got.is_empty() => closed_at_once += 1,
            Ok(got) => {
                assert_eq!(got.len(), 64, "the greeting, then closed");
                greeted += 1;
            }
            Err(got) => panic!("a silent peer was kept past the handshake deadline ({} bytes)", got.len()),
        }
    }
    assert_eq!(greeted, MAX_SUBSCRIBERS, "{closed_at_once} closed at once");
    assert_eq!(closed_at_once, 36);
    assert!(t.elapsed() < Duration::from_secs(12), "{:?}", t.elapsed());
    drop(peers);

    // 2. A peer that sends its greeting one byte at a time, slowly: dropped at the deadline.
    let mut slow = std::net::TcpStream::connect(addr).unwrap();
    let t = Instant::now();
    let g = zmtp_greeting();
    let mut i = 0;
    let dropped = loop {
        if slow.write_all(&g[i..i + 1]).is_err() {
            break true;
        }
        i += 1;
        if i == 60 {
            break false;
        }
        if let Ok(got) = until_closed(&mut slow, Duration::from_millis(900)) {
            let _ = got;
            break true;
        }
    };
    assert!(dropped, "a slow handshake was never dropped");
    assert!(t.elapsed() < Duration::from_secs(9), "dropped after {:?}", t.elapsed());

    // 3. Too many subscriptions, or too many bytes of them: disconnected.
    for (n, size) in [(MAX_SUBSCRIPTIONS + 1, 8), (20, 1000)] {
        let mut s = zmtp_sub(addr);
        for k in 0..n {
            let topic = format!("{k:0size$}");
            if s.write_all(&zmtp_command("SUBSCRIBE", topic.as_bytes())).is_err() {
                break;
            }
        }
        assert!(until_closed(&mut s, Duration::from_secs(10)).is_ok(), "{n} subscriptions of {size} bytes were kept");
    }
    let t = Instant::now();
    while threads() > threads0 + 2 {
        assert!(t.elapsed() < Duration::from_secs(30), "{} threads left ({threads0} before)", threads());
        std::thread::sleep(Duration::from_millis(50));
    }

    // 4. A salted and an unsalted request: an honest subscriber sees the unsalted one's tokens
    // and only the salted one's hashes.
    let mut sub = subscriber(&[&format!("tcp://{addr}")]);
    wait_subscribed(&e, &mut sub);
    let p = prompts(2, 9);
    let mut salted = greedy_req(&p[0], 6);
    salted.params.cache_salt = Some("tenant-a".into());
    run_alone(&e, &[salted, greedy_req(&p[1], 6)]);
    let (_, batches) = e.cached_blocks().expect("the engine runs");
    writeln!(sub.stdin.take().unwrap(), "{batches}").unwrap();
    let out = sub.wait_with_output().unwrap();
    assert!(out.status.success(), "the subscriber failed: {}", String::from_utf8_lossy(&out.stderr));
    let msgs: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let stored: Vec<&Value> =
        msgs.iter().flat_map(|m| m["payload"][1].as_array().unwrap()).filter(|ev| ev[0] == "BlockStored").collect();
    let salted_root = root_key(Some("tenant-a"));
    let first_salted = external_hash(&block_key(&salted_root, &p[0][..BLOCK]));
    let first_plain = external_hash(&block_key(&root_key(None), &p[1][..BLOCK]));
    let with_hash = |h: u64| stored.iter().find(|ev| ev[1].as_array().unwrap().iter().any(|x| x.as_u64() == Some(h)));
    let s_ev = with_hash(first_salted).expect("the salted request's blocks are published");
    assert_eq!(s_ev[3], json!([]), "no token ids for a salted request: {s_ev}");
    let p_ev = with_hash(first_plain).expect("the plain request's blocks are published");
    assert_eq!(p_ev[3].as_array().unwrap().len(), p_ev[1].as_array().unwrap().len() * BLOCK, "{p_ev}");
    let all_tokens: Vec<u64> =
        stored.iter().flat_map(|ev| ev[3].as_array().unwrap().iter().map(|x| x.as_u64().unwrap())).collect();
    let salted_tail: Vec<u64> = p[0][12..].iter().map(|&t| t as u64).collect();
    assert!(
        !all_tokens.windows(salted_tail.len()).any(|w| w == salted_tail),
        "the salted prompt's own tokens were published"
    );
    e.shutdown(false);
}
