//! `torus-wgpu worker`: one stage's model served over gRPC to one scheduler session at a time.

use super::auth::*;
use super::wire::*;
use super::*;
use crate::config::EngineConfig;
use crate::exec::proto::{self, stage_server};
use crate::exec::StageExec;
use crate::model::{Model, StageOutput, StepBounds};
use anyhow::{anyhow, bail, Context, Result};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::service::interceptor::InterceptedService;

/// The scheduler session a worker serves.
pub(super) struct Owner {
    session: u64,
    /// When its last step started or ended.
    last: Instant,
    /// Its steps received and not yet answered.
    busy: usize,
}

/// The gRPC service of one worker: its stage's model behind a lock (the owner's steps run one
/// at a time, in arrival order).
pub(super) struct Worker {
    model: Arc<Mutex<crate::exec::stages::LocalStage>>,
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
        (None, None) => Ok(crate::exec::split_layers(total, &vec![None; cfg.world_size])?[cfg.pipeline_rank].clone()),
        _ => bail!("give both stage_start_layer and stage_end_layer, or neither"),
    }
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
    let host = crate::model::loader::HostModel::open(&path, Some(layers.clone()), &|_, _| {})?;
    let limits = crate::exec::step_limits(cfg, &mcfg);
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
        model: Arc::new(Mutex::new(crate::exec::stages::LocalStage(model))),
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
