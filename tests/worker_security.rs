//! `torus-wgpu worker` against clients it must refuse: calls without the worker token or with
//! a wrong one, steps whose slots, blocks, positions or sequence indices leave the worker's
//! cache, a message larger than the step budget allows, a well-formed step from a second
//! scheduler. Each is refused with its own status, and the real scheduler's next request,
//! which reuses the cached prefix the rogue steps aimed at, still gives the single-device
//! tokens. Also: the pipeline over TLS with client certificates matches the single device, and
//! a plaintext or unknown client of a TLS worker fails cleanly.

mod common;
use common::{greedy_req, spawn_until_ready, tiny};

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};
use torus_wgpu::config::{EngineConfig, Secret, StageConfig};
use torus_wgpu::engine::{load_model, load_tokenizer, EngineHandle, FinishReason, Request};
use torus_wgpu::exec::proto::{self, stage_client::StageClient};
use torus_wgpu::exec::remote::{self, Link, MessageLimits};
use torus_wgpu::exec::{self as pipeline, Pipeline};
use torus_wgpu::gpu::Gpu;

const TOKEN: &str = "test-worker-token-0123456789abcdef";

fn base_cfg(path: &Path) -> EngineConfig {
    EngineConfig {
        model: Some(path.display().to_string()),
        max_num_batched_tokens: 128,
        max_sequence_length: 256,
        total_cache_size: 16 << 20,
        max_decode_batch_size: 8,
        max_prefill_batch_size: 4,
        ..Default::default()
    }
}

/// `cfg` as a pipeline of stages: (layer range, worker address or None for this process).
fn pipeline_cfg(cfg: &EngineConfig, stages: &[(usize, usize, Option<&str>)]) -> EngineConfig {
    EngineConfig {
        enable_pipeline_parallel: true,
        world_size: stages.len(),
        stages: stages
            .iter()
            .map(|&(a, b, addr)| StageConfig {
                address: addr.map(str::to_string),
                stage_start_layer: Some(a),
                stage_end_layer: Some(b),
                ..Default::default()
            })
            .collect(),
        ..cfg.clone()
    }
}

fn build(cfg: &EngineConfig) -> anyhow::Result<Pipeline> {
    let path = PathBuf::from(cfg.model.clone().unwrap());
    pipeline::build(cfg, &path, &|_, _| {}, &|_| {})
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("torus-ws-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A `torus-wgpu worker` process, killed when dropped.
struct WorkerProc(Child);

impl WorkerProc {
    /// Serves `layers` of `cfg` on `addr`; `env_token` is passed as TORUS_WORKER_TOKEN.
    fn start(cfg: &EngineConfig, layers: (usize, usize), addr: &str, env_token: Option<&str>) -> WorkerProc {
        let file = temp_dir("cfg").join(format!("worker-{}.json", addr.replace([':', '.'], "_")));
        let w = EngineConfig {
            enable_pipeline_parallel: true,
            world_size: 2,
            pipeline_rank: usize::from(layers.0 > 0),
            stage_start_layer: Some(layers.0),
            stage_end_layer: Some(layers.1),
            ..cfg.clone()
        };
        std::fs::write(&file, serde_json::to_string_pretty(&w).unwrap()).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
        cmd.args(["worker", "--config", file.to_str().unwrap(), "--listen", addr]);
        match env_token {
            Some(t) => cmd.env("TORUS_WORKER_TOKEN", t),
            None => cmd.env_remove("TORUS_WORKER_TOKEN"),
        };
        let (child, _, _) = spawn_until_ready(&mut cmd, "worker", "ready on", Duration::from_secs(300));
        WorkerProc(child)
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn single_engine_outputs(path: &Path, cfg: &EngineConfig, reqs: &[Request]) -> Vec<Vec<u32>> {
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let (m, tok) = load_model(path, cfg, gpu, &|_, _| {}).unwrap();
    let e = EngineHandle::start(m, tok, cfg);
    let out = reqs.iter().map(|r| e.submit(r.clone()).unwrap().collect_blocking().ids).collect();
    e.shutdown(false);
    out
}

/// Collects a request's output on a thread, failing the test if it takes longer than `limit`.
fn collect_within(e: &EngineHandle, req: Request, limit: Duration) -> torus_wgpu::engine::Completion {
    let s = e.submit(req).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(s.collect_blocking());
    });
    rx.recv_timeout(limit).expect("the request hung")
}

/// Two prompts sharing a 48-token prefix (three full blocks), with distinct tails.
fn shared_prefix_prompts(path: &Path) -> (Vec<u32>, Vec<u32>) {
    let tok = load_tokenizer(path).unwrap();
    let text = "Once upon a time, in a small village by the sea, there lived an old fisherman who";
    let base: Vec<u32> = tok.encode(text).unwrap().into_iter().cycle().take(48).collect();
    let mut a = base.clone();
    a.extend(tok.encode(" sailed every morning").unwrap());
    let mut b = base;
    b.extend(tok.encode(" mended nets at night").unwrap());
    (a, b)
}

/// A raw client of the worker at `addr` that sends messages of any size.
fn rogue(rt: &tokio::runtime::Runtime, addr: &str) -> StageClient<tonic::transport::Channel> {
    let _g = rt.enter();
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect_lazy();
    StageClient::new(ch).max_encoding_message_size(usize::MAX).max_decoding_message_size(64 << 20)
}

fn with_token<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r.set_timeout(Duration::from_secs(60));
    r
}

/// A well-formed step for the last stage of tiny-qwen2: `n` tokens at positions 0.. of one
/// sequence whose table is blocks 0.., with hidden states of large values (garbage K/V, were
/// it ever written).
fn rogue_step(n: usize, hidden: usize, bs: u32) -> proto::StepRequest {
    let positions: Vec<u32> = (0..n as u32).collect();
    let blocks = (n as u32).div_ceil(bs);
    let data: Vec<f32> = (0..n * hidden).map(|i| if i % 2 == 0 { 1e4 } else { -3e4 }).collect();
    proto::StepRequest {
        instance: 0,
        session: 0x5eed,
        tokens: vec![1; n],
        slots: positions.clone(),
        positions,
        seq_of_token: vec![0; n],
        block_tables: vec![proto::BlockTable { blocks: (0..blocks).collect() }],
        sample_rows: vec![n as u32 - 1],
        sampling: vec![proto::SampleParams { top_p: 1.0, repetition_penalty: 1.0, ..Default::default() }],
        hidden: Some(proto::Tensor {
            shape: vec![n as u64, hidden as u64],
            dtype: "f32".into(),
            data: bytemuck::cast_slice(&data).to_vec().into(),
        }),
        want_logits: false,
        state_slots: vec![],
    }
}

#[test]
fn rogue_calls_are_refused_and_the_cache_is_unchanged() {
    let path = tiny();
    let cfg = base_cfg(&path);
    let mcfg = torus_wgpu::model::loader::read_config(&path).unwrap();
    let (hidden, bs) = (mcfg.hidden, cfg.block_size as u32);
    let (pa, pb) = shared_prefix_prompts(&path);
    let reqs = [greedy_req(&pa, 12), greedy_req(&pb, 12)];
    let want = single_engine_outputs(&path, &cfg, &reqs);

    // Layer 0 here, layer 1 (and the sampler) in a worker whose token comes from the
    // environment; the scheduler's comes from its config.
    let addr = free_addr();
    let _w = WorkerProc::start(&cfg, (1, 2), &addr, Some(TOKEN));
    let mut pcfg = pipeline_cfg(&cfg, &[(0, 1, None), (1, 2, Some(&addr))]);
    pcfg.worker_token = Some(Secret(TOKEN.into()));
    assert!(pcfg.enable_prefix_cache);
    let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let limit = Duration::from_secs(120);
    assert_eq!(collect_within(&e, reqs[0].clone(), limit).ids, want[0], "before the rogue calls");
    let hits_before = e.metrics.snapshot().prefix_hits;

    let rt = tokio::runtime::Runtime::new().unwrap();
    let code = |r: Result<tonic::Response<proto::StepReply>, tonic::Status>| match r {
        Ok(_) => panic!("the worker accepted a rogue step"),
        Err(s) => (s.code(), s.message().to_string()),
    };
    let mut c = rogue(&rt, &addr);
    let good = rogue_step(64, hidden, bs);

    // No token, a wrong token, a token of another form: refused before anything else.
    for token in [None, Some("wrong-token"), Some("")] {
        let info = rt.block_on(c.info(with_token(proto::InfoRequest {}, token)));
        assert_eq!(info.err().map(|s| s.code()), Some(tonic::Code::Unauthenticated), "info with {token:?}");
        let (k, m) = code(rt.block_on(c.step(with_token(good.clone(), token))));
        assert_eq!(k, tonic::Code::Unauthenticated, "step with {token:?}: {m}");
    }
    let mut raw = tonic::Request::new(good.clone());
    raw.metadata_mut().insert("authorization", TOKEN.parse().unwrap());
    assert_eq!(rt.block_on(c.step(raw)).err().map(|s| s.code()), Some(tonic::Code::Unauthenticated));
    // With the token, Info answers.
    let info = rt.block_on(c.info(with_token(proto::InfoRequest {}, Some(TOKEN)))).unwrap().into_inner();
    let num_blocks = info.num_blocks;
    assert!(info.last && num_blocks > 8, "{info:?}");

    // With the token, steps that leave the worker's cache or budget: INVALID_ARGUMENT.
    let t = Some(TOKEN);
    type Edit = Box<dyn Fn(&mut proto::StepRequest)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "block id past the cache",
            Box::new(move |s| {
                s.block_tables[0].blocks[1] = num_blocks;
                for i in 16..32 {
                    s.slots[i] = num_blocks * bs + i as u32 % bs;
                }
            }),
            "outside the KV cache",
        ),
        ("slot past the cache", Box::new(move |s| s.slots[5] = num_blocks * bs + 5), "is not position 5's slot"),
        (
            "slot in a block its table does not name",
            Box::new(move |s| {
                // The sequence's table names high blocks; its slots point at blocks 0..
                // (where the scheduler's cached prefix lives).
                s.block_tables[0].blocks = (0..4).map(|b| num_blocks - 1 - b).collect();
            }),
            "is not position 0's slot",
        ),
        ("position past max_sequence_length", Box::new(|s| s.positions[63] = 256), "beyond max_sequence_length"),
        ("position outside its block table", Box::new(|s| s.positions[63] = 100), "outside its block table"),
        ("sequence index without a table", Box::new(|s| s.seq_of_token[10] = 1), "of a step with 1 sequences"),
        (
            "decreasing sequence indices",
            Box::new(|s| {
                s.block_tables.push(s.block_tables[0].clone());
                for i in 0..32 {
                    s.seq_of_token[i] = 1;
                }
            }),
            "must not decrease",
        ),
        ("sample row past the tokens", Box::new(|s| s.sample_rows[0] = 64), "sample row 64"),
        (
            "more tokens than the budget",
            Box::new(move |s| {
                *s = rogue_step(129, hidden, bs);
            }),
            "129 tokens",
        ),
        (
            "too many sequences",
            Box::new(|s| {
                s.block_tables = vec![s.block_tables[0].clone(); 100];
            }),
            "100 sequences",
        ),
        (
            "hidden states shorter than their shape",
            Box::new(|s| {
                let h = s.hidden.as_mut().unwrap();
                h.data = h.data.slice(..h.data.len() - 4);
            }),
            "hidden states of",
        ),
        ("no hidden states", Box::new(|s| s.hidden = None), "needs the previous stage's hidden states"),
        ("no session", Box::new(|s| s.session = 0), "no session"),
        (
            "logit adjustment outside the vocabulary",
            Box::new(|s| {
                s.sampling[0].adjust.push(proto::Adjust { id: 1 << 30, count: 1, in_prompt: false, bias: 0.0 });
            }),
            "logit adjustment",
        ),
        ("NaN temperature", Box::new(|s| s.sampling[0].temperature = f32::NAN), "finite"),
    ];
    for (what, edit, says) in &cases {
        let mut s = good.clone();
        edit(&mut s);
        let (k, m) = code(rt.block_on(c.step(with_token(s, t))));
        assert_eq!(k, tonic::Code::InvalidArgument, "{what}: {m}");
        assert!(m.contains(says), "{what}: {m:?} does not say {says:?}");
    }

    // A message larger than the step budget allows: refused by the transport (with or without
    // a token; without one it is refused before it is read).
    let lim = MessageLimits::new(hidden, mcfg.vocab, &pipeline::step_limits(&cfg, &mcfg));
    assert!(lim.request < 4 << 20 && lim.request > 128 * hidden * 4, "{lim:?}");
    // (Twice the limit: the worker's own budget may be a little larger than the config's.)
    let mut big = good.clone();
    big.hidden.as_mut().unwrap().data = vec![0u8; 2 * lim.request].into();
    let (k, m) = code(rt.block_on(c.step(with_token(big.clone(), t))));
    assert_eq!(k, tonic::Code::OutOfRange, "{m}");
    assert!(m.contains("too large"), "{m}");
    let (k, _) = code(rt.block_on(c.step(with_token(big, None))));
    assert_eq!(k, tonic::Code::Unauthenticated);

    // A well-formed step from another session while the scheduler owns the worker: ABORTED,
    // nothing written (it would overwrite blocks 0..3, the cached prefix).
    let (k, m) = code(rt.block_on(c.step(with_token(good.clone(), t))));
    assert_eq!(k, tonic::Code::Aborted, "{m}");
    assert!(m.contains("another scheduler"), "{m}");
    // Releasing the scheduler's worker takes its session, which a rogue does not know.
    let r = rt.block_on(c.release(with_token(proto::ReleaseRequest { session: 0x5eed }, t)));
    assert!(r.is_ok());
    assert_eq!(code(rt.block_on(c.step(with_token(good.clone(), t)))).0, tonic::Code::Aborted);

    // The scheduler's next requests reuse the cached prefix and still give the single-device
    // tokens; its worker was never reported down.
    assert_eq!(collect_within(&e, reqs[1].clone(), limit).ids, want[1], "after the rogue calls");
    assert_eq!(collect_within(&e, reqs[0].clone(), limit).ids, want[0], "after the rogue calls");
    let m = e.metrics.snapshot();
    assert!(m.prefix_hits >= hits_before + 2 * 3, "the cached prefix was not reused: {m:?}");
    assert_eq!(m.stage_failures, 0, "{m:?}");
    assert!(e.stages.clone().unwrap()[1].get().is_ok());
    e.shutdown(false);

    // Once the scheduler is gone it has released the worker: the next one is served at once.
    let e2 = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    assert_eq!(collect_within(&e2, reqs[1].clone(), limit).ids, want[1]);
    // A second scheduler while e2 owns the worker fails its request clearly.
    let e3 = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let c3 = collect_within(&e3, reqs[0].clone(), limit);
    assert!(
        matches!(&c3.reason, FinishReason::Error(m) if m.contains("stage 1") && m.contains("another scheduler")),
        "{:?}",
        c3.reason
    );
    assert_eq!(collect_within(&e2, reqs[0].clone(), limit).ids, want[0]);
    e3.shutdown(false);
    e2.shutdown(false);

    // A scheduler with a wrong token, or none, is refused naming the token.
    for token in [Some(Secret("not-the-token".into())), None] {
        let bad = EngineConfig { worker_token: token, ..pcfg.clone() };
        let e = EngineHandle::start(build(&bad).unwrap(), load_tokenizer(&path).unwrap(), &bad);
        let c = collect_within(&e, reqs[0].clone(), limit);
        assert!(matches!(&c.reason, FinishReason::Error(m) if m.contains("worker_token")), "{:?}", c.reason);
        e.shutdown(false);
    }
}

#[test]
fn an_idle_owner_is_taken_over_and_notices() {
    // worker_lease_s = 1: a second scheduler is refused while the first is active, takes the
    // worker over once it has idled, and the first then sees a new cache instance and
    // recomputes: both get the single-device tokens.
    let path = tiny();
    let cfg = EngineConfig { worker_lease_s: 1.0, ..base_cfg(&path) };
    let (pa, pb) = shared_prefix_prompts(&path);
    let reqs = [greedy_req(&pa, 8), greedy_req(&pb, 8)];
    let want = single_engine_outputs(&path, &cfg, &reqs);
    let addr = free_addr();
    let _w = WorkerProc::start(&cfg, (1, 2), &addr, None);
    let pcfg = pipeline_cfg(&cfg, &[(0, 1, None), (1, 2, Some(&addr))]);
    let limit = Duration::from_secs(120);
    let e1 = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    let e2 = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    assert_eq!(collect_within(&e1, reqs[0].clone(), limit).ids, want[0]);
    std::thread::sleep(Duration::from_millis(1500));
    // The takeover itself fails one step of e2, which recomputes.
    let t0 = Instant::now();
    let c = collect_within(&e2, reqs[1].clone(), limit);
    assert_eq!(c.ids, want[1], "{:?} after {:?}", c.reason, t0.elapsed());
    let failures = e1.metrics.snapshot().stage_failures;
    // e1's cache on the worker is gone: it notices the new instance and recomputes.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(collect_within(&e1, reqs[0].clone(), limit).ids, want[0]);
    let m = e1.metrics.snapshot();
    assert!(m.stage_failures > failures, "the takeover went unnoticed: {m:?}");
    e1.shutdown(false);
    e2.shutdown(false);
}

/// A CA, and a server and a client certificate it signed, as PEM files in `dir`.
fn make_certs(dir: &Path, ca_name: &str) -> (PathBuf, PathBuf, PathBuf, PathBuf, PathBuf) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name.push(DnType::CommonName, ca_name);
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let leaf = |cn: &str, names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
        let mut p = CertificateParams::new(names).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        p.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        (p.signed_by(&key, &issuer).unwrap().pem(), key.serialize_pem())
    };
    let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    let (server, server_key) = leaf("torus worker", names, ExtendedKeyUsagePurpose::ServerAuth);
    let (client, client_key) = leaf("torus scheduler", vec![], ExtendedKeyUsagePurpose::ClientAuth);
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    (
        write("ca.pem", &ca_cert.pem()),
        write("server.pem", &server),
        write("server.key", &server_key),
        write("client.pem", &client),
        write("client.key", &client_key),
    )
}

fn s(p: &Path) -> Option<String> {
    Some(p.display().to_string())
}

#[test]
fn tls_pipeline_matches_single_device_and_refuses_other_clients() {
    let path = tiny();
    let cfg = base_cfg(&path);
    let dir = temp_dir("tls");
    let (ca, cert, key, client, client_key) = make_certs(&dir, "torus test CA");
    let (other_ca, ..) = make_certs(&temp_dir("tls-other"), "another CA");
    let (pa, pb) = shared_prefix_prompts(&path);
    let reqs = [greedy_req(&pa, 10), greedy_req(&pb, 10)];
    let want = single_engine_outputs(&path, &cfg, &reqs);

    // Both workers: TLS with client certificates required, and a token.
    let wcfg = EngineConfig {
        tls_cert: s(&cert),
        tls_key: s(&key),
        tls_ca: s(&ca),
        worker_token: Some(Secret(TOKEN.into())),
        ..cfg.clone()
    };
    let (a0, a1) = (free_addr(), free_addr());
    let _w0 = WorkerProc::start(&wcfg, (0, 1), &a0, None);
    let _w1 = WorkerProc::start(&wcfg, (1, 2), &a1, None);
    let mut pcfg = pipeline_cfg(&cfg, &[(0, 1, Some(&a0)), (1, 2, Some(&a1))]);
    pcfg.tls_ca = s(&ca);
    pcfg.tls_cert = s(&client);
    pcfg.tls_key = s(&client_key);
    pcfg.worker_token = Some(Secret(TOKEN.into()));
    let limit = Duration::from_secs(120);
    let e = EngineHandle::start(build(&pcfg).unwrap(), load_tokenizer(&path).unwrap(), &pcfg);
    for (r, w) in reqs.iter().zip(&want) {
        assert_eq!(&collect_within(&e, r.clone(), limit).ids, w, "over TLS");
    }
    assert!(e.metrics.snapshot().prefix_hits > 0);
    // /health's probe reaches the workers the same way.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let link = Link::from_config(&pcfg).unwrap();
    let info = rt.block_on(remote::probe(&a1, &link, Duration::from_secs(10))).unwrap();
    assert!(info.last);
    e.shutdown(false);

    // Clients the workers refuse, each failing cleanly within the probe's timeout.
    let probe = |c: &EngineConfig| -> String {
        let link = Link::from_config(c).unwrap();
        let t0 = Instant::now();
        let r = rt.block_on(remote::probe(&a0, &link, Duration::from_secs(10)));
        assert!(t0.elapsed() < Duration::from_secs(20));
        format!("{:#}", r.expect_err("the worker answered"))
    };
    // Plaintext (the TLS server drops it; the client sees a reset or an HTTP/2 error).
    let plain = EngineConfig { tls_ca: None, tls_cert: None, tls_key: None, ..pcfg.clone() };
    let m = probe(&plain);
    assert!(!m.is_empty());
    // TLS without a client certificate.
    let m = probe(&EngineConfig { tls_cert: None, tls_key: None, ..pcfg.clone() });
    assert!(!m.is_empty());
    // A client that does not trust the workers' CA.
    let m = probe(&EngineConfig { tls_ca: s(&other_ca), ..pcfg.clone() });
    assert!(!m.is_empty());
    // The right TLS but no token.
    let m = probe(&EngineConfig { worker_token: None, ..pcfg.clone() });
    assert!(m.contains("worker_token"), "{m}");
    // A plaintext scheduler's request fails naming the stage, without hanging.
    let e = EngineHandle::start(build(&plain).unwrap(), load_tokenizer(&path).unwrap(), &plain);
    let c = collect_within(&e, reqs[0].clone(), limit);
    assert!(matches!(&c.reason, FinishReason::Error(m) if m.contains("stage 0")), "{:?}", c.reason);
    e.shutdown(false);
}

#[test]
fn worker_start_up_refuses_unsafe_settings() {
    let path = tiny();
    let run = |args: &[&str], token: Option<&str>| -> (bool, String) {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
        cmd.args(["worker", "--model", path.to_str().unwrap()]).args(args);
        match token {
            Some(t) => cmd.env("TORUS_WORKER_TOKEN", t),
            None => cmd.env_remove("TORUS_WORKER_TOKEN"),
        };
        let out = cmd.output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // No token on a non-loopback address: refused before loading anything.
    let (ok, err) = run(&["--listen", "0.0.0.0:0"], None);
    assert!(!ok && err.contains("refusing to serve") && err.contains("--insecure"), "{err}");
    // A client CA without a server certificate.
    let ca = temp_dir("tls-bad").join("ca.pem");
    std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n").unwrap();
    let (ok, err) = run(&["--listen", "127.0.0.1:0", "--tls-ca", ca.to_str().unwrap()], Some(TOKEN));
    assert!(!ok && err.contains("tls_ca on a worker requires"), "{err}");
    // A certificate file that is not PEM.
    let junk = temp_dir("tls-bad").join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let j = junk.to_str().unwrap();
    let (ok, err) = run(&["--listen", "127.0.0.1:0", "--tls-cert", j, "--tls-key", j], Some(TOKEN));
    assert!(!ok && err.contains("not a PEM file"), "{err}");
    // A token that cannot travel as a header value.
    let (ok, err) = run(&["--listen", "127.0.0.1:0"], Some("two words"));
    assert!(!ok && err.contains("worker_token"), "{err}");
    // The token never shows in a config's debug form.
    let c = EngineConfig { worker_token: Some(Secret(TOKEN.into())), ..Default::default() };
    assert!(!format!("{c:?}").contains(TOKEN));
}

#[test]
fn in_process_steps_are_checked_before_anything_is_written() {
    // The same checks guard a model in this process: a bad step is an error, and the
    // sequence's next correct step gives the single-device tokens.
    use torus_wgpu::model::StepInput;
    use torus_wgpu::sampling::SampleParams;
    let path = tiny();
    let cfg = base_cfg(&path);
    let gpu = Arc::new(Gpu::new(None).unwrap());
    let (mut m, _) = load_model(&path, &cfg, gpu, &|_, _| {}).unwrap();
    let (pa, _) = shared_prefix_prompts(&path);
    let n = pa.len() as u32;
    let step = |tokens: Vec<u32>, start: u32| StepInput {
        positions: (start..start + tokens.len() as u32).collect(),
        slots: (start..start + tokens.len() as u32).collect(),
        seq_of_token: vec![0; tokens.len()],
        block_tables: vec![(0..8).collect()],
        sample_rows: vec![tokens.len() as u32 - 1],
        sampling: vec![SampleParams::default()],
        tokens,
        state_slots: Vec::new(),
    };
    let first = m.step(&step(pa.clone(), 0)).unwrap()[0].id;
    let second = m.step(&step(vec![first], n)).unwrap()[0].id;
    // Again, with bad steps (all aimed at the prompt's blocks) between prefill and decode.
    let bounds = m.bounds();
    m.step(&step(pa.clone(), 0)).unwrap();
    let mut bad = step(vec![7; 16], 0);
    bad.block_tables[0][0] = bounds.num_blocks as u32;
    assert!(format!("{:#}", m.step(&bad).unwrap_err()).contains("outside the KV cache"));
    let mut bad = step(vec![7; 16], 0);
    bad.block_tables = vec![vec![5]];
    assert!(format!("{:#}", m.step(&bad).unwrap_err()).contains("is not position 0's slot"));
    let mut bad = step(vec![7; 16], 0);
    bad.tokens[3] = bounds.vocab as u32;
    assert!(format!("{:#}", m.step(&bad).unwrap_err()).contains("outside the vocabulary"));
    assert_eq!(m.step(&step(vec![first], n)).unwrap()[0].id, second);
}
