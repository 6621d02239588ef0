//! Synthetic models: real GGUF v3 files of a named model shape (SmolLM2-135M, Qwen2.5-0.5B,
//! Qwen2.5-7B, Llama-3-8B) filled with random weights in a chosen weight format, with a
//! byte-level BPE tokenizer in the metadata. They load through the ordinary GGUF loader and
//! tokenizer, so a machine without model files (a GPU box reached with only a binary) can run
//! correctness checks and measure speed at real sizes.
//!
//! Weights are random codes with block scales chosen so every matrix has values of mean about 0
//! and standard deviation 1/sqrt(row length) (see [`fill_centered_block`]): activations stay
//! O(1) through every layer, and logits are finite. Tensor data is generated and written as a
//! stream (a 28-layer Qwen2.5-7B shape in Q4_K is about 4.5 GB), never held in memory whole.

use super::config::Arch;
use super::families::{SynthEntry, SynthGemma4, SynthLinear, FAMILIES};
use super::loader::gguf_type;
use crate::formats::gguf::{encode_header, GgufTensorSpec, GgufValue};
use crate::gpu::wformat::WFormat;
use crate::weights::tensor::{fill_centered_block, gguf_block, XorShift64};
use anyhow::{anyhow, bail, Result};
use half::f16;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The hyper-parameters of a model shape, as llama.cpp's GGUF metadata names them.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthShape {
    pub name: &'static str,
    /// The family (what its files look like: `Family::synth`).
    pub arch: Arch,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub layers: usize,
    /// The LM head is the token embedding (no output.weight).
    pub tied: bool,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    /// `tokenizer.ggml.pre` of the real model's GGUF.
    pub pre_tokenizer: &'static str,
    /// Mixture-of-experts FFNs on every layer (Qwen3-MoE), or None.
    pub moe: Option<SynthMoe>,
    /// Gated DeltaNet layers (Qwen3.5, model/families/qwen35/synth.rs), or None.
    pub linear: Option<SynthLinear>,
    /// Gemma 4's layout (model/families/gemma4/synth.rs), or None.
    pub gemma4: Option<SynthGemma4>,
}

/// The experts of a synthetic mixture-of-experts shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthMoe {
    pub experts: usize,
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub ffn: usize,
}

/// The names of the shapes [`synth_shape`] knows (every family's, in the families' order).
pub fn synth_shape_names() -> Vec<&'static str> {
    FAMILIES.iter().flat_map(|f| f.synth.shapes.iter().map(|e| e.name)).collect()
}

/// The shape of a named model (one of [`synth_shape_names`]).
pub fn synth_shape(name: &str) -> Option<SynthShape> {
    synth_entry(name).map(|e| (e.shape)())
}

/// The families' entry of shape `name`.
pub(crate) fn synth_entry(name: &str) -> Option<&'static SynthEntry> {
    FAMILIES.iter().flat_map(|f| f.synth.shapes.iter()).find(|e| e.name == name)
}

impl SynthShape {
    /// A dense shape of `arch`: `dims` = (hidden, heads, KV heads, intermediate size,
    /// vocabulary, layers), heads of hidden / heads, no experts or other layers; RoPE base 10000,
    /// RMS epsilon 1e-6, 4096 positions and the default pre-tokenizer unless the caller sets its
    /// own.
    pub fn dense(arch: Arch, name: &'static str, dims: [usize; 6], tied: bool) -> SynthShape {
        let [hidden, heads, kv_heads, intermediate, vocab, layers] = dims;
        SynthShape {
            name,
            arch,
            hidden,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            intermediate,
            vocab,
            layers,
            tied,
            rope_theta: 10000.0,
            rms_eps: 1e-6,
            context_length: 4096,
            pre_tokenizer: "default",
            moe: None,
            linear: None,
            gemma4: None,
        }
    }

    /// `general.architecture`: the family's GGUF name (its second, where it has one, for a
    /// mixture of experts).
    pub fn arch_name(&self) -> &'static str {
        let names = self.arch.family().gguf_archs;
        let i = usize::from(self.moe.is_some() && names.len() > 1);
        // Mistral's files are llama's.
        names.get(i).copied().unwrap_or("llama")
    }

    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// A weight format by its name (`q4_k`, `Q8_0`, `f16`, ...).
pub fn parse_format(name: &str) -> Result<WFormat> {
    let want = name.to_ascii_lowercase();
    WFormat::ALL.into_iter().find(|f| f.name() == want).ok_or_else(|| {
        let names: Vec<&str> = WFormat::ALL.iter().map(|f| f.name()).collect();
        anyhow!("unknown weight format '{name}' (known: {})", names.join(", "))
    })
}

/// The format a matrix with rows of `cols` elements is stored in: `format`, unless its
/// 256-element super-blocks (K-quants, IQ4_XS, the IQ1/IQ2/IQ3 grid types) do not divide the row. Then, as llama.cpp's
/// quantizer does, Q4_K falls back to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and Q2_K, Q3_K, the grid types and
/// IQ4_XS to IQ4_NL. So SmolLM2 (hidden 576) and Qwen2.5-0.5B (896) keep K-quants only in
/// ffn_down, as real K-quant files of them do.
pub fn matrix_format(format: WFormat, cols: usize) -> WFormat {
    if format.scale_group() != 256 || cols.is_multiple_of(256) {
        return format;
    }
    match format {
        WFormat::Q4_K => WFormat::Q5_0,
        WFormat::Q5_K => WFormat::Q5_1,
        WFormat::Q6_K => WFormat::Q8_0,
        _ => WFormat::IQ4_NL,
    }
}

/// How a tensor's values are made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Fill {
    /// RMSNorm weights: f32 in 0.9..1.1.
    Norm,
    /// q/k/v biases: f32 in -0.05..0.05.
    Bias,
    /// A [rows, cols] weight matrix in `format`, values of standard deviation 1/sqrt(cols).
    Matrix { format: WFormat, cols: usize },
    /// Gated DeltaNet's A (= -exp(A_log)): f32 in -1.5..-0.5.
    Decay,
    /// Gated DeltaNet's dt_bias: f32 in -6.9..-2.3, softplus^-1 of a time step in 0.001..0.1 (the
    /// range Mamba and Gated DeltaNet initialise it from): most heads decay by a few percent per
    /// token, so a state carries over hundreds of tokens as in real checkpoints (with biases
    /// near 0 every head forgot its state within ~20 tokens, hiding a wrong one).
    DtBias,
    /// RoPE divisors: 1.0 for the first N pairs, 1e30 (no rotation) for the rest.
    Freqs(usize),
}

/// One tensor of a synthetic file.
#[derive(Clone, Debug)]
pub struct SynthTensor {
    pub spec: GgufTensorSpec,
    fill: Fill,
}

impl SynthTensor {
    /// A [rows, cols] matrix in `format` (with [`matrix_format`]'s fallbacks).
    pub(super) fn matrix(format: WFormat, name: String, rows: usize, cols: usize) -> SynthTensor {
        let format = matrix_format(format, cols);
        SynthTensor {
            spec: GgufTensorSpec { name, dims: vec![cols as u64, rows as u64], ggml_type: gguf_type(format) },
            fill: Fill::Matrix { format, cols },
        }
    }

    /// A vector of `len` f32 values.
    pub(super) fn vector(name: String, len: usize, fill: Fill) -> SynthTensor {
        SynthTensor { spec: GgufTensorSpec { name, dims: vec![len as u64], ggml_type: gguf_type(WFormat::F32) }, fill }
    }
}

/// Every tensor of a synthetic model of `shape` with `layers` layers, in file order, with
/// llama.cpp's names and ggml dims (innermost first).
pub fn synth_tensors(shape: &SynthShape, format: WFormat, layers: usize) -> Vec<SynthTensor> {
    let matrix_in = SynthTensor::matrix;
    let matrix = |name: String, rows: usize, cols: usize| matrix_in(format, name, rows, cols);
    let vector = SynthTensor::vector;
    let (h, q, kv, i) = (shape.hidden, shape.q_dim(), shape.kv_dim(), shape.intermediate);
    let family = shape.arch.family();
    let layout = &family.synth;
    let mut t = vec![matrix("token_embd.weight".into(), shape.vocab, h)];
    for l in 0..layers {
        let p = format!("blk.{l}");
        if let Some(layer) = layout.layer {
            t.extend(layer(shape, format, l, layers));
            continue;
        }
        t.push(vector(format!("{p}.attn_norm.weight"), h, Fill::Norm));
        t.push(matrix(format!("{p}.attn_q.weight"), q, h));
        t.push(matrix(format!("{p}.attn_k.weight"), kv, h));
        t.push(matrix(format!("{p}.attn_v.weight"), kv, h));
        if family.qkv_bias {
            t.push(vector(format!("{p}.attn_q.bias"), q, Fill::Bias));
            t.push(vector(format!("{p}.attn_k.bias"), kv, Fill::Bias));
            t.push(vector(format!("{p}.attn_v.bias"), kv, Fill::Bias));
        }
        if family.qk_norm {
            t.push(vector(format!("{p}.attn_q_norm.weight"), shape.head_dim, Fill::Norm));
            t.push(vector(format!("{p}.attn_k_norm.weight"), shape.head_dim, Fill::Norm));
        }
        t.push(matrix(format!("{p}.attn_output.weight"), h, q));
        if layout.out_bias_sinks {
            t.push(vector(format!("{p}.attn_output.bias"), h, Fill::Bias));
            t.push(vector(format!("{p}.attn_sinks.weight"), shape.heads, Fill::Bias));
        }
        t.push(vector(format!("{p}.{}", family.gguf_names.ffn_norm), h, Fill::Norm));
        if let Some(m) = shape.moe {
            // The router in f32 (as real files keep it), each projection's experts one 3-D tensor.
            t.push(SynthTensor {
                spec: GgufTensorSpec {
                    name: format!("{p}.ffn_gate_inp.weight"),
                    dims: vec![h as u64, m.experts as u64],
                    ggml_type: gguf_type(WFormat::F32),
                },
                fill: Fill::Matrix { format: WFormat::F32, cols: h },
            });
            // A family's own expert format (gpt-oss: MXFP4) whatever the other tensors are (an f32
            // file is all f32: for comparisons without quantization).
            let expert_format = layout.expert_format.filter(|_| format != WFormat::F32).unwrap_or(format);
            for (name, rows, cols) in [("gate", m.ffn, h), ("up", m.ffn, h), ("down", h, m.ffn)] {
                let mut e = matrix_in(expert_format, format!("{p}.ffn_{name}_exps.weight"), rows, cols);
                e.spec.dims.push(m.experts as u64);
                t.push(e);
            }
            if layout.expert_biases {
                // Biases of the router and of every expert's projections ([rows, experts]).
                t.push(vector(format!("{p}.ffn_gate_inp.bias"), m.experts, Fill::Bias));
                for (name, rows) in [("gate", m.ffn), ("up", m.ffn), ("down", h)] {
                    let mut b = vector(format!("{p}.ffn_{name}_exps.bias"), rows, Fill::Bias);
                    b.spec.dims.push(m.experts as u64);
                    t.push(b);
                }
            }
            continue;
        }
        t.push(matrix(format!("{p}.ffn_gate.weight"), i, h));
        t.push(matrix(format!("{p}.ffn_up.weight"), i, h));
        t.push(matrix(format!("{p}.ffn_down.weight"), h, i));
    }
    t.extend((layout.globals)(shape, format, layers));
    t.push(vector("output_norm.weight".into(), h, Fill::Norm));
    if !shape.tied {
        t.push(matrix("output.weight".into(), shape.vocab, h));
    }
    t
}

/// GPT-2's byte-to-character map (printable bytes stand for themselves, the others for the
/// characters from U+0100 on), index = byte.
pub fn byte_level_chars() -> [char; 256] {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        out[b as usize] = if printable(b) {
            char::from_u32(b).unwrap_or('?')
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('?')
        };
    }
    out
}

/// Token ids of the synthetic tokenizer's special tokens, the last three of the vocabulary.
pub fn special_token_ids(vocab: usize) -> (u32, u32, u32) {
    let n = vocab as u32;
    (n - 3, n - 2, n - 1)
}

/// The tokenizer metadata of a synthetic model with `vocab` tokens: GPT-2 byte-level BPE with
/// the 256 byte tokens first, then the two-letter tokens of up to 702 merges (a letter or the
/// space-letter after a letter), filler tokens `<synth_N>` (never produced by the merges), and
/// `<|endoftext|>` (BOS), `<|im_start|>` and `<|im_end|>` (EOS) as control tokens at the end,
/// with a ChatML chat template. Needs a vocabulary of at least 259 tokens.
fn tokenizer_metadata(vocab: usize, pre: &str, chat_template: Option<&str>) -> Vec<(String, GgufValue)> {
    let chars = byte_level_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let mut merges = Vec::new();
    let room = vocab.saturating_sub(256 + 3);
    let firsts = std::iter::once(chars[b' ' as usize]).chain('a'..='z');
    'outer: for a in firsts {
        for b in 'a'..='z' {
            if merges.len() >= room {
                break 'outer;
            }
            merges.push(GgufValue::Str(format!("{a} {b}")));
            tokens.push(format!("{a}{b}"));
        }
    }
    while tokens.len() + 3 < vocab {
        tokens.push(format!("<synth_{}>", tokens.len()));
    }
    tokens.extend(["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from));
    let n_normal = tokens.len() - 3;
    let types = (0..tokens.len()).map(|i| GgufValue::I32(if i < n_normal { 1 } else { 3 })).collect();
    let (bos, _, eos) = special_token_ids(vocab);
    let template = chat_template.unwrap_or(
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + \
         '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    );
    let s = |k: &str| k.to_string();
    vec![
        (s("tokenizer.ggml.model"), GgufValue::Str(s("gpt2"))),
        (s("tokenizer.ggml.pre"), GgufValue::Str(s(pre))),
        (s("tokenizer.ggml.tokens"), GgufValue::Array(tokens.into_iter().map(GgufValue::Str).collect())),
        (s("tokenizer.ggml.token_type"), GgufValue::Array(types)),
        (s("tokenizer.ggml.merges"), GgufValue::Array(merges)),
        (s("tokenizer.ggml.bos_token_id"), GgufValue::U32(bos)),
        (s("tokenizer.ggml.eos_token_id"), GgufValue::U32(eos)),
        (s("tokenizer.ggml.add_bos_token"), GgufValue::Bool(false)),
        (s("tokenizer.chat_template"), GgufValue::Str(s(template))),
    ]
}

/// The metadata of a synthetic model, as llama.cpp names it.
fn metadata(
    shape: &SynthShape,
    format: WFormat,
    layers: usize,
    chat_template: Option<&str>,
) -> Vec<(String, GgufValue)> {
    let a = shape.arch_name();
    let k = |suffix: &str| format!("{a}.{suffix}");
    let u = |v: usize| GgufValue::U32(v as u32);
    let mut m = vec![
        ("general.architecture".to_string(), GgufValue::Str(a.to_string())),
        ("general.name".to_string(), GgufValue::Str(format!("synthetic {} {}", shape.name, format.name()))),
        // A hybrid's MTP head is one more block (nextn_predict_layers).
        (k("block_count"), u(layers + usize::from(shape.linear.is_some()))),
        (k("context_length"), u(shape.context_length)),
        (k("embedding_length"), u(shape.hidden)),
        (k("feed_forward_length"), u(shape.intermediate)),
        (k("attention.head_count"), u(shape.heads)),
        (k("attention.head_count_kv"), u(shape.kv_heads)),
        (k("attention.key_length"), u(shape.head_dim)),
        (k("attention.value_length"), u(shape.head_dim)),
        (k("rope.dimension_count"), u(shape.head_dim)),
        (k("rope.freq_base"), GgufValue::F32(shape.rope_theta)),
        (k("attention.layer_norm_rms_epsilon"), GgufValue::F32(shape.rms_eps)),
        (k("vocab_size"), u(shape.vocab)),
    ];
    if let Some(e) = shape.moe {
        m.extend([
            (k("expert_count"), u(e.experts)),
            (k("expert_used_count"), u(e.top_k)),
            (k("expert_feed_forward_length"), u(e.ffn)),
        ]);
    }
    // The family's keys, in place of the common ones of the same name.
    let extra = (shape.arch.family().synth.metadata)(shape, layers);
    m.retain(|(key, _)| !extra.iter().any(|(e, _)| e == key));
    m.extend(extra);
    m.extend(tokenizer_metadata(shape.vocab, shape.pre_tokenizer, chat_template));
    m
}

/// Blocks generated per write.
const BLOCKS_PER_WRITE: usize = 8192;

/// Writes one tensor's data: generated in pieces of at most BLOCKS_PER_WRITE blocks.
fn write_data(out: &mut impl Write, fill: Fill, n_elements: usize, rng: &mut XorShift64) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let uniform = |rng: &mut XorShift64, half_width: f32| (rng.unit() * 2.0 - 1.0) * half_width;
    match fill {
        Fill::Norm => {
            for _ in 0..n_elements {
                buf.extend_from_slice(&(1.0 + uniform(rng, 0.1)).to_le_bytes());
            }
            out.write_all(&buf)
        }
        Fill::Bias => {
            for _ in 0..n_elements {
                buf.extend_from_slice(&uniform(rng, 0.05).to_le_bytes());
            }
            out.write_all(&buf)
        }
        Fill::Decay => {
            for _ in 0..n_elements {
                buf.extend_from_slice(&(-1.0 + uniform(rng, 0.5)).to_le_bytes());
            }
            out.write_all(&buf)
        }
        Fill::DtBias => {
            for _ in 0..n_elements {
                buf.extend_from_slice(&(-4.6 + uniform(rng, 2.3)).to_le_bytes());
            }
            out.write_all(&buf)
        }
        Fill::Freqs(rotated) => {
            for i in 0..n_elements {
                buf.extend_from_slice(&(if i < rotated { 1.0f32 } else { 1e30 }).to_le_bytes());
            }
            out.write_all(&buf)
        }
        Fill::Matrix { format, cols } => {
            let std = 1.0 / (cols as f32).sqrt();
            // Uniform values of this half-width have standard deviation `std`.
            let half_width = std * 3f32.sqrt();
            match gguf_block(format) {
                None => {
                    for piece in (0..n_elements).step_by(BLOCKS_PER_WRITE * 32) {
                        buf.clear();
                        for _ in piece..(piece + BLOCKS_PER_WRITE * 32).min(n_elements) {
                            let v = uniform(rng, half_width);
                            match format {
                                WFormat::F16 => buf.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
                                _ => buf.extend_from_slice(&v.to_le_bytes()),
                            }
                        }
                        out.write_all(&buf)?;
                    }
                    Ok(())
                }
                Some((block_elems, block_bytes)) => {
                    let blocks = n_elements / block_elems;
                    for piece in (0..blocks).step_by(BLOCKS_PER_WRITE) {
                        let n = BLOCKS_PER_WRITE.min(blocks - piece);
                        buf.resize(n * block_bytes, 0);
                        for b in buf.chunks_exact_mut(block_bytes) {
                            fill_centered_block(format, b, rng, std);
                        }
                        out.write_all(&buf)?;
                    }
                    Ok(())
                }
            }
        }
    }
}

/// Writes a synthetic GGUF v3 model of `shape` to `path`: `layers` layers (the shape's own
/// count when None), weight matrices in `format` (with [`matrix_format`]'s fallbacks), norms
/// and biases in f32, the tokenizer described at `tokenizer_metadata`. The same seed gives the
/// same file. The data goes to `path` with a `.partial` suffix first and is renamed when
/// complete. Returns the file's size in bytes.
pub fn write_synthetic_gguf(
    path: &Path,
    shape: &SynthShape,
    format: WFormat,
    layers: Option<usize>,
    seed: u64,
) -> Result<u64> {
    write_synthetic_gguf_with_template(path, shape, format, layers, seed, None)
}

/// [`write_synthetic_gguf`] with `chat_template` as the file's chat template (None: a ChatML
/// one).
pub fn write_synthetic_gguf_with_template(
    path: &Path,
    shape: &SynthShape,
    format: WFormat,
    layers: Option<usize>,
    seed: u64,
    chat_template: Option<&str>,
) -> Result<u64> {
    let p = path.display();
    let layers = layers.unwrap_or(shape.layers);
    if layers == 0 {
        bail!("{p}: a synthetic model needs at least one layer");
    }
    if shape.vocab < 259 {
        bail!("{p}: a synthetic model needs a vocabulary of at least 259 tokens, not {}", shape.vocab);
    }
    let tensors = synth_tensors(shape, format, layers);
    let specs: Vec<GgufTensorSpec> = tensors.iter().map(|t| t.spec.clone()).collect();
    let header =
        encode_header(&metadata(shape, format, layers, chat_template), &specs).map_err(|e| anyhow!("{p}: {e:#}"))?;

    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let write = || -> std::io::Result<u64> {
        let file = std::fs::File::create(&partial)?;
        let mut out = std::io::BufWriter::with_capacity(4 << 20, file);
        out.write_all(&header.bytes)?;
        let mut at = 0u64;
        for (i, (t, &offset)) in tensors.iter().zip(&header.offsets).enumerate() {
            out.write_all(&vec![0u8; (offset - at) as usize])?;
            // Each tensor its own stream, so a tensor's values do not depend on the others.
            let mut rng = XorShift64::new(seed ^ (i as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
            let n_elements = t.spec.dims.iter().product::<u64>() as usize;
            write_data(&mut out, t.fill, n_elements, &mut rng)?;
            at = offset + t.spec.n_bytes().unwrap_or(0);
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(header.bytes.len() as u64 + at)
    };
    let size = write().map_err(|e| {
        let _ = std::fs::remove_file(&partial);
        anyhow!("{}: cannot write the synthetic model: {e}", partial.display())
    })?;
    std::fs::rename(&partial, path).map_err(|e| anyhow!("{p}: cannot rename {} to it: {e}", partial.display()))?;
    Ok(size)
}
