//! Stages in other processes: `torus-wgpu worker` serves one stage over gRPC (proto/stage.proto),
//! and `RemoteStage` drives it from the scheduler's pipeline.
//!
//! A worker has a random instance id. The scheduler learns it when it connects and sends it
//! with every step; a worker that restarted (new id, empty KV cache) refuses the step, so the
//! engine can recompute instead of reading a cache that is gone.

use super::proto::{self, stage_client::StageClient, stage_server};
use super::{StageExec, StageFailure};
use crate::config::EngineConfig;
use crate::model::forward::{Adjust, Model, SampleParams, Sampled, StageOutput, StepInput, StepLimits};
use anyhow::{anyhow, bail, Result};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Largest gRPC message (hidden states of a big prefill step).
pub const MAX_MESSAGE: usize = 1 << 30;

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

/// One stage served by a worker process.
pub struct RemoteStage {
    addr: String,
    want: Expect,
    rt: tokio::runtime::Runtime,
    ep: Endpoint,
    client: StageClient<Channel>,
    /// The worker instance whose KV cache the block tables describe (0 = connect and adopt).
    instance: u64,
}

fn status_text(s: &tonic::Status) -> String {
    let m = s.message();
    let m = if m.is_empty() { format!("{:?}", s.code()) } else { m.to_string() };
    // The client's own deadline (stage_timeout_s) ends a call as Cancelled("Timeout expired").
    let timed_out = s.code() == tonic::Code::DeadlineExceeded || m.contains("Timeout expired");
    match s.code() {
        _ if timed_out => format!("timed out (no answer within stage_timeout_s): {m}"),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => format!("unreachable: {m}"),
        _ => m,
    }
}

impl RemoteStage {
    /// Does not connect: a worker that is down now is reached at the first step it is needed.
    pub fn new(addr: &str, want: Expect) -> Result<RemoteStage> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let ep = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| anyhow!("stage {}: bad worker address {addr:?}: {e}", want.stage))?
            .connect_timeout(Duration::from_secs(3))
            .timeout(want.timeout);
        let client = Self::client_for(&rt, &ep);
        Ok(RemoteStage { addr: addr.to_string(), want, rt, ep, client, instance: 0 })
    }

    fn client_for(rt: &tokio::runtime::Runtime, ep: &Endpoint) -> StageClient<Channel> {
        let channel = {
            let _g = rt.enter();
            ep.connect_lazy()
        };
        StageClient::new(channel).max_decoding_message_size(MAX_MESSAGE).max_encoding_message_size(MAX_MESSAGE)
    }

    fn new_client(&self) -> StageClient<Channel> {
        Self::client_for(&self.rt, &self.ep)
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
        let req = step_request(s, self.instance, hidden.map(|h| tensor(vec![n, self.want.hidden], h)), want_logits);
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
            u: p.u,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            n_top: p.n_top,
            adjust: p.adjust.iter().map(proto::Adjust::from).collect(),
        }
    }
}

impl From<proto::SampleParams> for SampleParams {
    fn from(p: proto::SampleParams) -> Self {
        SampleParams {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            u: p.u,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            n_top: p.n_top,
            adjust: p.adjust.into_iter().map(Adjust::from).collect(),
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

/// The gRPC service of one worker: its stage's model behind a lock (steps run one at a time,
/// in arrival order).
struct Worker {
    model: Arc<Mutex<super::LocalStage>>,
    info: proto::InfoReply,
}

#[tonic::async_trait]
impl stage_server::Stage for Worker {
    async fn info(
        &self,
        _req: tonic::Request<proto::InfoRequest>,
    ) -> std::result::Result<tonic::Response<proto::InfoReply>, tonic::Status> {
        Ok(tonic::Response::new(self.info.clone()))
    }

    async fn step(
        &self,
        req: tonic::Request<proto::StepRequest>,
    ) -> std::result::Result<tonic::Response<proto::StepReply>, tonic::Status> {
        let mut req = req.into_inner();
        let me = self.info.instance;
        if req.instance != 0 && req.instance != me {
            return Err(tonic::Status::failed_precondition(format!(
                "the worker restarted (instance {me:x}, the scheduler expected {:x}): its KV cache was lost",
                req.instance
            )));
        }
        let (hidden_size, first) = (self.info.hidden as u64, self.info.first);
        let hidden = match (req.hidden.take(), first) {
            (None, true) => None,
            (Some(t), false) => {
                let n = req.tokens.len() as u64;
                if t.dtype != "f32" || t.shape != [n, hidden_size] {
                    return Err(tonic::Status::invalid_argument(format!(
                        "hidden states {:?} {}, expected [{n}, {hidden_size}] f32",
                        t.shape, t.dtype
                    )));
                }
                Some(Vec::from(t.data))
            }
            (None, false) => return Err(tonic::Status::invalid_argument("this stage needs hidden states")),
            (Some(_), true) => {
                return Err(tonic::Status::invalid_argument("the first stage takes tokens, not hidden states"))
            }
        };
        let model = self.model.clone();
        let r = tokio::task::spawn_blocking(move || -> Result<proto::StepReply> {
            let mut stage = model.lock().map_err(|_| anyhow!("the worker's model lock is poisoned"))?;
            let want_logits = req.want_logits;
            let input = step_input(req);
            let (out, logits) = StageExec::run(&mut *stage, &input, hidden, want_logits)?;
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
        .await
        .map_err(|e| tonic::Status::internal(format!("the step panicked: {e}")))?;
        r.map(tonic::Response::new).map_err(|e| tonic::Status::invalid_argument(format!("{e:#}")))
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

/// `torus-wgpu worker`: loads one stage and serves it on `listen` until SIGINT/SIGTERM.
pub fn run_worker(cfg: &EngineConfig, listen: &str) -> Result<()> {
    use anyhow::Context;
    let path = cfg.model_path();
    let mcfg = crate::model::loader::read_config(&path).with_context(|| format!("loading {}", path.display()))?;
    let layers = worker_layers(cfg, mcfg.layers)?;
    use std::net::ToSocketAddrs;
    let addr = listen
        .to_socket_addrs()
        .map_err(|e| anyhow!("--listen {listen:?}: {e} (expected host:port)"))?
        .next()
        .ok_or_else(|| anyhow!("--listen {listen:?}: the name resolves to no address"))?;
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
    let instance = crate::sampling::Rng::from_entropy().next_u64() | 1;
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
    let svc = stage_server::StageServer::new(Worker { model: Arc::new(Mutex::new(super::LocalStage(model))), info })
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("torus-worker").build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        eprintln!("torus-wgpu worker: ready on {addr} (instance {instance:x})");
        tonic::transport::Server::builder()
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
pub async fn probe(addr: &str, timeout: Duration) -> Result<proto::InfoReply> {
    let ep = Endpoint::from_shared(format!("http://{addr}"))?.connect_timeout(timeout).timeout(timeout);
    let ch = tokio::time::timeout(timeout, ep.connect()).await.map_err(|_| anyhow!("timed out"))?;
    let ch = ch.map_err(|e| anyhow!("unreachable: {e}"))?;
    let mut c = StageClient::new(ch);
    let r = c.info(proto::InfoRequest {}).await.map_err(|s| anyhow!(status_text(&s)))?;
    Ok(r.into_inner())
}
