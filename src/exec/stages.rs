//! Pipeline parallelism: the model's layers split into stages, each on its own wgpu device (in
//! this process) or in a `torus-wgpu worker` process reached over gRPC. Every stage holds its
//! layers' weights and KV cache; block tables are shared (the same block ids on every stage).
//! The first stage embeds tokens, the last applies the final norm, the LM head and the sampler;
//! hidden states cross between stages through host memory as raw f32 bytes.
//!
//! Each stage runs on its own thread, fed in order through a channel, so several steps are in
//! flight at once: while stage i computes step k, stage i+1 computes step k-1. The engine keeps
//! up to one step per stage in flight, each over different sequences (see engine::core).

use super::{panic_message, remote, Executor, StageFailure, StepOutput, StepResult};
use crate::model::{Model, StageOutput, StepInput, StepLimits};
use anyhow::{anyhow, bail, Result};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// Liveness of one stage, shared with the server's /health.
#[derive(Debug)]
pub struct StageHealth {
    pub stage: usize,
    pub name: String,
    /// host:port of a remote stage.
    pub address: Option<String>,
    /// How to reach the remote stage (its token and TLS settings).
    pub link: remote::Link,
    pub layers: Range<usize>,
    ok: AtomicBool,
    error: Mutex<String>,
}

impl StageHealth {
    pub fn new(stage: usize, name: String, address: Option<String>, layers: Range<usize>) -> StageHealth {
        StageHealth {
            stage,
            name,
            address,
            link: remote::Link::default(),
            layers,
            ok: AtomicBool::new(true),
            error: Mutex::new(String::new()),
        }
    }

    pub fn set(&self, r: std::result::Result<(), String>) {
        self.ok.store(r.is_ok(), Relaxed);
        if let Ok(mut e) = self.error.lock() {
            *e = r.err().unwrap_or_default();
        }
    }

    /// Ok, or the last error.
    pub fn get(&self) -> std::result::Result<(), String> {
        if self.ok.load(Relaxed) {
            Ok(())
        } else {
            Err(self.error.lock().map(|e| e.clone()).unwrap_or_default())
        }
    }
}

/// One stage, local or remote.
pub trait StageExec: Send {
    fn run(
        &mut self,
        s: &StepInput,
        hidden: Option<Vec<u8>>,
        want_logits: bool,
    ) -> Result<(StageOutput, Option<Vec<f32>>)>;
}

/// A stage with its health entry.
pub type Stage = (Box<dyn StageExec>, Arc<StageHealth>);

/// A stage on a device of this process (also what a worker process serves).
pub(crate) struct LocalStage(pub(crate) Model);

impl StageExec for LocalStage {
    fn run(
        &mut self,
        s: &StepInput,
        hidden: Option<Vec<u8>>,
        want_logits: bool,
    ) -> Result<(StageOutput, Option<Vec<f32>>)> {
        let out = self.0.run(s, hidden.as_deref())?;
        let logits = match (&out, want_logits) {
            (StageOutput::Sampled(r), true) => Some(self.0.last_logits(r.len())?),
            _ => None,
        };
        Ok((out, logits))
    }
}

struct Job {
    id: u64,
    input: Arc<StepInput>,
    hidden: Option<Vec<u8>>,
    want_logits: bool,
    /// Set once a stage fails; later stages pass the job on untouched.
    error: Option<anyhow::Error>,
}

/// Stages on their own threads, chained by channels.
pub struct Pipeline {
    tx: Option<Sender<Job>>,
    rx: Receiver<StepResult>,
    threads: Vec<std::thread::JoinHandle<()>>,
    pub health: Arc<Vec<Arc<StageHealth>>>,
    pub limits: StepLimits,
    pub num_blocks: usize,
    pub vocab: usize,
    /// Recurrent-state slots of a hybrid model's stages (0: none; set by `exec::build`).
    pub state_slots: usize,
    /// Ids of the steps in flight, oldest first.
    in_flight: VecDeque<u64>,
}

impl Pipeline {
    /// Starts one thread per stage. `stages` are in layer order with their health entries.
    pub fn new(stages: Vec<Stage>, limits: StepLimits, num_blocks: usize, vocab: usize) -> Result<Pipeline> {
        if stages.is_empty() {
            bail!("a pipeline needs at least one stage");
        }
        let (out_tx, rx) = channel::<StepResult>();
        let (tx, mut next_rx) = channel::<Job>();
        let n = stages.len();
        let mut threads = Vec::new();
        let health: Vec<Arc<StageHealth>> = stages.iter().map(|(_, h)| h.clone()).collect();
        for (i, (mut stage, h)) in stages.into_iter().enumerate() {
            let job_rx = next_rx;
            let (fwd_tx, fwd_rx) = channel::<Job>();
            next_rx = fwd_rx;
            let out = out_tx.clone();
            let last = i + 1 == n;
            let t = std::thread::Builder::new().name(format!("torus-stage-{i}")).spawn(move || {
                for mut job in job_rx {
                    if job.error.is_none() {
                        let (input, hidden, want) = (&job.input, job.hidden.take(), job.want_logits && last);
                        // A panic in a stage (a driver or validation failure) fails this step
                        // like any other stage error instead of taking the pipeline down.
                        let r =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stage.run(input, hidden, want)))
                                .unwrap_or_else(|p| Err(anyhow!("the stage panicked: {}", panic_message(&*p))));
                        match r {
                            Ok((StageOutput::Hidden(hd), _)) if !last => job.hidden = Some(hd),
                            Ok((StageOutput::Sampled(sampled), logits)) if last => {
                                h.set(Ok(()));
                                let _ = out.send(StepResult {
                                    id: job.id,
                                    result: Ok(StepOutput { sampled, logits, hidden: Vec::new() }),
                                });
                                continue;
                            }
                            Ok(_) => job.error = Some(anyhow!("stage {i} returned the wrong kind of output")),
                            Err(e) => {
                                h.set(Err(format!("{e:#}")));
                                job.error = Some(match e.downcast::<StageFailure>() {
                                    Ok(f) => f.into(),
                                    Err(e) => {
                                        let message = format!("{e:#}");
                                        StageFailure { stage: i, name: h.name.clone(), restarted: false, message }
                                            .into()
                                    }
                                });
                            }
                        }
                        if job.error.is_none() {
                            h.set(Ok(()));
                        }
                    }
                    if last {
                        let e = job.error.unwrap_or_else(|| anyhow!("stage {i} produced no output"));
                        let _ = out.send(StepResult { id: job.id, result: Err(e) });
                    } else if let Err(std::sync::mpsc::SendError(job)) = fwd_tx.send(job) {
                        let e = job.error.unwrap_or_else(|| {
                            let message = "its thread has stopped".to_string();
                            StageFailure { stage: i + 1, name: "pipeline".into(), restarted: false, message }.into()
                        });
                        let _ = out.send(StepResult { id: job.id, result: Err(e) });
                    }
                }
            })?;
            threads.push(t);
        }
        drop(next_rx);
        Ok(Pipeline {
            tx: Some(tx),
            rx,
            threads,
            health: Arc::new(health),
            limits,
            num_blocks,
            vocab,
            state_slots: 0,
            in_flight: VecDeque::new(),
        })
    }
}

impl Pipeline {
    pub fn depth(&self) -> usize {
        self.health.len()
    }

    /// Queues a step; results come back from `recv` in submission order.
    pub fn submit(&mut self, id: u64, input: StepInput, want_logits: bool) {
        let job = Job { id, input: Arc::new(input), hidden: None, want_logits, error: None };
        self.in_flight.push_back(id);
        // A send to a stopped first stage is answered by recv.
        if let Some(tx) = &self.tx {
            let _ = tx.send(job);
        }
    }

    /// Waits for the oldest step in flight. Should every stage thread be gone, each step still
    /// in flight gets an error, so the engine never waits for a result that cannot come.
    pub fn recv(&mut self) -> Option<StepResult> {
        let id = self.in_flight.pop_front()?;
        Some(self.rx.recv().unwrap_or_else(|_| {
            StepResult {
                id,
                result: Err(StageFailure {
                    stage: 0,
                    name: "pipeline".into(),
                    restarted: false,
                    message: "the pipeline's stage threads have stopped".into(),
                }
                .into()),
            }
        }))
    }

    /// Runs one step through every stage and waits for it (tests and tools).
    pub fn step(&mut self, input: StepInput, want_logits: bool) -> Result<StepOutput> {
        while self.recv().is_some() {}
        self.submit(0, input, want_logits);
        self.recv().ok_or_else(|| anyhow!("the pipeline has stopped"))?.result
    }

    pub fn describe(&self) -> String {
        let parts: Vec<String> =
            self.health.iter().map(|h| format!("stage {} layers {:?}: {}", h.stage, h.layers, h.name)).collect();
        parts.join("; ")
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Executor for Pipeline {
    fn limits(&self) -> StepLimits {
        self.limits
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn vocab(&self) -> usize {
        self.vocab
    }

    fn state_slots(&self) -> usize {
        self.state_slots
    }

    fn describe(&self) -> String {
        Pipeline::describe(self)
    }

    fn depth(&self) -> usize {
        Pipeline::depth(self)
    }

    fn health(&self) -> Option<Arc<Vec<Arc<StageHealth>>>> {
        Some(self.health.clone())
    }

    fn submit(&mut self, id: u64, input: StepInput) {
        Pipeline::submit(self, id, input, false)
    }

    fn recv(&mut self) -> Option<StepResult> {
        Pipeline::recv(self)
    }
}
