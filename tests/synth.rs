//! Synthetic GGUF models (`torus_wgpu::model::synth`): the files load through the ordinary
//! loader and tokenizer with the shape they were written for, the random blocks have the spread
//! they were asked for, the GPU forward of a small one matches a plain-Rust forward of the same
//! dequantized weights, and the kernel profiles agree on it (`bench::profiles::check_profiles`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use torus_wgpu::bench::profiles::{check_profiles, StepVerdict};
use torus_wgpu::config::{KernelProfile, KvDtype};
use torus_wgpu::formats::gguf::{GgmlType, GgufFile};
use torus_wgpu::gpu::wformat::WFormat;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::config::Arch;
use torus_wgpu::model::loader::{read_config, HostModel};
use torus_wgpu::model::synth::{matrix_format, synth_shape, synth_shape_names, write_synthetic_gguf, SynthShape};
use torus_wgpu::model::{Model, StepInput, StepLimits};
use torus_wgpu::sampling::SampleParams;
use torus_wgpu::tokenizer::{ChatMessage, Tokenizer};
use torus_wgpu::weights::tensor::{fill_centered_block, gguf_block, matmul_ref, QTensor, XorShift64};

/// A directory removed (with its files) when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("torus-synth-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn check_config(path: &Path, s: &SynthShape, layers: usize) {
    let c = read_config(path).unwrap();
    let what = format!("{} ({})", path.display(), s.name);
    assert_eq!(c.arch, s.arch, "{what}");
    assert_eq!(
        (c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.vocab),
        (s.hidden, layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab),
        "{what}"
    );
    assert_eq!(c.rope_theta, s.rope_theta as f64, "{what}");
    assert_eq!(c.rms_eps, s.rms_eps, "{what}");
    assert_eq!(c.qkv_bias, matches!(s.arch, Arch::Qwen2 | Arch::GptOss), "{what}");
    assert_eq!(c.max_positions, s.context_length, "{what}");
}

#[test]
fn every_shape_is_known_and_consistent() {
    for name in &synth_shape_names() {
        let s = synth_shape(name).unwrap();
        assert_eq!(s.name, *name);
        // Qwen3's head_dim is its own (32 x 128 = 4096 > hidden 2048 in Qwen3-30B-A3B), and Gemma
        // 4's (8 x 256 = 2048 < hidden 2560 in E4B).
        if s.moe.is_none() && s.gemma4.is_none() {
            assert_eq!(s.heads * s.head_dim, s.hidden, "{name}");
        }
        assert_eq!(s.heads % s.kv_heads, 0, "{name}");
    }
    assert!(synth_shape("gpt-5").is_none());
    let s = synth_shape("qwen2.5-7b").unwrap();
    assert_eq!(
        (s.hidden, s.heads, s.kv_heads, s.intermediate, s.vocab, s.layers, s.tied),
        (3584, 28, 4, 18944, 152064, 28, false)
    );
    let s = synth_shape("llama-3-8b").unwrap();
    assert_eq!(
        (s.hidden, s.heads, s.kv_heads, s.intermediate, s.vocab, s.layers, s.tied),
        (4096, 32, 8, 14336, 128256, 32, false)
    );
    let s = synth_shape("qwen3-30b-a3b").unwrap();
    let m = s.moe.unwrap();
    assert_eq!(
        (s.hidden, s.heads, s.kv_heads, s.head_dim, s.vocab, s.layers, s.tied, m.experts, m.top_k, m.ffn),
        (2048, 32, 4, 128, 151936, 48, false, 128, 8, 768)
    );
    let s = synth_shape("gpt-oss-20b").unwrap();
    let m = s.moe.unwrap();
    assert_eq!(
        (s.hidden, s.heads, s.kv_heads, s.head_dim, s.vocab, s.layers, s.tied, m.experts, m.top_k, m.ffn),
        (2880, 64, 8, 64, 201088, 24, false, 32, 4, 2880)
    );
}

/// Every block format: values of mean about 0 and standard deviation about the asked one, read
/// back through the loader's own block decoding.
#[test]
fn centered_blocks_have_the_asked_spread() {
    let (rows, cols) = (64, 1024);
    let std = 1.0 / (cols as f32).sqrt();
    let mut rng = XorShift64::new(5);
    for format in WFormat::ALL {
        let Some((block_elems, block_bytes)) = gguf_block(format) else { continue };
        let mut bytes = vec![0u8; rows * cols / block_elems * block_bytes];
        for b in bytes.chunks_exact_mut(block_bytes) {
            fill_centered_block(format, b, &mut rng, std);
        }
        let t = QTensor::from_gguf_blocks(format, rows, cols, &bytes).unwrap();
        let v: Vec<f64> = (0..rows).flat_map(|r| t.dequant_row(r)).map(|x| x as f64).collect();
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(v.iter().all(|x| x.is_finite()), "{format:?}: non-finite values");
        assert!(mean.abs() < 0.05 * std as f64, "{format:?}: mean {mean} (std asked {std})");
        assert!((sd / std as f64 - 1.0).abs() < 0.2, "{format:?}: std {sd}, asked {std}");
    }
}

#[test]
fn k_quants_fall_back_where_rows_are_not_whole_super_blocks() {
    assert_eq!(matrix_format(WFormat::Q4_K, 576), WFormat::Q5_0);
    assert_eq!(matrix_format(WFormat::Q4_K, 1536), WFormat::Q4_K);
    assert_eq!(matrix_format(WFormat::Q6_K, 896), WFormat::Q8_0);
    assert_eq!(matrix_format(WFormat::Q8_0, 576), WFormat::Q8_0);
    // As llama.cpp: Q2_K, Q3_K and IQ4_XS fall back to IQ4_NL.
    assert_eq!(matrix_format(WFormat::Q3_K, 576), WFormat::IQ4_NL);
    assert_eq!(matrix_format(WFormat::IQ4_XS, 896), WFormat::IQ4_NL);
    assert_eq!(matrix_format(WFormat::IQ4_XS, 4864), WFormat::IQ4_XS);
}

/// The tokenizer in the metadata: byte-level BPE over the whole vocabulary, text round-trips,
/// special tokens and the chat template work.
fn check_tokenizer(path: &Path, vocab: usize) {
    let tok = Tokenizer::from_path(path).unwrap();
    assert_eq!(tok.vocab_size(), vocab);
    let text = "Hello world, the quick brown fox: 1234 \u{e9}\u{1F600}!";
    let ids = tok.encode(text).unwrap();
    assert!(ids.len() < text.len(), "merges shorten the text: {ids:?}");
    assert_eq!(tok.decode(&ids, false), text);
    let end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(end as usize, vocab - 1);
    assert!(tok.is_eos(end));
    let chat = tok.apply_chat_template(&[ChatMessage::new("user", "hi")], true).unwrap();
    assert_eq!(chat, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(tok.encode(&chat).unwrap().iter().filter(|&&i| i == end).count(), 1);
}

fn limits() -> StepLimits {
    StepLimits {
        max_tokens: 64,
        max_seqs: 4,
        max_seq_len: 64,
        block_size: 16,
        cache_bytes: 4 << 20,
        max_binding: 0,
        kv_dtype: KvDtype::F32,
        profile: KernelProfile::Auto,
        sliding_window: None,
        int8: None,
    }
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(v, w)| (*v as f64 * r) as f32 * w).collect()
}

/// Rotate-half RoPE of every head of one token's row.
fn rope(row: &mut [f32], head_dim: usize, pos: usize, theta: f64) {
    let half = head_dim / 2;
    for head in row.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let a = pos as f64 / theta.powf(2.0 * i as f64 / head_dim as f64);
            let (c, s) = (a.cos(), a.sin());
            let (x, y) = (head[i] as f64, head[i + half] as f64);
            head[i] = (x * c - y * s) as f32;
            head[i + half] = (y * c + x * s) as f32;
        }
    }
}

/// A plain-Rust forward of `tokens` over the host model's dequantized weights: the logits of
/// the last position.
fn cpu_logits(host: &HostModel, tokens: &[u32]) -> Vec<f32> {
    let c = &host.cfg;
    let (t, hd, q_dim, kv_dim) = (tokens.len(), c.head_dim, c.q_dim(), c.kv_dim());
    let embed = host.embed.as_ref().unwrap();
    let mut h: Vec<f32> = tokens.iter().flat_map(|&id| embed.dequant_row(id as usize)).collect();
    let norm_rows = |h: &[f32], w: &[f32]| -> Vec<f32> {
        h.chunks_exact(c.hidden).flat_map(|r| rmsnorm(r, w, c.rms_eps)).collect()
    };
    for l in &host.layers {
        let x = norm_rows(&h, &l.attn_norm);
        let (mut q, mut k, mut v) = (matmul_ref(&x, t, &l.q), matmul_ref(&x, t, &l.k), matmul_ref(&x, t, &l.v));
        if let Some(b) = &l.qkv_bias {
            for i in 0..t {
                q[i * q_dim..(i + 1) * q_dim].iter_mut().zip(&b[..q_dim]).for_each(|(a, b)| *a += b);
                k[i * kv_dim..(i + 1) * kv_dim].iter_mut().zip(&b[q_dim..q_dim + kv_dim]).for_each(|(a, b)| *a += b);
                v[i * kv_dim..(i + 1) * kv_dim].iter_mut().zip(&b[q_dim + kv_dim..]).for_each(|(a, b)| *a += b);
            }
        }
        for i in 0..t {
            rope(&mut q[i * q_dim..(i + 1) * q_dim], hd, i, c.rope_theta);
            rope(&mut k[i * kv_dim..(i + 1) * kv_dim], hd, i, c.rope_theta);
        }
        let mut attn = vec![0f32; t * q_dim];
        let group = c.heads / c.kv_heads;
        for i in 0..t {
            for head in 0..c.heads {
                let qh = &q[i * q_dim + head * hd..][..hd];
                let kvh = head / group;
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kh = &k[j * kv_dim + kvh * hd..][..hd];
                        qh.iter().zip(kh).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let o: f64 = (0..=i).map(|j| e[j] / z * v[j * kv_dim + kvh * hd + d] as f64).sum();
                    attn[i * q_dim + head * hd + d] = o as f32;
                }
            }
        }
        h.iter_mut().zip(matmul_ref(&attn, t, &l.o)).for_each(|(a, b)| *a += b);
        let x = norm_rows(&h, &l.ffn_norm);
        let (g, u) = (matmul_ref(&x, t, &l.gate), matmul_ref(&x, t, &l.up));
        let act: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        h.iter_mut().zip(matmul_ref(&act, t, &l.down)).for_each(|(a, b)| *a += b);
    }
    let last = rmsnorm(&h[(t - 1) * c.hidden..], &host.final_norm, c.rms_eps);
    matmul_ref(&last, 1, host.lm_head().unwrap())
}

/// Writes a 2-layer SmolLM2-shaped model in `format`, loads it, and checks config, tensor
/// types, tokenizer, the first step's logits against the CPU forward, a few greedy steps, and
/// the kernel profiles' agreement.
fn check_small_model(format: WFormat) {
    let shape = synth_shape("smollm2-135m").unwrap();
    let dir = TempDir::new(format.name());
    let path = dir.0.join("model.gguf");
    let size = write_synthetic_gguf(&path, &shape, format, Some(2), 7).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), size);
    check_config(&path, &shape, 2);
    let g = GgufFile::open(&path).unwrap();
    let ty = |name: &str| g.tensor(name).unwrap_or_else(|| panic!("{name} missing")).ggml_type;
    let want_h = torus_wgpu::model::loader::gguf_type(matrix_format(format, shape.hidden));
    let want_i = torus_wgpu::model::loader::gguf_type(matrix_format(format, shape.intermediate));
    assert_eq!(ty("token_embd.weight"), want_h);
    assert_eq!(ty("blk.1.attn_q.weight"), want_h);
    assert_eq!(ty("blk.1.ffn_up.weight"), want_h);
    assert_eq!(ty("blk.1.ffn_down.weight"), want_i);
    assert_eq!(ty("blk.0.attn_norm.weight"), GgmlType::F32);
    assert!(g.tensor("output.weight").is_none(), "tied: no output.weight");
    assert!(g.tensor("blk.2.attn_q.weight").is_none());
    drop(g);
    check_tokenizer(&path, shape.vocab);

    let host = HostModel::load(&path, &|_, _| {}).unwrap();
    assert!(host.tied);
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let mut model = Model::new(gpu.clone(), &host, limits()).unwrap();
    let prompt: Vec<u32> = vec![17, 4000, 123, 49000, 9, 256, 300];
    let n = prompt.len();
    let table: Vec<u32> = (0..4).collect();
    let pos: Vec<u32> = (0..n as u32).collect();
    let first = model
        .step(&StepInput {
            tokens: prompt.clone(),
            positions: pos.clone(),
            slots: pos,
            seq_of_token: vec![0; n],
            block_tables: vec![table.clone()],
            sample_rows: vec![n as u32 - 1],
            sampling: vec![SampleParams::default()],
            state_slots: Vec::new(),
        })
        .unwrap();
    let gpu_logits = model.last_logits(1).unwrap();
    let want = cpu_logits(&host, &prompt);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = want.iter().zip(&gpu_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("{}: logits up to {scale:.3}, GPU vs CPU max diff {diff:.2e}", format.name());
    assert!(scale > 0.5 && scale < 100.0, "{}: logits of magnitude {scale}: activations not O(1)", format.name());
    assert!(diff < 1e-3 * scale.max(1.0), "{}: GPU and CPU logits differ by {diff}", format.name());
    let argmax = want.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
    let mut sorted = want.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    if sorted[0] - sorted[1] > 1e-2 {
        assert_eq!(first[0].id as usize, argmax, "{}: greedy token of the first step", format.name());
    }

    // A few greedy decode steps: finite logits throughout.
    let mut last = first[0].id;
    for p in n..n + 4 {
        let r = model
            .step(&StepInput {
                tokens: vec![last],
                positions: vec![p as u32],
                slots: vec![p as u32],
                seq_of_token: vec![0],
                block_tables: vec![table.clone()],
                sample_rows: vec![0],
                sampling: vec![SampleParams::default()],
                state_slots: Vec::new(),
            })
            .unwrap();
        let l = model.last_logits(1).unwrap();
        assert!(l.iter().all(|v| v.is_finite()), "{}: non-finite logits at position {p}", format.name());
        assert!((r[0].id as usize) < shape.vocab);
        last = r[0].id;
    }
    drop(model);

    let check = check_profiles(gpu, &host, limits(), &prompt, 6).unwrap();
    eprint!("{}", check.format());
    assert!(check.passed(), "{}: kernel profiles disagree:\n{}", format.name(), check.format());
    assert!(!check.steps.is_empty() && check.steps[0].verdict != StepVerdict::Failed);
    assert!(check.steps.iter().all(|s| s.max_abs_diff.is_finite()));
}

#[test]
fn smollm2_shape_q4_k_two_layers() {
    check_small_model(WFormat::Q4_K);
}

#[test]
fn smollm2_shape_q8_0_two_layers() {
    check_small_model(WFormat::Q8_0);
}

/// IQ4_XS in ffn_down (1536 = 6 super-blocks), IQ4_NL elsewhere (576 is not a whole one).
#[test]
fn smollm2_shape_iq4_xs_two_layers() {
    check_small_model(WFormat::IQ4_XS);
}

#[test]
fn smollm2_shape_mxfp4_two_layers() {
    check_small_model(WFormat::MXFP4);
}

// The grid types (IQ1/IQ2/IQ3) in ffn_down (1536 = 6 super-blocks), IQ4_NL elsewhere.
#[test]
fn smollm2_shape_iq2_xxs_two_layers() {
    check_small_model(WFormat::IQ2_XXS);
}

#[test]
fn smollm2_shape_iq2_xs_two_layers() {
    check_small_model(WFormat::IQ2_XS);
}

#[test]
fn smollm2_shape_iq2_s_two_layers() {
    check_small_model(WFormat::IQ2_S);
}

#[test]
fn smollm2_shape_iq3_xxs_two_layers() {
    check_small_model(WFormat::IQ3_XXS);
}

#[test]
fn smollm2_shape_iq3_s_two_layers() {
    check_small_model(WFormat::IQ3_S);
}

#[test]
fn smollm2_shape_iq1_s_two_layers() {
    check_small_model(WFormat::IQ1_S);
}

#[test]
fn smollm2_shape_iq1_m_two_layers() {
    check_small_model(WFormat::IQ1_M);
}

/// A one-layer Qwen2.5-7B-shaped file (untied head, q/k/v biases, K-quants everywhere since
/// 3584 and 18944 are whole super-blocks): config, types, size, tokenizer and the host loader.
#[test]
fn qwen25_7b_shape_one_layer_loads_on_the_host() {
    let shape = synth_shape("qwen2.5-7b").unwrap();
    let dir = TempDir::new("qwen7b");
    let path = dir.0.join("model.gguf");
    let size = write_synthetic_gguf(&path, &shape, WFormat::Q4_K, Some(1), 1).unwrap();
    check_config(&path, &shape, 1);
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.file_len(), size);
    for t in &g.tensors {
        let want = if t.dims.len() == 2 { GgmlType::Q4_K } else { GgmlType::F32 };
        assert_eq!(t.ggml_type, want, "{}", t.name);
    }
    assert!(g.tensor("output.weight").is_some() && g.tensor("blk.0.attn_k.bias").is_some());
    // Q4_K: 144 bytes per 256 weights.
    let weights = 2 * shape.vocab * shape.hidden
        + shape.hidden * (2 * shape.q_dim() + 2 * shape.kv_dim())
        + 3 * shape.hidden * shape.intermediate;
    assert!(size >= (weights / 256 * 144) as u64 && size < (weights / 256 * 144) as u64 + (8 << 20), "{size}");
    drop(g);
    check_tokenizer(&path, shape.vocab);
    let host = HostModel::load(&path, &|_, _| {}).unwrap();
    assert!(!host.tied && host.lm_head.is_some());
    assert_eq!(host.layers[0].qkv_bias.as_ref().unwrap().len(), shape.q_dim() + 2 * shape.kv_dim());
}

/// Both kernel profiles agree on 4 greedy steps after `prompt` on `host` (a synthetic layout).
fn assert_profiles_agree(host: &HostModel, prompt: &[u32], what: &str) -> torus_wgpu::bench::profiles::ProfileCheck {
    let gpu = Arc::new(Gpu::new(None).expect("a wgpu adapter (lavapipe in CI)"));
    let check = check_profiles(gpu, host, limits(), prompt, 4).unwrap();
    eprint!("{}", check.format());
    assert!(check.passed(), "{what} layout: kernel profiles disagree:\n{}", check.format());
    check
}

/// gpt-oss's synthetic layout at a small size (the real shape's vocabulary alone is 0.4 GB):
/// biases, sinks, the post-attention norm's name, experts in MXFP4 whatever the other matrices
/// are (f32 files aside), router and expert biases; it loads, the o200k pre-tokenizer is known, and both kernel
/// profiles agree on it.
#[test]
fn gptoss_layout_small_loads_and_profiles_agree() {
    let real = synth_shape("gpt-oss-20b").unwrap();
    let shape = SynthShape {
        hidden: 256,
        heads: 8,
        kv_heads: 2,
        intermediate: 256,
        vocab: 2048,
        moe: Some(torus_wgpu::model::synth::SynthMoe { experts: 8, top_k: 2, ffn: 256 }),
        ..real
    };
    let dir = TempDir::new("gptoss");
    let path = dir.0.join("model.gguf");
    write_synthetic_gguf(&path, &shape, WFormat::Q8_0, Some(2), 3).unwrap();
    check_config(&path, &shape, 2);
    let c = read_config(&path).unwrap();
    assert!(c.style.attn_sinks && c.style.out_bias);
    assert_eq!(c.style.sliding_layers.as_deref(), Some(&[true, false][..]));
    let g = GgufFile::open(&path).unwrap();
    let ty = |name: &str| g.tensor(name).unwrap_or_else(|| panic!("{name} missing")).ggml_type;
    assert_eq!(ty("blk.1.ffn_gate_exps.weight"), GgmlType::MXFP4);
    assert_eq!(ty("blk.1.ffn_down_exps.weight"), GgmlType::MXFP4);
    assert_eq!(ty("blk.1.attn_q.weight"), GgmlType::Q8_0);
    assert_eq!(ty("blk.1.attn_sinks.weight"), GgmlType::F32);
    drop(g);
    check_tokenizer(&path, shape.vocab);
    let host = HostModel::load(&path, &|_, _| {}).unwrap();
    assert_eq!(host.layers[1].sinks.as_ref().unwrap().len(), shape.heads);
    let check = assert_profiles_agree(&host, &[17, 400, 123, 2000, 9, 256, 300], "gpt-oss");
    assert!(check.steps.iter().all(|s| s.max_abs_diff.is_finite()));
}

/// Qwen3.5's synthetic layout at a small size, dense (qwen3.5-9b's) and with experts
/// (qwen3.6-35b-a3b's): Gated DeltaNet layers with llama.cpp's names (`attn_qkv`, `attn_gate`,
/// `ssm_*`), a gated attention layer every 4th with the gate rows in `attn_q`,
/// `post_attention_norm` as the FFN's norm, the `ssm.*` keys, the MoE's shared expert; each loads
/// as a hybrid and both kernel profiles agree on it.
#[test]
fn qwen35_layouts_small_load_and_profiles_agree() {
    for name in ["qwen3.5-9b", "qwen3.6-35b-a3b"] {
        let real = synth_shape(name).unwrap();
        let lin = real.linear.unwrap();
        let shape = SynthShape {
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            intermediate: 512,
            vocab: 2048,
            linear: Some(torus_wgpu::model::families::qwen35::synth::SynthLinear {
                k_heads: 2,
                v_heads: 4,
                k_dim: 32,
                v_dim: 32,
                rotary_dim: 16,
                ..lin
            }),
            moe: real.moe.map(|_| torus_wgpu::model::synth::SynthMoe { experts: 8, top_k: 2, ffn: 256 }),
            ..real
        };
        let dir = TempDir::new(name);
        let path = dir.0.join("model.gguf");
        write_synthetic_gguf(&path, &shape, WFormat::Q4_K, Some(4), 5).unwrap();
        check_config(&path, &shape, 4);
        let c = read_config(&path).unwrap();
        let l = c.linear.as_ref().unwrap();
        assert_eq!(l.layers, [true, true, true, false], "{name}");
        assert_eq!((l.dims.k_heads, l.dims.v_heads, l.dims.k_dim, l.dims.v_dim, l.dims.kernel), (2, 4, 32, 32, 4));
        assert!(l.tiled && c.style.attn_gate && c.qk_norm, "{name}");
        assert_eq!(c.rope_dim(), 16, "{name}");
        // What llama.cpp's loader requires: M-RoPE sections (Qwen3.5's [11, 11, 10] of 32 pairs,
        // here of 8), and the recurrent blocks (the MTP block last, not recurrent).
        let g = GgufFile::open(&path).unwrap();
        let arch = shape.arch_name();
        assert_eq!(g.get_i32_array(&format!("{arch}.rope.dimension_sections")), Some(vec![3, 3, 2, 0]), "{name}");
        assert_eq!(torus_wgpu::model::families::qwen35::synth::rope_sections(64), [11, 11, 10, 0]);
        let rec: Vec<bool> = g
            .get_array(&format!("{arch}.attention.recurrent_layers"))
            .unwrap()
            .iter()
            .map(|v| v.as_bool().unwrap())
            .collect();
        assert_eq!(rec, [true, true, true, false, false], "{name}");
        assert_eq!(c.moe.as_ref().map(|m| (m.experts, m.top_k, m.shared_ffn)), shape.moe.map(|_| (8, 2, 256)));
        check_tokenizer(&path, shape.vocab);
        let host = HostModel::load(&path, &|_, _| {}).unwrap();
        assert!(host.layers[0].linear.is_some() && host.layers[3].attn_gate.is_some(), "{name}");
        assert_profiles_agree(&host, &[17, 400, 123, 2000, 9, 256, 300], name);
    }
}

/// Gemma 4 E4B's synthetic layout at a small size: sliding-window layers with every sixth
/// global (its own head size), the last layers without keys or values (reading earlier layers'
/// caches), per-layer embeddings, a scalar per layer, llama.cpp's names and keys; it loads as
/// Gemma 4 with those features and both kernel profiles agree on it.
#[test]
fn gemma4_e4b_layout_small_loads_and_profiles_agree() {
    let real = synth_shape("gemma-4-e4b").unwrap();
    let g = real.gemma4.unwrap();
    assert_eq!(
        (real.hidden, real.layers, real.heads, real.kv_heads, real.head_dim, g.global_head_dim, g.ple, g.kv_shared),
        (2560, 42, 8, 2, 256, 512, 256, 18)
    );
    assert_eq!(g.shared(42, 42), 18);
    // llama.cpp's files share from a global layer after a sliding one: no such count at 6.
    assert_eq!((g.shared(12, 42), g.shared(6, 42)), (0, 0));
    let (shape, layers) = torus_wgpu::model::synth_tiny::tiny_shape("gemma-4-e4b").unwrap();
    assert_eq!(layers, 12);
    let dir = TempDir::new("gemma4");
    let path = dir.0.join("model.gguf");
    write_synthetic_gguf(&path, &shape, WFormat::Q8_0, Some(12), 7).unwrap();
    check_config(&path, &shape, 12);
    let c = read_config(&path).unwrap();
    // Layers 5 and 11 global; the last 6 share: sliding ones read layer 4, global ones layer 5.
    let kinds: Vec<bool> = (0..12).map(|l| l != 5 && l != 11).collect();
    assert_eq!(c.style.sliding_layers.as_deref(), Some(&kinds[..]));
    assert_eq!((c.geom(0).head_dim, c.geom(5).head_dim, c.geom(5).kv_heads), (64, 128, 2));
    assert_eq!(
        (c.style.kv_shared, c.kv_source(6), c.kv_source(10), c.kv_source(11), c.kv_source(5)),
        (6, Some(4), Some(4), Some(5), None)
    );
    assert_eq!((c.style.ple, c.sliding_window, c.style.final_softcap), (Some((32, 2048)), Some(8), Some(30.0)));
    // Proportional RoPE on the global layers: a quarter of the 64 pairs rotate.
    let want: Vec<f32> = (0..64).map(|i| if i < 16 { 1.0 } else { 1e30 }).collect();
    assert_eq!(c.rope_scaling, torus_wgpu::model::rope_scaling::RopeScaling::Freqs(want));
    check_tokenizer(&path, shape.vocab);
    let host = HostModel::load(&path, &|_, _| {}).unwrap();
    assert!(host.ple.is_some() && host.layers.iter().all(|l| l.ple.is_some() && l.layer_scalar.is_some()));
    assert_eq!((host.layers[5].k.rows, host.layers[6].k.rows), (2 * 128, 0));
    // Longer than the window of 8.
    let prompt: Vec<u32> = (0..20).map(|i| (i * 97 + 13) % 2000).collect();
    assert_profiles_agree(&host, &prompt, "gemma-4-e4b");
    // At Q4_K the per-layer token table and projections (rows of 32 * 12 and 32) fall back to
    // Q5_0, a format no other matmul has: the kernels built must include it (a load panicked
    // on the missing embedding kernel before).
    let path = dir.0.join("model-q4_k.gguf");
    write_synthetic_gguf(&path, &shape, WFormat::Q4_K, Some(12), 7).unwrap();
    let host = HostModel::load(&path, &|_, _| {}).unwrap();
    let ple = host.ple.as_ref().unwrap();
    assert_eq!((ple.embed.format, host.layers[0].q.format), (WFormat::Q5_0, WFormat::Q4_K));
    assert!(host.formats().contains(&ple.embed.format), "{:?}", host.formats());
    assert_profiles_agree(&host, &prompt[..6], "gemma-4-e4b at Q4_K");
}
