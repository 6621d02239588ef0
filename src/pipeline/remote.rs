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

use super::proto::{self, stage_client::StageClient, stage_server};
use super::{StageExec, StageFailure};
use crate::config::EngineConfig;
use crate::model::forward::{
    Adjust, Model, SampleParams, Sampled, StageOutput, StepBounds, StepInput, StepLimits, MAX_LOGIT_BIAS,
};
use anyhow::{anyhow, bail, Context, Result};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

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
        use crate::gpu::kernels::MAX_TOP_LOGPROBS;
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

/// How a scheduler reaches its workers: the token it sends and its TLS settings.
#[derive(Clone, Default)]
pub struct Link {
    token: Option<AsciiMetadataValue>,
    tls: Option<ClientTlsConfig>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Link {{ token: {}, tls: {} }}", self.token.is_some(), self.tls.is_some())
    }
}

fn read_pem(path: &str, key: &str) -> Result<Vec<u8>> {
    let b = std::fs::read(path).with_context(|| format!("{key}: cannot read {path}"))?;
    if !b.windows(11).any(|w| w == b"-----BEGIN ") {
        bail!("{key}: {path} is not a PEM file");
    }
    Ok(b)
}

/// `Bearer <token>` as a header value that is never logged or indexed by HPACK.
fn bearer(token: &str) -> Result<AsciiMetadataValue> {
    let mut v: AsciiMetadataValue =
        format!("Bearer {token}").parse().map_err(|_| anyhow!("worker_token must be printable ASCII"))?;
    v.set_sensitive(true);
    Ok(v)
}

impl Link {
    /// The token and TLS settings of a scheduler config (PEM files are read now).
    pub fn from_config(cfg: &EngineConfig) -> Result<Link> {
        let token = cfg.worker_token.as_ref().map(|t| bearer(t.expose())).transpose()?;
        let tls = match &cfg.tls_ca {
            None if cfg.tls_cert.is_some() => {
                bail!("tls_cert/tls_key are the scheduler's client certificate for workers over TLS: give tls_ca too")
            }
            None => None,
            Some(ca) => {
                let mut t = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read_pem(ca, "tls_ca")?));
                if let (Some(c), Some(k)) = (&cfg.tls_cert, &cfg.tls_key) {
                    t = t.identity(Identity::from_pem(read_pem(c, "tls_cert")?, read_pem(k, "tls_key")?));
                }
                if let Some(d) = &cfg.tls_domain {
                    t = t.domain_name(d.clone());
                }
                Some(t)
            }
        };
        Ok(Link { token, tls })
    }

    /// The endpoint of the worker at `addr` (https with TLS), not yet connected.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| anyhow!("bad worker address {addr:?}: {e}"))?;
        if let Some(t) = &self.tls {
            ep = ep.tls_config(t.clone()).map_err(|e| anyhow!("TLS settings for {addr}: {e}"))?;
        }
        Ok(ep)
    }

    /// A client over `channel` that sends the token with every call.
    pub fn client(&self, channel: Channel) -> Client {
        StageClient::with_interceptor(channel, SendToken(self.token.clone()))
    }
}

/// Adds the worker token to every call.
#[derive(Clone)]
pub struct SendToken(Option<AsciiMetadataValue>);

impl tonic::service::Interceptor for SendToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A stage client that sends the worker token.
pub type Client = StageClient<InterceptedService<Channel, SendToken>>;

/// One stage served by a worker process.
pub struct RemoteStage {
    addr: String,
    want: Expect,
    rt: tokio::runtime::Runtime,
    ep: Endpoint,
    link: Link,
    limits: MessageLimits,
    client: Client,
    /// The worker instance whose KV cache the block tables describe (0 = connect and adopt).
    instance: u64,
    /// This scheduler stage's session: the worker serves one at a time.
    session: u64,
}

fn status_text(s: &tonic::Status) -> String {
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
fn random_id() -> u64 {
    crate::sampling::Rng::from_entropy().next_u64() | 1
}

impl RemoteStage {
    /// Does not connect: a worker that is down now is reached at the first step it is needed.
    pub fn new(addr: &str, want: Expect, link: Link) -> Result<RemoteStage> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let ep = link
            .endpoint(addr)
            .map_err(|e| anyhow!("stage {}: {e:#}", want.stage))?
            .connect_timeout(Duration::from_secs(3))
            .timeout(want.timeout);
        let limits = MessageLimits::new(want.hidden, want.vocab, &want.limits);
        let client = Self::client_for(&rt, &ep, &link, limits);
        Ok(RemoteStage {
            addr: addr.to_string(),
            want,
            rt,
            ep,
            link,
            limits,
            client,
            instance: 0,
            session: random_id(),
        })
    }

    fn client_for(rt: &tokio::runtime::Runtime, ep: &Endpoint, link: &Link, limits: MessageLimits) -> Client {
        let channel = {
            let _g = rt.enter();
            ep.connect_lazy()
        };
        link.client(channel).max_decoding_message_size(limits.reply).max_encoding_message_size(limits.request)
    }

    fn new_client(&self) -> Client {
        Self::client_for(&self.rt, &self.ep, &self.link, self.limits)
    }

    fn fail(&mut self, restarted: bool, message: String) -> anyhow::Error {
        self.instance = 0;
        StageFailure { stage: self.want.stage, name: format!("worker {}", self.addr), restarted, message }.into()
    }

    fn connect(&mut self) -> Result<()> {
        let mut c = self.client.clone();
        let info = match self.rt.block_on(c.info(proto::InfoRequest {})) {
            Ok(r) => r.into_inner(),
            Err(s) => return Err(self.fail(false, status_text(&s))),
        };
        if let Err(e) = self.want.check(&info) {
            return Err(self.fail(false, format!("{e:#}")));
        }
        self.instance = info.instance;
        Ok(())
    }
}

impl Drop for RemoteStage {
    /// Releases the worker for the next scheduler (best effort, briefly).
    fn drop(&mut self) {
        if self.instance == 0 {
            return;
        }
        let mut c = self.client.clone();
        let release = c.release(proto::ReleaseRequest { session: self.session });
        let _ = self.rt.block_on(async { tokio::time::timeout(Duration::from_secs(2), release).await });
    }
}

impl StageExec for RemoteStage {
    fn run(
        &mut self,
        s: &StepInput,
        hidden: Option<Vec<u8>>,
        want_logits: bool,
    ) -> Result<(StageOutput, Option<Vec<f32>>)> {
        if self.instance == 0 {
            self.connect()?;
        }
        let n = s.tokens.len();
        let mut req = step_request(s, self.instance, hidden.map(|h| tensor(vec![n, self.want.hidden], h)), want_logits);
        req.session = self.session;
        let mut c = self.client.clone();
        let mut r = self.rt.block_on(c.step(req.clone()));
        if matches!(&r, Err(st) if matches!(st.code(), tonic::Code::Unavailable | tonic::Code::Unknown)) {
            // A connection that broke while idle (the worker restarted) fails its next request:
            // retry once on a fresh connection. Steps are idempotent (same KV writes, same
            // draws), and a restarted worker refuses the retry by its instance id.
            self.client = self.new_client();
            let mut c = self.client.clone();
            r = self.rt.block_on(c.step(req));
        }
        let reply = match r {
            Ok(r) => r.into_inner(),
            Err(st) if st.code() == tonic::Code::FailedPrecondition => return Err(self.fail(true, status_text(&st))),
            Err(st) => return Err(self.fail(false, status_text(&st))),
        };
        let last = self.want.layers.end == self.want.total_layers;
        if !last {
            let Some(h) = reply.hidden else {
                return Err(self.fail(false, "the worker returned no hidden states".into()));
            };
            if h.dtype != "f32"
                || h.shape != [n as u64, self.want.hidden as u64]
                || h.data.len() != n * self.want.hidden * 4
            {
                return Err(self.fail(false, format!("the worker returned hidden states {:?} {}", h.shape, h.dtype)));
            }
            return Ok((StageOutput::Hidden(h.data.into()), None));
        }
        if reply.sampled.len() != s.sample_rows.len() {
            return Err(self.fail(false, format!("{} sampled rows for {}", reply.sampled.len(), s.sample_rows.len())));
        }
        let sampled = reply.sampled.into_iter().map(Sampled::from).collect();
        let logits = reply.logits.map(|t| bytemuck::pod_collect_to_vec::<u8, f32>(&t.data));
        Ok((StageOutput::Sampled(sampled), logits))
    }
}

fn tensor(shape: Vec<usize>, data: Vec<u8>) -> proto::Tensor {
    proto::Tensor { shape: shape.into_iter().map(|d| d as u64).collect(), dtype: "f32".into(), data: data.into() }
}

// The wire forms of the step's parts, both ways.

impl From<&Adjust> for proto::Adjust {
    fn from(a: &Adjust) -> Self {
        proto::Adjust { id: a.id, count: a.count, in_prompt: a.in_prompt, bias: a.bias }
    }
}

impl From<proto::Adjust> for Adjust {
    fn from(a: proto::Adjust) -> Self {
        Adjust { id: a.id, count: a.count, in_prompt: a.in_prompt, bias: a.bias }
    }
}

impl From<&SampleParams> for proto::SampleParams {
    fn from(p: &SampleParams) -> Self {
        proto::SampleParams {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            u: p.u,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            n_top: p.n_top,
            adjust: p.adjust.iter().map(proto::Adjust::from).collect(),
            mask: p.mask.clone().unwrap_or_default(),
            force_plus_one: p.force.map_or(0, |t| t.saturating_add(1)),
        }
    }
}

impl From<proto::SampleParams> for SampleParams {
    fn from(p: proto::SampleParams) -> Self {
        SampleParams {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            u: p.u,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            n_top: p.n_top,
            adjust: p.adjust.into_iter().map(Adjust::from).collect(),
            mask: (!p.mask.is_empty()).then_some(p.mask),
            force: p.force_plus_one.checked_sub(1),
        }
    }
}

impl From<Sampled> for proto::Sampled {
    fn from(r: Sampled) -> Self {
        let top = r.top.into_iter().map(|(id, logprob)| proto::TopLogprob { id, logprob }).collect();
        proto::Sampled { id: r.id, logprob: r.logprob, top }
    }
}

impl From<proto::Sampled> for Sampled {
    fn from(r: proto::Sampled) -> Self {
        Sampled { id: r.id, logprob: r.logprob, top: r.top.into_iter().map(|t| (t.id, t.logprob)).collect() }
    }
}

fn step_request(s: &StepInput, instance: u64, hidden: Option<proto::Tensor>, want_logits: bool) -> proto::StepRequest {
    proto::StepRequest {
        instance,
        tokens: s.tokens.clone(),
        positions: s.positions.clone(),
        slots: s.slots.clone(),
        seq_of_token: s.seq_of_token.clone(),
        block_tables: s.block_tables.iter().map(|b| proto::BlockTable { blocks: b.clone() }).collect(),
        sample_rows: s.sample_rows.clone(),
        sampling: s.sampling.iter().map(proto::SampleParams::from).collect(),
        hidden,
        want_logits,
        session: 0,
    }
}

/// The step a request describes, its vectors moved out of it.
fn step_input(r: proto::StepRequest) -> StepInput {
    StepInput {
        tokens: r.tokens,
        positions: r.positions,
        slots: r.slots,
        seq_of_token: r.seq_of_token,
        block_tables: r.block_tables.into_iter().map(|b| b.blocks).collect(),
        sample_rows: r.sample_rows,
        sampling: r.sampling.into_iter().map(SampleParams::from).collect(),
    }
}

/// The scheduler session a worker serves.
struct Owner {
    session: u64,
    /// When its last step started or ended.
    last: Instant,
    /// Its steps received and not yet answered.
    busy: usize,
}

/// The gRPC service of one worker: its stage's model behind a lock (the owner's steps run one
/// at a time, in arrival order).
struct Worker {
    model: Arc<Mutex<super::LocalStage>>,
    /// What Info answers; its instance is `instance`'s value.
    info: proto::InfoReply,
    /// Changes when another scheduler takes the worker over.
    instance: AtomicU64,
    owner: Mutex<Option<Owner>>,
    bounds: StepBounds,
    lease: Duration,
}

impl Worker {
    fn owner(&self) -> std::result::Result<std::sync::MutexGuard<'_, Option<Owner>>, tonic::Status> {
        self.owner.lock().map_err(|_| tonic::Status::internal("the worker's owner lock is poisoned"))
    }

    /// Admits a step of `session` built for cache `instance`, or says why not.
    fn claim(&self, session: u64, instance: u64) -> std::result::Result<(), tonic::Status> {
        let mut owner = self.owner()?;
        let me = self.instance.load(SeqCst);
        if instance != 0 && instance != me {
            return Err(tonic::Status::failed_precondition(format!(
                "the worker restarted or was taken over (instance {me:x}, the scheduler expected {instance:x}): \
                 its KV cache is not the one the scheduler knew"
            )));
        }
        let now = Instant::now();
        match owner.as_mut() {
            None => {
                *owner = Some(Owner { session, last: now, busy: 1 });
                Ok(())
            }
            Some(o) if o.session == session => {
                o.busy += 1;
                o.last = now;
                Ok(())
            }
            Some(o) if o.busy > 0 || now.duration_since(o.last) < self.lease => Err(tonic::Status::aborted(format!(
                "the worker serves another scheduler (active {:.0} s ago; it may be taken over after worker_lease_s = \
                 {} s idle): one scheduler at a time",
                now.duration_since(o.last).as_secs_f64(),
                self.lease.as_secs_f64()
            ))),
            Some(_) => {
                // The owner went quiet: this scheduler takes over, and the cache gets a new
                // instance so the old owner cannot mistake it for its own.
                let new = random_id();
                self.instance.store(new, SeqCst);
                *owner = Some(Owner { session, last: now, busy: 0 });
                eprintln!("torus-wgpu worker: taken over by a new scheduler after its owner idled (instance {new:x})");
                Err(tonic::Status::failed_precondition(format!(
                    "the worker now serves this scheduler (taken over from one idle for over {} s): its KV cache \
                     starts anew as instance {new:x}",
                    self.lease.as_secs_f64()
                )))
            }
        }
    }

    /// A step of `session` was answered.
    fn finished(&self, session: u64) {
        if let Ok(mut owner) = self.owner.lock() {
            if let Some(o) = owner.as_mut().filter(|o| o.session == session) {
                o.busy = o.busy.saturating_sub(1);
                o.last = Instant::now();
            }
        }
    }
}

#[tonic::async_trait]
impl stage_server::Stage for Worker {
    async fn info(
        &self,
        _req: tonic::Request<proto::InfoRequest>,
    ) -> std::result::Result<tonic::Response<proto::InfoReply>, tonic::Status> {
        Ok(tonic::Response::new(proto::InfoReply { instance: self.instance.load(SeqCst), ..self.info.clone() }))
    }

    async fn step(
        &self,
        req: tonic::Request<proto::StepRequest>,
    ) -> std::result::Result<tonic::Response<proto::StepReply>, tonic::Status> {
        let mut req = req.into_inner();
        let (session, instance, want_logits) = (req.session, req.instance, req.want_logits);
        if session == 0 {
            return Err(tonic::Status::invalid_argument("the step names no session"));
        }
        let hidden_size = self.info.hidden as u64;
        let hidden = match req.hidden.take() {
            None => None,
            Some(t) => {
                let n = req.tokens.len() as u64;
                if t.dtype != "f32" || t.shape != [n, hidden_size] {
                    return Err(tonic::Status::invalid_argument(format!(
                        "hidden states {:?} {}, expected [{n}, {hidden_size}] f32",
                        t.shape, t.dtype
                    )));
                }
                Some(t.data)
            }
        };
        let input = step_input(req);
        // The whole step is checked against this worker's own cache and budget before it
        // may wait for (or take) the model.
        self.bounds
            .check(&input, hidden.as_ref().map(|h| h.len()))
            .map_err(|e| tonic::Status::invalid_argument(format!("{e:#}")))?;
        self.claim(session, instance)?;
        let model = self.model.clone();
        let r = tokio::task::spawn_blocking(move || -> Result<proto::StepReply> {
            let mut stage = model.lock().map_err(|_| anyhow!("the worker's model lock is poisoned"))?;
            let (out, logits) = StageExec::run(&mut *stage, &input, hidden.map(Vec::from), want_logits)?;
            let cfg = &stage.0.cfg;
            Ok(match out {
                StageOutput::Hidden(h) => proto::StepReply {
                    hidden: Some(tensor(vec![input.tokens.len(), cfg.hidden], h)),
                    ..Default::default()
                },
                StageOutput::Sampled(rows) => proto::StepReply {
                    logits: logits.map(|l| tensor(vec![rows.len(), cfg.vocab], bytemuck::cast_slice(&l).to_vec())),
                    sampled: rows.into_iter().map(proto::Sampled::from).collect(),
                    hidden: None,
                },
            })
        })
        .await;
        self.finished(session);
        let r = r.map_err(|e| tonic::Status::internal(format!("the step panicked: {e}")))?;
        r.map(tonic::Response::new).map_err(|e| tonic::Status::invalid_argument(format!("{e:#}")))
    }

    async fn release(
        &self,
        req: tonic::Request<proto::ReleaseRequest>,
    ) -> std::result::Result<tonic::Response<proto::ReleaseReply>, tonic::Status> {
        let session = req.into_inner().session;
        let mut owner = self.owner()?;
        if owner.as_ref().is_some_and(|o| o.session == session) {
            *owner = None;
        }
        Ok(tonic::Response::new(proto::ReleaseReply {}))
    }
}

/// Checks the worker token of every call: SHA-256 digests of `authorization` and of the
/// expected value, compared in constant time. `None`: no token configured.
#[derive(Clone)]
struct CheckToken(Option<[u8; 32]>);

fn digest(b: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(b).into()
}

/// Equal, in time that does not depend on where the inputs differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl tonic::service::Interceptor for CheckToken {
    fn call(&mut self, req: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        let Some(want) = &self.0 else { return Ok(req) };
        let Some(got) = req.metadata().get("authorization") else {
            return Err(tonic::Status::unauthenticated(
                "this worker requires a worker token (worker_token / TORUS_WORKER_TOKEN); none was sent",
            ));
        };
        if constant_time_eq(&digest(got.as_bytes()), want) {
            Ok(req)
        } else {
            Err(tonic::Status::unauthenticated("wrong worker token"))
        }
    }
}

/// The layers of the worker a config describes: its stage_start_layer..stage_end_layer, or its
/// share (pipeline_rank of world_size) of an even split.
pub fn worker_layers(cfg: &EngineConfig, total: usize) -> Result<Range<usize>> {
    match (cfg.stage_start_layer, cfg.stage_end_layer) {
        (Some(a), Some(b)) => {
            if a >= b || b > total {
                bail!(
                    "stage_start_layer..stage_end_layer = {a}..{b} is not a layer range of the model's {total} layers"
                );
            }
            Ok(a..b)
        }
        (None, None) => Ok(super::split_layers(total, &vec![None; cfg.world_size])?[cfg.pipeline_rank].clone()),
        _ => bail!("give both stage_start_layer and stage_end_layer, or neither"),
    }
}

/// The TLS settings of a worker config, or None to serve plaintext.
fn server_tls(cfg: &EngineConfig) -> Result<Option<ServerTlsConfig>> {
    let (Some(cert), Some(key)) = (&cfg.tls_cert, &cfg.tls_key) else {
        if cfg.tls_ca.is_some() {
            bail!("tls_ca on a worker requires client certificates over TLS: give tls_cert and tls_key too");
        }
        return Ok(None);
    };
    let mut tls =
        ServerTlsConfig::new().identity(Identity::from_pem(read_pem(cert, "tls_cert")?, read_pem(key, "tls_key")?));
    if let Some(ca) = &cfg.tls_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read_pem(ca, "tls_ca")?));
    }
    Ok(Some(tls))
}

/// `torus-wgpu worker`: loads one stage and serves it on `listen` until SIGINT/SIGTERM.
/// Without a worker token it serves loopback addresses only, unless `insecure`.
pub fn run_worker(cfg: &EngineConfig, listen: &str, insecure: bool) -> Result<()> {
    let path = cfg.model_path();
    let mcfg = crate::model::loader::read_config(&path).with_context(|| format!("loading {}", path.display()))?;
    let layers = worker_layers(cfg, mcfg.layers)?;
    use std::net::ToSocketAddrs;
    let addr = listen
        .to_socket_addrs()
        .map_err(|e| anyhow!("--listen {listen:?}: {e} (expected host:port)"))?
        .next()
        .ok_or_else(|| anyhow!("--listen {listen:?}: the name resolves to no address"))?;
    let tls = server_tls(cfg)?;
    let token = cfg.worker_token.as_ref().map(|t| digest(format!("Bearer {}", t.expose()).as_bytes()));
    match (&token, addr.ip().is_loopback(), insecure) {
        (None, true, _) => eprintln!(
            "torus-wgpu worker: WARNING: no worker_token: any process on this host can drive this worker \
             (set worker_token or TORUS_WORKER_TOKEN)"
        ),
        (None, false, false) => bail!(
            "refusing to serve on {addr} without a worker_token: any host that reaches it could write into its \
             KV cache. Set worker_token (or TORUS_WORKER_TOKEN), or pass --insecure on a network you trust"
        ),
        (None, false, true) => eprintln!(
            "torus-wgpu worker: WARNING: --insecure: serving on {addr} with NO authentication; any host that \
             reaches this port can drive this worker and corrupt its KV cache"
        ),
        (Some(_), false, _) if tls.is_none() => eprintln!(
            "torus-wgpu worker: WARNING: serving on {addr} without TLS: the worker token and hidden states \
             cross the network in plaintext (set tls_cert and tls_key)"
        ),
        _ => {}
    }
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls).map_err(|e| anyhow!("TLS settings: {e}"))?;
    }
    // Bind before loading, so a taken port fails at once.
    let listener = std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    listener.set_nonblocking(true)?;
    let gpu = Arc::new(crate::gpu::Gpu::new(cfg.adapter.as_deref())?);
    eprintln!("torus-wgpu worker: layers {}..{} of {} on {}", layers.start, layers.end, mcfg.layers, gpu.describe());
    // Only this stage's layers are read from the file.
    let host = crate::model::loader::HostModel::load_layers(&path, Some(layers.clone()), &|_, _| {})?;
    let limits = super::step_limits(cfg, &mcfg);
    let mut model = Model::new_stage(gpu.clone(), &host, limits, layers.clone())?;
    drop(host);
    model.warm_up()?;
    let instance = random_id();
    let info = proto::InfoReply {
        instance,
        start_layer: layers.start as u32,
        end_layer: layers.end as u32,
        total_layers: mcfg.layers as u32,
        first: model.is_first(),
        last: model.is_last(),
        num_blocks: model.kv.num_blocks as u32,
        block_size: model.limits.block_size as u32,
        hidden: mcfg.hidden as u32,
        vocab: mcfg.vocab as u32,
        max_tokens: model.limits.max_tokens as u32,
        max_seqs: model.limits.max_seqs as u32,
        max_seq_len: model.limits.max_seq_len as u32,
        adapter: gpu.describe(),
    };
    let msg = MessageLimits::new(mcfg.hidden, mcfg.vocab, &model.limits);
    let worker = Worker {
        bounds: model.bounds(),
        model: Arc::new(Mutex::new(super::LocalStage(model))),
        info,
        instance: AtomicU64::new(instance),
        owner: Mutex::new(None),
        lease: Duration::from_secs_f64(cfg.worker_lease_s),
    };
    let svc = stage_server::StageServer::new(worker)
        .max_decoding_message_size(msg.request)
        .max_encoding_message_size(msg.reply);
    // The token is checked on the call's headers, before its message is read.
    let svc = InterceptedService::new(svc, CheckToken(token));
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("torus-worker").build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        eprintln!(
            "torus-wgpu worker: ready on {addr} (instance {instance:x}; messages up to {} KiB in, {} KiB out)",
            msg.request >> 10,
            msg.reply >> 10
        );
        server
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                crate::shutdown::signal(),
            )
            .await
            .map_err(|e| anyhow!("worker server: {e}"))?;
        eprintln!("torus-wgpu worker: stopped");
        Ok(())
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The sampling parameters cross the wire whole, token mask included (and no mask stays none).
    #[test]
    fn sample_params_round_trip_with_and_without_a_mask() {
        let with = SampleParams {
            temperature: 0.7,
            top_k: 5,
            adjust: vec![Adjust { id: 3, count: 1, in_prompt: true, bias: -1.0 }],
            mask: Some(vec![0b1011, 0, u32::MAX]),
            force: Some(0),
            ..Default::default()
        };
        for p in [with, SampleParams::default()] {
            let wire = proto::SampleParams::from(&p);
            assert_eq!(SampleParams::from(wire), p);
        }
    }
}
