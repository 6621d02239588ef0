//! Test support: an executor with no device. Each sampled row's token is a fixed function of
//! the row's token and position (forced rows report the forced token), so a run's steps and
//! outputs depend only on what the engine submits. It records every step input, and may send
//! commands to the engine when a given step is submitted (requests arriving mid-run, aborts).

use super::core::Command;
use crate::config::{KernelProfile, KvDtype};
use crate::exec::{Executor, StepOutput, StepResult};
use crate::model::{StepInput, StepLimits};
use crate::sampling::Sampled;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

/// The token the scripted model samples after `token` at `pos`: ids 200..500.
pub(crate) fn next_token(token: u32, pos: u32) -> u32 {
    200 + (token.wrapping_mul(31).wrapping_add(pos.wrapping_mul(7))) % 300
}

pub(crate) struct Scripted {
    pub(crate) limits: StepLimits,
    pub(crate) num_blocks: usize,
    pub(crate) depth: usize,
    pub(crate) vocab: usize,
    /// Every submitted step, as submitted.
    pub(crate) steps: Arc<Mutex<Vec<StepInput>>>,
    /// Commands to send when step n (1-based, in submission order) is submitted.
    pub(crate) script: HashMap<usize, Vec<Command>>,
    pub(crate) commands: Option<Sender<Command>>,
    done: VecDeque<StepResult>,
}

impl Scripted {
    pub(crate) fn new(max_tokens: usize, max_seqs: usize, block_size: usize, num_blocks: usize) -> Scripted {
        Scripted {
            limits: StepLimits {
                max_tokens,
                max_seqs,
                max_seq_len: 256,
                block_size,
                cache_bytes: 0,
                max_binding: 0,
                kv_dtype: KvDtype::F16,
                profile: KernelProfile::Cpu,
                sliding_window: None,
                int8: None,
            },
            num_blocks,
            depth: 1,
            vocab: 1024,
            steps: Arc::default(),
            script: HashMap::new(),
            commands: None,
            done: VecDeque::new(),
        }
    }
}

impl Executor for Scripted {
    fn limits(&self) -> StepLimits {
        self.limits
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn vocab(&self) -> usize {
        self.vocab
    }

    fn describe(&self) -> String {
        "scripted".into()
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn submit(&mut self, id: u64, input: StepInput) {
        let sampled = input
            .sample_rows
            .iter()
            .zip(&input.sampling)
            .map(|(&row, p)| {
                let (tok, pos) = (input.tokens[row as usize], input.positions[row as usize]);
                let id = p.force.unwrap_or_else(|| next_token(tok, pos));
                let logprob = -((pos % 50) as f32) / 8.0;
                let top = (0..p.n_top).map(|j| (id + j, logprob - j as f32)).collect();
                Sampled { id, logprob, top }
            })
            .collect();
        let mut steps = self.steps.lock().unwrap();
        steps.push(input);
        let n = steps.len();
        // A scripted run is short: a loop that never ends fails instead of hanging.
        assert!(n <= 5000, "the engine submitted more than 5000 steps");
        drop(steps);
        if let (Some(cmds), Some(tx)) = (self.script.remove(&n), &self.commands) {
            for c in cmds {
                let _ = tx.send(c);
            }
        }
        self.done.push_back(StepResult { id, result: Ok(StepOutput { sampled, logits: None, hidden: Vec::new() }) });
    }

    fn recv(&mut self) -> Option<StepResult> {
        self.done.pop_front()
    }
}
