//! `torus-wgpu check-profiles`: the kernel profiles (`cpu`, `gpu`) must compute the same model.
//! One model is loaded twice on one adapter, once per profile; the same prompt and then the
//! same greedy tokens (the cpu profile's) go through both with `Model::step`, and every step's
//! greedy tokens and logits are compared.
//!
//! Random weights make near-ties between the two best logits common, and two correct kernels
//! may round differently, so a step whose greedy tokens differ fails only when the cpu
//! profile's top-1/top-2 margin exceeds 1e-3 * max(1, |top-1|); a divergence within that margin
//! is tolerated and ends the comparison (the sequences would differ from there on).

use super::model::{random_tokens, sized_config, AdapterSummary};
use crate::config::{EngineArgs, KernelProfile};
use crate::gpu::Gpu;
use crate::model::loader::{read_config, HostModel};
use crate::model::{Model, StepInput, StepLimits};
use crate::sampling::SampleParams;
use crate::weights::tensor::XorShift64;
use anyhow::{bail, Context, Result};
use std::sync::Arc;

#[derive(clap::Args, Clone, Debug)]
pub struct CheckProfilesArgs {
    /// Engine settings (--model, --adapter, ...); --kernel-profile is ignored (both run).
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Random prompt tokens, prefilled in steps of at most max_num_batched_tokens.
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: usize,
    /// Greedy tokens compared: the one after the prompt, then one per decode step.
    #[arg(long, default_value_t = 16)]
    pub steps: usize,
    /// Seed of the random prompt.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the adapter, model, verdict and every step as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// How one step's profiles compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StepVerdict {
    /// Same greedy token, finite logits.
    Agree,
    /// Different greedy tokens, but the cpu profile's two best logits were within the margin.
    Tolerated,
    /// Different greedy tokens beyond the margin, or non-finite logits.
    Failed,
}

/// One compared step.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProfileStep {
    pub step: usize,
    pub cpu_token: u32,
    pub gpu_token: u32,
    /// Largest |cpu logit - gpu logit| over the vocabulary (NaN when either is not finite).
    pub max_abs_diff: f32,
    /// The cpu profile's best logit and its margin over the second best.
    pub top1: f32,
    pub margin: f32,
    pub verdict: StepVerdict,
}

/// The outcome of a profile comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProfileCheck {
    pub steps: Vec<ProfileStep>,
}

impl ProfileCheck {
    pub fn failures(&self) -> usize {
        self.steps.iter().filter(|s| s.verdict == StepVerdict::Failed).count()
    }

    pub fn passed(&self) -> bool {
        self.failures() == 0
    }

    /// One line per step.
    pub fn format(&self) -> String {
        let mut t = format!(
            "{:>5} {:>10} {:>10} {:>14} {:>12} {:>12}  verdict\n",
            "step", "cpu", "gpu", "max|diff|", "top1", "margin"
        );
        for s in &self.steps {
            t.push_str(&format!(
                "{:>5} {:>10} {:>10} {:>14.3e} {:>12.4} {:>12.4e}  {:?}\n",
                s.step, s.cpu_token, s.gpu_token, s.max_abs_diff, s.top1, s.margin, s.verdict
            ));
        }
        t
    }
}

/// Compares one step: the greedy tokens of both profiles and their logits.
fn compare(step: usize, cpu: (&[f32], u32), gpu: (&[f32], u32)) -> ProfileStep {
    let finite = cpu.0.iter().chain(gpu.0).all(|v| v.is_finite());
    let max_abs_diff =
        if finite { cpu.0.iter().zip(gpu.0).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) } else { f32::NAN };
    let (mut top1, mut top2) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in cpu.0 {
        if v > top1 {
            top2 = top1;
            top1 = v;
        } else if v > top2 {
            top2 = v;
        }
    }
    let margin = top1 - top2;
    let verdict = if !finite || cpu.0.len() != gpu.0.len() {
        StepVerdict::Failed
    } else if cpu.1 == gpu.1 {
        StepVerdict::Agree
    } else if margin > 1e-3 * top1.abs().max(1.0) {
        StepVerdict::Failed
    } else {
        StepVerdict::Tolerated
    };
    ProfileStep { step, cpu_token: cpu.1, gpu_token: gpu.1, max_abs_diff, top1, margin, verdict }
}

/// Runs `prompt` and then greedy decoding for `steps` tokens in total through the models of
/// both profiles (built from `host` on `gpu` with `limits`), feeding both the cpu profile's
/// tokens, and compares every step. Stops after the first tolerated divergence.
pub fn check_profiles(
    gpu: Arc<Gpu>,
    host: &HostModel,
    limits: StepLimits,
    prompt: &[u32],
    steps: usize,
) -> Result<ProfileCheck> {
    if prompt.is_empty() || steps == 0 {
        bail!("check_profiles needs a prompt and at least one step");
    }
    let total = prompt.len() + steps;
    if total > limits.max_seq_len {
        bail!("{total} tokens exceed max_sequence_length {}", limits.max_seq_len);
    }
    let mut models = Vec::new();
    for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
        let mut m = Model::new(gpu.clone(), host, StepLimits { profile, ..limits })
            .with_context(|| format!("building the model with kernel profile {}", profile.name()))?;
        m.warm_up()?;
        models.push(m);
    }
    let bs = limits.block_size;
    let blocks = total.div_ceil(bs);
    if blocks > models[0].kv.num_blocks {
        bail!("{total} tokens need {blocks} KV blocks, the cache holds {}", models[0].kv.num_blocks);
    }
    let table: Vec<u32> = (0..blocks as u32).collect();
    // Step inputs: the prompt in chunks (the last one sampled), then one token per step.
    let chunk = |tokens: &[u32], start: usize, sampled: bool| {
        let pos: Vec<u32> = (start as u32..(start + tokens.len()) as u32).collect();
        StepInput {
            tokens: tokens.to_vec(),
            slots: pos.clone(),
            positions: pos,
            seq_of_token: vec![0; tokens.len()],
            block_tables: vec![table.clone()],
            sample_rows: if sampled { vec![tokens.len() as u32 - 1] } else { vec![] },
            sampling: if sampled { vec![SampleParams::default()] } else { vec![] },
            state_slots: Vec::new(),
        }
    };
    let mut out = Vec::new();
    let mut input = None;
    for c0 in (0..prompt.len()).step_by(limits.max_tokens.max(1)) {
        let c1 = (c0 + limits.max_tokens.max(1)).min(prompt.len());
        let step = chunk(&prompt[c0..c1], c0, c1 == prompt.len());
        if c1 < prompt.len() {
            for m in models.iter_mut() {
                m.step(&step)?;
            }
        } else {
            input = Some(step);
        }
    }
    for s in 0..steps {
        let Some(step) = input.take() else { break };
        // (logits, greedy token) of each profile.
        let mut r = Vec::with_capacity(2);
        for m in models.iter_mut() {
            let id = m.step(&step)?.first().map_or(0, |x| x.id);
            r.push((m.last_logits(1)?, id));
        }
        let res = compare(s, (&r[0].0, r[0].1), (&r[1].0, r[1].1));
        let (tolerated, next) = (res.verdict == StepVerdict::Tolerated, res.cpu_token);
        out.push(res);
        if tolerated {
            break;
        }
        input = Some(chunk(&[next], prompt.len() + s, true));
    }
    Ok(ProfileCheck { steps: out })
}

/// `torus-wgpu check-profiles`: loads the model, compares the profiles, prints every step;
/// fails when any step failed.
pub fn run(args: &CheckProfilesArgs) -> Result<()> {
    if args.prompt_tokens == 0 || args.steps == 0 {
        bail!("--prompt-tokens and --steps must be positive");
    }
    let path = args.engine.resolve()?.model_path();
    let mcfg = read_config(&path)?;
    let total = args.prompt_tokens + args.steps;
    let cfg = sized_config(&args.engine, &mcfg, 1, total, args.prompt_tokens.min(512), &|bs| total.div_ceil(bs))?;
    let gpu = Arc::new(Gpu::new(cfg.adapter.as_deref())?);
    let a = AdapterSummary::of(&gpu);
    println!("adapter: {} ({}, {}; driver {} {})", a.name, a.backend, a.device_type, a.driver, a.driver_info);
    let host = HostModel::open(&path, None, &|_, _| {}).with_context(|| format!("loading {}", path.display()))?;
    let limits = crate::exec::step_limits(&cfg, &host.cfg);
    let prompt = random_tokens(&mut XorShift64::new(args.seed), args.prompt_tokens, host.cfg.vocab);
    let check = check_profiles(gpu, &host, limits, &prompt, args.steps)?;
    print!("{}", check.format());
    let agreed = check.steps.iter().filter(|s| s.verdict == StepVerdict::Agree).count();
    println!(
        "{}: {} of {} steps agree, {} failed{}",
        path.display(),
        agreed,
        check.steps.len(),
        check.failures(),
        if check.steps.iter().any(|s| s.verdict == StepVerdict::Tolerated) {
            " (stopped at a tolerated near-tie divergence)"
        } else {
            ""
        }
    );
    if let Some(p) = &args.json {
        let doc = serde_json::json!({
            "adapter": a,
            "model": path.display().to_string(),
            "prompt_tokens": args.prompt_tokens,
            "passed": check.passed(),
            "failures": check.failures(),
            "steps": check.steps,
        });
        let text = serde_json::to_string_pretty(&doc)? + "\n";
        std::fs::write(p, text).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    }
    if !check.passed() {
        bail!("the cpu and gpu kernel profiles disagree on {} step(s)", check.failures());
    }
    Ok(())
}
