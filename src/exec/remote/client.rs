//! The scheduler's side of one worker stage: connect, check what it serves, run steps.

use super::auth::*;
use super::wire::*;
use super::*;
use crate::exec::proto::{self};
use crate::exec::{StageExec, StageFailure};
use crate::model::{StageOutput, StepInput};
use crate::sampling::Sampled;
use anyhow::{anyhow, Result};
use std::time::Duration;
use tonic::transport::Endpoint;

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
