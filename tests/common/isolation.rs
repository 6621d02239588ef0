//! Isolation checks: small synthetic models of every family's layout, a request's "signature"
//! (its greedy tokens with their log-probabilities and top alternatives, bit for bit), and the
//! check that a prompt gives the same signature alone, after other requests and beside them.

use super::completions::assert_all_blocks_free;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use torus_wgpu::config::{EngineConfig, KernelProfile, KvDtype};
use torus_wgpu::engine::{EngineHandle, Event, Request, RequestParams, RequestStream, StopConditions};
use torus_wgpu::gpu::wformat::WFormat;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::synth::{write_synthetic_gguf, SynthShape};
use torus_wgpu::weights::tensor::XorShift64;

/// A directory of its own (removed with its files when dropped).
pub struct ModelDir(pub PathBuf);

impl Drop for ModelDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Vocabulary of the small shapes; their last three ids are the synthetic tokenizer's special
/// tokens (the last, `<|im_end|>`, ends a turn).
pub const VOCAB: usize = torus_wgpu::model::synth_tiny::TINY_VOCAB;
pub const IM_END: u32 = VOCAB as u32 - 1;

/// `name`'s synthetic layout at a small size, with its layers (model/synth_tiny.rs): 256 wide,
/// heads of 64, 2048 tokens; the hybrids keep Qwen3.5's key and value heads of 128 (one key
/// head, two value heads), whose per-token recurrence llvmpipe's loop limit cut after ~250
/// tokens.
pub fn small_shape(name: &str) -> (SynthShape, usize) {
    torus_wgpu::model::synth_tiny::tiny_shape(name).unwrap_or_else(|| panic!("{name}: no such synthetic shape"))
}

/// `name`'s small model (Q8_0) written into a directory of its own.
pub fn small_model(name: &str) -> (ModelDir, PathBuf) {
    let (shape, layers) = small_shape(name);
    let dir = std::env::temp_dir().join(format!(
        "torus-isolation-{name}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    write_synthetic_gguf(&path, &shape, WFormat::Q8_0, Some(layers), 7).unwrap();
    (ModelDir(dir), path)
}

/// The engine settings of the isolation tests: steps of 512 tokens, an f16 KV cache of 16 MiB,
/// no prefix cache.
pub fn plain_config(profile: KernelProfile) -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: 512,
        max_sequence_length: 1024,
        total_cache_size: 16 << 20,
        kv_cache_dtype: KvDtype::F16,
        kernel_profile: profile,
        max_decode_batch_size: 8,
        max_prefill_batch_size: 4,
        enable_prefix_cache: false,
        ..Default::default()
    }
}

/// An engine on `path` with `plain_config`, changed by `f`.
pub fn engine(path: &Path, profile: KernelProfile, f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    let mut c = plain_config(profile);
    f(&mut c);
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let (model, tok) = torus_wgpu::engine::load_model(path, &c, gpu, &|_, _| {})
        .unwrap_or_else(|e| panic!("{} loads: {e:#}", path.display()));
    EngineHandle::start(model, tok, &c)
}

/// Ids below the special tokens, from a seeded generator.
pub fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = XorShift64::new(seed);
    (0..len).map(|_| rng.range(0, VOCAB as u32 - 4)).collect()
}

/// Per generated token: its id and log-probability (bits), and the top alternatives.
pub type Signature = Vec<(u32, u32, Vec<(u32, u32)>)>;

/// A greedy request for 4 tokens with its 4 most likely alternatives at each.
pub fn probe_request(prompt: &[u32]) -> Request {
    let stop = StopConditions { max_tokens: Some(4), ignore_eos: true, ..Default::default() };
    Request { prompt: prompt.to_vec(), params: RequestParams { logprobs: Some(4), stop, ..Default::default() } }
}

pub fn signature(mut s: RequestStream) -> Signature {
    let mut sig = Vec::new();
    while let Some(e) = s.next_blocking() {
        match e {
            Event::Token { id, logprob, top, .. } => {
                sig.push((id, logprob.to_bits(), top.iter().map(|&(t, l)| (t, l.to_bits())).collect()))
            }
            Event::Done { reason, .. } => {
                assert!(matches!(reason, torus_wgpu::engine::FinishReason::Length), "finished with {reason:?}");
                break;
            }
            _ => {}
        }
    }
    assert!(!sig.is_empty(), "the request ended before its first token");
    sig
}

pub fn run(e: &EngineHandle, prompt: &[u32]) -> Signature {
    signature(e.submit(probe_request(prompt)).unwrap())
}

/// All of `prompts` at once.
pub fn run_together(e: &EngineHandle, prompts: &[Vec<u32>]) -> Vec<Signature> {
    let streams: Vec<_> = prompts.iter().map(|p| e.submit(probe_request(p)).unwrap()).collect();
    streams.into_iter().map(signature).collect()
}

/// `got` and `want` within float error: the same tokens up to the first one where `want`'s
/// top-1/top-2 margin is under 0.01 (there another summation order may pick the other), and
/// every log-probability until then within `tol`.
pub fn assert_close(got: &Signature, want: &Signature, tol: f32, what: &str) {
    let f = f32::from_bits;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let margin = w.2.first().zip(w.2.get(1)).map_or(f32::INFINITY, |(a, b)| f(a.1) - f(b.1));
        assert_eq!(g.0, w.0, "{what}: token {i}");
        let worst = g.2.iter().zip(&w.2).map(|(a, b)| (f(a.1) - f(b.1)).abs()).fold((f(g.1) - f(w.1)).abs(), f32::max);
        assert!(worst <= tol, "{what}: token {i}: log-probabilities differ by {worst} (more than {tol})");
        if margin < 0.01 {
            return;
        }
    }
}

/// `probe` on the fresh engine `e` first, then after each of `others` (greedy prompts, run
/// alone), then beside all of them at once: the same signature every time, bit for bit
/// (`together_tol`: within float error beside the others instead, where the batch's other step
/// shapes change a kernel's summation order). Every block and state slot is back afterwards.
/// Returns the first signature.
pub fn assert_repeats(
    e: &EngineHandle,
    probe: &Request,
    others: &[Vec<u32>],
    together_tol: Option<f32>,
    what: &str,
) -> Signature {
    let once = || signature(e.submit(probe.clone()).unwrap());
    let first = once();
    let n = probe.prompt.len();
    for o in others {
        run(e, o);
        assert!(once() == first, "{what}: the {n}-token probe after a {}-token request differs", o.len());
    }
    let streams: Vec<_> = others.iter().map(|p| e.submit(probe_request(p)).unwrap()).collect();
    let together = signature(e.submit(probe.clone()).unwrap());
    streams.into_iter().for_each(|s| drop(signature(s)));
    match together_tol {
        None => assert!(together == first, "{what}: the probe beside {} other requests differs", others.len()),
        Some(tol) => assert_close(&together, &first, tol, &format!("{what}: beside the others")),
    }
    assert_all_blocks_free(e);
    first
}
