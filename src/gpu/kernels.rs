//! Shader assembly and the compute pipelines of every kernel, built once at start-up.

use super::Gpu;
use anyhow::Result;
use std::collections::BTreeMap;

/// How a weight matrix is stored on the GPU. Quantized formats keep GGUF's quantized values
/// (never dequantized at load); each format's blocks are re-packed at load into two arrays (see
/// `QTensor::from_gguf_blocks`): `q`, the quant codes of every 32-element block in a fixed
/// number of u32 words, and `s`, the scales, one record of `scale_words` words per
/// `scale_group` elements (32 for the legacy formats, 256 for the K-quants' super-blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[allow(non_camel_case_types)] // ggml's names (Q4_K, ...)
pub enum WFormat {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl WFormat {
    pub const ALL: [WFormat; 12] = [
        WFormat::F32,
        WFormat::F16,
        WFormat::Q8_0,
        WFormat::Q4_0,
        WFormat::Q4_1,
        WFormat::Q5_0,
        WFormat::Q5_1,
        WFormat::Q2_K,
        WFormat::Q3_K,
        WFormat::Q4_K,
        WFormat::Q5_K,
        WFormat::Q6_K,
    ];

    /// u32 quant words per 32-element block.
    pub fn words_per_block(self) -> usize {
        match self {
            WFormat::F32 => 32,
            WFormat::F16 => 16,
            WFormat::Q8_0 => 8,
            WFormat::Q4_0 | WFormat::Q4_1 | WFormat::Q4_K => 4,
            WFormat::Q5_0 | WFormat::Q5_1 | WFormat::Q5_K => 5,
            WFormat::Q6_K => 6,
            WFormat::Q3_K => 3,
            WFormat::Q2_K => 2,
        }
    }

    /// Elements covered by one scale record (a row length must be a multiple of it).
    pub fn scale_group(self) -> usize {
        if self.is_k_quant() {
            256
        } else {
            32
        }
    }

    /// u32 words of one scale record.
    pub fn scale_words(self) -> usize {
        match self {
            WFormat::F32 | WFormat::F16 => 0,
            WFormat::Q8_0 | WFormat::Q4_0 | WFormat::Q5_0 => 1,
            WFormat::Q4_1 | WFormat::Q5_1 => 2,
            // d, dmin and eight 6-bit scales and mins as bytes.
            WFormat::Q4_K | WFormat::Q5_K => 6,
            // d, dmin and sixteen 4-bit scale/min pairs as bytes.
            WFormat::Q2_K => 6,
            // d and sixteen signed scales as bytes.
            WFormat::Q3_K | WFormat::Q6_K => 5,
        }
    }

    /// u32 scale words of a row of `cols` elements.
    pub fn scale_words_per_row(self, cols: usize) -> usize {
        cols / self.scale_group() * self.scale_words()
    }

    /// The K-quants: 256-element super-blocks.
    pub fn is_k_quant(self) -> bool {
        matches!(self, WFormat::Q2_K | WFormat::Q3_K | WFormat::Q4_K | WFormat::Q5_K | WFormat::Q6_K)
    }

    fn snippet(self) -> String {
        let own = match self {
            WFormat::F32 => include_str!("../../shaders/wfmt_f32.wgsl"),
            WFormat::F16 => include_str!("../../shaders/wfmt_f16.wgsl"),
            WFormat::Q8_0 => include_str!("../../shaders/wfmt_q8_0.wgsl"),
            WFormat::Q4_0 => include_str!("../../shaders/wfmt_q4_0.wgsl"),
            WFormat::Q4_1 => include_str!("../../shaders/wfmt_q4_1.wgsl"),
            WFormat::Q5_0 => include_str!("../../shaders/wfmt_q5_0.wgsl"),
            WFormat::Q5_1 => include_str!("../../shaders/wfmt_q5_1.wgsl"),
            WFormat::Q2_K => include_str!("../../shaders/wfmt_q2_k.wgsl"),
            WFormat::Q3_K => include_str!("../../shaders/wfmt_q3_k.wgsl"),
            WFormat::Q4_K => include_str!("../../shaders/wfmt_q4_k.wgsl"),
            WFormat::Q5_K => include_str!("../../shaders/wfmt_q5_k.wgsl"),
            WFormat::Q6_K => include_str!("../../shaders/wfmt_q6_k.wgsl"),
        };
        // The K-quants' scale records share their decoding.
        let shared = if matches!(self, WFormat::Q3_K | WFormat::Q4_K | WFormat::Q5_K | WFormat::Q6_K) {
            include_str!("../../shaders/wfmt_k_scales.wgsl")
        } else {
            ""
        };
        format!("{own}\n{shared}")
    }

    pub fn name(self) -> &'static str {
        match self {
            WFormat::F32 => "f32",
            WFormat::F16 => "f16",
            WFormat::Q8_0 => "q8_0",
            WFormat::Q4_0 => "q4_0",
            WFormat::Q4_1 => "q4_1",
            WFormat::Q5_0 => "q5_0",
            WFormat::Q5_1 => "q5_1",
            WFormat::Q2_K => "q2_k",
            WFormat::Q3_K => "q3_k",
            WFormat::Q4_K => "q4_k",
            WFormat::Q5_K => "q5_k",
            WFormat::Q6_K => "q6_k",
        }
    }
}

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// Two halves per u32 (half the memory of f32).
    #[default]
    F16,
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }

    /// Parses `f16` / `f32` (also `float16`/`half`, `float32`/`float`).
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s.to_ascii_lowercase().as_str() {
            "f16" | "float16" | "half" | "fp16" => Some(KvDtype::F16),
            "f32" | "float32" | "float" | "fp32" => Some(KvDtype::F32),
            _ => None,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        KvDtype::parse(s).ok_or_else(|| format!("unknown KV-cache dtype '{s}' (expected f16 or f32)"))
    }
}

/// Which kernel shapes a model runs: `cpu` (llvmpipe, SwiftShader: one invocation per output,
/// no workgroup memory) or `gpu` (integrated and discrete GPUs: coalesced weight reads,
/// workgroup reductions, split-key attention). `auto` picks by the adapter's device type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelProfile {
    #[default]
    Auto,
    Cpu,
    Gpu,
}

impl KernelProfile {
    pub fn name(self) -> &'static str {
        match self {
            KernelProfile::Auto => "auto",
            KernelProfile::Cpu => "cpu",
            KernelProfile::Gpu => "gpu",
        }
    }

    /// The profile for an adapter: `auto` becomes `cpu` on CPU adapters, `gpu` elsewhere.
    pub fn resolve(self, device_type: wgpu::DeviceType) -> KernelProfile {
        match self {
            KernelProfile::Auto if device_type == wgpu::DeviceType::Cpu => KernelProfile::Cpu,
            KernelProfile::Auto => KernelProfile::Gpu,
            p => p,
        }
    }
}

impl std::str::FromStr for KernelProfile {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(KernelProfile::Auto),
            "cpu" => Ok(KernelProfile::Cpu),
            "gpu" => Ok(KernelProfile::Gpu),
            _ => Err(format!("unknown kernel profile '{s}' (expected auto, cpu or gpu)")),
        }
    }
}

/// Binding of chunk c >= 1 of a layer's K cache (chunk 0 keeps the kernel's own binding); V
/// chunks at KV_V_CHUNK_BINDING + c. A layer's cache larger than one storage binding spans
/// several buffers of whole KV blocks.
pub const KV_K_CHUNK_BINDING: u32 = 10;
pub const KV_V_CHUNK_BINDING: u32 = 20;
/// Most buffers one layer's K (or V) cache may span.
pub const MAX_KV_CHUNKS: usize = 4;

/// The KV-cache bindings and accessors of rope_kv.wgsl (`write`) and attention.wgsl (read), for
/// a cache of `chunks` buffers per layer: elements 4i..4i+4 of a layer's cache are `load_k(i)` /
/// `load_v(i)`; `store_k(e, v)` writes elements e, e+1 (e even). With several chunks, the
/// kernel's params `p` carry the chunk length (`kv_chunk` elements, `kv_chunk4` vec4s).
fn kv_snippet(kv: KvDtype, write: bool, chunks: usize) -> String {
    let (k0, v0) = if write { (5, 6) } else { (4, 5) };
    let access = if write { "read_write" } else { "read" };
    let elem = match (kv, write) {
        (KvDtype::F32, true) => "f32",
        (KvDtype::F32, false) => "vec4<f32>",
        (KvDtype::F16, true) => "u32",
        (KvDtype::F16, false) => "vec2<u32>",
    };
    let mut out = String::new();
    for c in 0..chunks as u32 {
        let (kb, vb) = if c == 0 { (k0, v0) } else { (KV_K_CHUNK_BINDING + c, KV_V_CHUNK_BINDING + c) };
        out += &format!("@group(0) @binding({kb}) var<storage, {access}> k_cache{c}: array<{elem}>;\n");
        out += &format!("@group(0) @binding({vb}) var<storage, {access}> v_cache{c}: array<{elem}>;\n");
    }
    for name in ["k", "v"] {
        // The access to chunk c at local index j.
        let one = |c: usize| match (kv, write) {
            (KvDtype::F32, true) => format!("{name}_cache{c}[j] = v.x;\n        {name}_cache{c}[j + 1u] = v.y;"),
            (KvDtype::F16, true) => format!("{name}_cache{c}[j / 2u] = pack2x16float(v);"),
            (KvDtype::F32, false) => format!("return {name}_cache{c}[j];"),
            (KvDtype::F16, false) => format!(
                "let w = {name}_cache{c}[j];\n        return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));"
            ),
        };
        let (sig, unit) = if write {
            (format!("fn store_{name}(e: u32, v: vec2<f32>)"), "p.kv_chunk")
        } else {
            (format!("fn load_{name}(i: u32) -> vec4<f32>"), "p.kv_chunk4")
        };
        let idx = if write { "e" } else { "i" };
        out += &format!("\n{sig} {{\n");
        if chunks == 1 {
            out += &format!("    let j = {idx};\n    {{\n        {}\n    }}\n", one(0));
        } else {
            out += &format!("    let c = {idx} / {unit};\n    let j = {idx} - c * {unit};\n");
            for c in 0..chunks - 1 {
                out += &format!("    if (c == {c}u) {{\n        {}\n", one(c));
                out += if write { "        return;\n    }\n" } else { "    }\n" };
            }
            out += &format!("    {{\n        {}\n    }}\n", one(chunks - 1));
        }
        out += "}\n";
    }
    out
}

const COMMON: &str = include_str!("../../shaders/common.wgsl");

/// What every shader starts with: the shared declarations (src/gpu/shared.rs) and common.wgsl.
fn common() -> String {
    format!("{}\n{COMMON}", super::shared::wgsl_common())
}

/// The matmul shaders' shared part after the weight format: MatParams, its flags, bindings and
/// epilogue.
fn matmul_common() -> String {
    format!("{}\n{}", super::shared::wgsl_matmul(), include_str!("../../shaders/matmul_common.wgsl"))
}

/// Register tiles (tokens x weight rows per thread) of the matmul variants: decode-sized steps
/// use the small ones, prefill the last. A step of m rows uses the first tile with TM >= m
/// (the last for larger steps), so each weight is loaded once per TM tokens.
pub const MATMUL_TILES: [(u32, u32); 5] = [(1, 4), (2, 4), (4, 4), (8, 4), (16, 4)];
pub const MATMUL_WG: u32 = 64;

/// Index into MATMUL_TILES for a step of `m` rows.
pub fn tile_for_rows(m: u32) -> usize {
    MATMUL_TILES.iter().position(|t| t.0 >= m).unwrap_or(MATMUL_TILES.len() - 1)
}

const WINDOW_ALL: &str =
    "fn window_base() -> u32 {\n    return 0u;\n}\n\nfn window_rows(m: u32) -> u32 {\n    return m;\n}";

/// Uniform-x window: x is bound at a dynamic offset, `win` says which window of rows this
/// dispatch covers (`single`: the whole step fits one window starting at row 0).
const WINDOW_UNIFORM: &str = "struct Window {
    index: u32,
    single: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(7) var<uniform> win: Window;

// Rows per window: a whole number of tiles (the largest tile that fits, see plan_x).
fn window_size() -> u32 {
    return {{UX}}u / p.x_stride4 / TM * TM;
}

fn window_base() -> u32 {
    return select(win.index * window_size(), 0u, win.single == 1u);
}

fn window_rows(m: u32) -> u32 {
    return select(min(m - window_base(), window_size()), m, win.single == 1u);
}";

/// How a matmul over m activation rows is dispatched: reading x from storage, or through
/// uniform windows (one dispatch per window: x's dynamic offset, the window entry's dynamic
/// offset, and the rows it covers).
#[derive(Clone, Debug, PartialEq)]
pub enum XPlan {
    Storage { tile: usize },
    Uniform { tile: usize, windows: Vec<(u32, u32, u32)> },
}

/// Byte stride of the entries of the window buffer (a dynamic-offset alignment multiple).
pub fn window_stride(gpu: &Gpu) -> u32 {
    gpu.device.limits().min_uniform_buffer_offset_alignment.max(256)
}

/// The window buffer: entry 0 = the single window, entry w + 1 = window w.
pub fn window_entries(n: usize, stride: u32) -> Vec<u32> {
    let words = (stride / 4) as usize;
    let mut v = vec![0u32; (n + 1) * words];
    v[1] = 1;
    for w in 0..n {
        v[(w + 1) * words] = w as u32;
    }
    v
}

/// Plans a matmul of m rows of x_vec4 vec4s each (`uniform`: the uniform-x variant is bound).
pub fn plan_x(m: u32, x_vec4: u32, uniform: bool, align: u32, win_stride: u32) -> XPlan {
    let cap = UNIFORM_X_VEC4 / x_vec4;
    if !uniform || cap == 0 {
        return XPlan::Storage { tile: tile_for_rows(m) };
    }
    if m <= cap {
        return XPlan::Uniform { tile: tile_for_rows(m), windows: vec![(0, 0, m)] };
    }
    // Several windows: the largest tile that fits one, windows a whole number of tiles (as
    // window_size in the shader computes it), each starting at an aligned offset.
    let tile = MATMUL_TILES.iter().rposition(|t| t.0 <= cap).unwrap_or(0);
    let tm = MATMUL_TILES[tile].0;
    let rows = cap / tm * tm;
    let bytes = rows * x_vec4 * 16;
    if !bytes.is_multiple_of(align) {
        return XPlan::Storage { tile: tile_for_rows(m) };
    }
    let windows = (0..m.div_ceil(rows)).map(|w| (w * bytes, (w + 1) * win_stride, rows.min(m - w * rows))).collect();
    XPlan::Uniform { tile, windows }
}

/// vec4s of the activation window a uniform-x matmul reads (64 KiB, the usual uniform limit).
pub const UNIFORM_X_VEC4: u32 = 4096;
pub const UNIFORM_X_BYTES: u64 = UNIFORM_X_VEC4 as u64 * 16;

/// The matmul program for a weight format and register tile. With `uniform_x`, the activations
/// are read through a uniform binding: every thread of a workgroup reads the same x values, which
/// llvmpipe then loads once per SIMD batch instead of once per lane (steps whose x fits 64 KiB).
pub fn matmul_source(f: WFormat, tm: u32, tn: u32, uniform_x: bool) -> String {
    let mut body = include_str!("../../shaders/matmul.wgsl").to_string();
    if uniform_x {
        body = body
            .replace(
                "@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;",
                &format!("@group(0) @binding(2) var<uniform> x: array<vec4<f32>, {UNIFORM_X_VEC4}>;"),
            )
            .replace("{{WINDOW}}", &WINDOW_UNIFORM.replace("{{UX}}", &UNIFORM_X_VEC4.to_string()));
    } else {
        body = body.replace("{{WINDOW}}", WINDOW_ALL);
    }
    let body = body
        .replace("{{TM}}", &tm.to_string())
        .replace("{{TN}}", &tn.to_string())
        .replace("{{WG}}", &MATMUL_WG.to_string());
    format!("{}\n{}\n{}\n{body}", common(), f.snippet(), matmul_common())
}

/// Reduction of matmul_gpu.wgsl's partial sums: subgroupAdd, then one value per subgroup
/// through workgroup memory.
const REDUCE_SUBGROUP: &str = "    for (var k = 0u; k < NV; k++) {
        let v = subgroupAdd(acc[k]);
        if (sid == 0u) {
            red[k * WG + sg] = v;
        }
    }
    workgroupBarrier();
    if (lid < NV) {
        var s = 0.0;
        for (var j = 0u; j < nsg; j++) {
            s += red[lid * WG + j];
        }
        red[lid * WG] = s;
    }";

/// The same through workgroup memory only (adapters without subgroups): a tree over the WG
/// invocations.
const REDUCE_WORKGROUP: &str = "    for (var k = 0u; k < NV; k++) {
        red[k * WG + lid] = acc[k];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            for (var k = 0u; k < NV; k++) {
                red[k * WG + lid] += red[k * WG + lid + s];
            }
        }
        workgroupBarrier();
    }";

/// Tokens per workgroup of the gpu profile's decode matmul variants (matmul_gpu.wgsl): a step
/// of m <= 8 rows uses the first TM >= m; larger steps use the tiled kernel.
pub const GPU_DECODE_TM: [u32; 4] = [1, 2, 4, 8];
/// Weight rows per workgroup of the decode kernel (gate+up rows for SwiGLU: half as many outputs).
pub const GPU_DECODE_NR: u32 = 4;
/// Tokens x weight rows of one tiled-kernel workgroup (matmul_tiled.wgsl).
pub const GPU_TILE: (u32, u32) = (32, 64);

/// The gpu profile's decode-sized matmul (see matmul_gpu.wgsl); `subgroups`: reduce with
/// subgroupAdd.
pub fn matmul_gpu_source(f: WFormat, tm: u32, swiglu: bool, subgroups: bool) -> String {
    let (args, reduce) = if subgroups {
        (
            "@builtin(subgroup_invocation_id) sid: u32,\n    @builtin(subgroup_id) sg: u32,\n    @builtin(num_subgroups) nsg: u32,",
            REDUCE_SUBGROUP,
        )
    } else {
        ("", REDUCE_WORKGROUP)
    };
    let body = include_str!("../../shaders/matmul_gpu.wgsl")
        .replace("{{TM}}", &tm.to_string())
        .replace("{{SWIGLU}}", if swiglu { "true" } else { "false" })
        .replace("{{SG_ARGS}}", args)
        .replace("{{REDUCE}}", reduce);
    format!("{}\n{}\n{}\n{body}", common(), f.snippet(), matmul_common())
}

/// The gpu profile's prefill-sized matmul (see matmul_tiled.wgsl).
pub fn matmul_tiled_source(f: WFormat, swiglu: bool) -> String {
    let body =
        include_str!("../../shaders/matmul_tiled.wgsl").replace("{{SWIGLU}}", if swiglu { "true" } else { "false" });
    format!("{}\n{}\n{}\n{body}", common(), f.snippet(), matmul_common())
}

/// The gpu profile's split-key attention for `group` query heads per KV head.
pub fn attention_split_source(head_dim: u32, group: u32, kv: KvDtype, kv_chunks: usize) -> String {
    let body = include_str!("../../shaders/attention_split.wgsl")
        .replace("{{HD4}}", &(head_dim / 4).to_string())
        .replace("{{G}}", &group.to_string())
        .replace("{{KV}}", &kv_snippet(kv, false, kv_chunks));
    format!("{}\n{}\n{body}", common(), super::shared::AttnParams::WGSL)
}

pub fn embed_source(f: WFormat) -> String {
    format!("{}\n{}\n{}", common(), f.snippet(), include_str!("../../shaders/embed.wgsl"))
}

pub fn attention_source(head_dim: u32, kv: KvDtype, kv_chunks: usize) -> String {
    let body = include_str!("../../shaders/attention.wgsl")
        .replace("{{HD4}}", &(head_dim / 4).to_string())
        .replace("{{KV}}", &kv_snippet(kv, false, kv_chunks));
    format!("{}\n{}\n{body}", common(), super::shared::AttnParams::WGSL)
}

pub fn rope_kv_source(kv: KvDtype, kv_chunks: usize) -> String {
    let body = include_str!("../../shaders/rope_kv.wgsl").replace("{{KV}}", &kv_snippet(kv, true, kv_chunks));
    format!("{}\n{body}", common())
}

pub fn plain_source(body: &str) -> String {
    format!("{}\n{body}", common())
}

pub const RMSNORM_WGSL: &str = include_str!("../../shaders/rmsnorm.wgsl");
pub const SAMPLE_WGSL: &str = include_str!("../../shaders/sample.wgsl");
pub const HEAD_NORM_WGSL: &str = include_str!("../../shaders/head_norm.wgsl");
pub const LOGIT_ADJUST_WGSL: &str = include_str!("../../shaders/logit_adjust.wgsl");
/// u32 words of per-row sampling parameters in the step metadata (see sample.wgsl).
pub const SAMPLE_PARAMS_STRIDE: usize = 16;
/// The logit a token mask gives every token it does not allow (structured outputs): below any
/// real logit, so neither the argmax nor a draw ever picks it (its probability is exp(-3e38)).
pub const MASKED_LOGIT: f32 = -3.0e38;
/// Word 11 of a row's sampling parameters when the row has no token mask.
pub const NO_MASK: u32 = u32::MAX;
/// Word 12 of a row's sampling parameters when the row samples (otherwise the token it reports).
pub const NO_FORCE: u32 = u32::MAX;

/// The sampler's shaders (sample.wgsl, logit_adjust.wgsl) with the constants they share with Rust.
pub fn sampler_source(body: &str) -> String {
    plain_source(&format!(
        "const MASKED_LOGIT: f32 = {MASKED_LOGIT:e};\nconst NO_MASK: u32 = {NO_MASK}u;\nconst NO_FORCE: u32 = {NO_FORCE}u;\n\
         const PARAMS_STRIDE: u32 = {SAMPLE_PARAMS_STRIDE}u;\n{body}"
    ))
}

/// Most top log-probabilities the sampler returns per row.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// u32 words the sampler writes per row: id, logprob, MAX_TOP_LOGPROBS (id, logprob) pairs.
pub const SAMPLE_RESULT_STRIDE: usize = 2 + 2 * MAX_TOP_LOGPROBS;

/// Every WGSL program the engine can build, with a label: what the naga test validates.
pub fn all_sources(head_dims: &[u32]) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for f in WFormat::ALL {
        for (tm, tn) in MATMUL_TILES {
            v.push((format!("matmul_{}_{tm}x{tn}", f.name()), matmul_source(f, tm, tn, false)));
            v.push((format!("matmul_{}_{tm}x{tn}_ux", f.name()), matmul_source(f, tm, tn, true)));
        }
        v.push((format!("embed_{}", f.name()), embed_source(f)));
        for swiglu in [false, true] {
            for tm in GPU_DECODE_TM {
                for sg in [false, true] {
                    v.push((
                        format!("matmul_gpu_{}_{tm}_{swiglu}_{sg}", f.name()),
                        matmul_gpu_source(f, tm, swiglu, sg),
                    ));
                }
            }
            v.push((format!("matmul_tiled_{}_{swiglu}", f.name()), matmul_tiled_source(f, swiglu)));
        }
    }
    for &d in head_dims {
        for group in [1, 3, 7, 8] {
            for chunks in [1, MAX_KV_CHUNKS] {
                v.push((
                    format!("attention_split_hd{d}_g{group}_x{chunks}"),
                    attention_split_source(d, group, KvDtype::F16, chunks),
                ));
            }
        }
    }
    for kv in [KvDtype::F16, KvDtype::F32] {
        for chunks in 1..=MAX_KV_CHUNKS {
            for &d in head_dims {
                v.push((format!("attention_hd{d}_{}_x{chunks}", kv.name()), attention_source(d, kv, chunks)));
            }
            v.push((format!("rope_kv_{}_x{chunks}", kv.name()), rope_kv_source(kv, chunks)));
        }
    }
    v.push(("rmsnorm".into(), plain_source(RMSNORM_WGSL)));
    v.push(("head_norm".into(), plain_source(HEAD_NORM_WGSL)));
    v.push(("sample".into(), sampler_source(SAMPLE_WGSL)));
    v.push(("logit_adjust".into(), sampler_source(LOGIT_ADJUST_WGSL)));
    v
}

#[derive(Clone, Copy)]
enum Slot {
    Uniform,
    /// A uniform bound with a dynamic offset.
    UniformDyn,
    Read,
    ReadWrite,
}

fn layout(gpu: &Gpu, slots: &[(u32, Slot)]) -> wgpu::BindGroupLayout {
    let entries: Vec<wgpu::BindGroupLayoutEntry> = slots
        .iter()
        .map(|&(binding, s)| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: match s {
                Slot::Uniform | Slot::UniformDyn => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: matches!(s, Slot::UniformDyn),
                    min_binding_size: None,
                },
                Slot::Read | Slot::ReadWrite => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: matches!(s, Slot::Read) },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
            },
            count: None,
        })
        .collect();
    gpu.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: None, entries: &entries })
}

/// A buffer bound whole, or its first max-storage-binding bytes where it is larger (an
/// activation buffer's padding for uniform windows; its rows were sized to fit).
fn whole<'a>(gpu: &Gpu, buf: &'a wgpu::Buffer) -> wgpu::BindingResource<'a> {
    let cap = gpu.device.limits().max_storage_buffer_binding_size & !15;
    if buf.size() > cap && buf.usage().contains(wgpu::BufferUsages::STORAGE) {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: buf,
            offset: 0,
            size: std::num::NonZeroU64::new(cap),
        })
    } else {
        buf.as_entire_binding()
    }
}

/// A pipeline family sharing one bind group layout, so one bind group serves every variant.
pub struct Family {
    pub layout: wgpu::BindGroupLayout,
    pipeline_layout: wgpu::PipelineLayout,
}

impl Family {
    fn new(gpu: &Gpu, slots: &[(u32, Slot)]) -> Family {
        let layout = layout(gpu, slots);
        let pipeline_layout = gpu.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: None,
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        Family { layout, pipeline_layout }
    }

    fn pipeline(&self, gpu: &Gpu, label: &str, source: &str, entry: &str) -> Result<wgpu::ComputePipeline> {
        super::validate_wgsl(label, source)?;
        let module = gpu.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        Ok(gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: Some(&self.pipeline_layout),
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: gpu.pipeline_cache.as_ref(),
        }))
    }

    /// Like `bind`, for the uniform-x family: binding 2 (x) is a UNIFORM_X_BYTES window and
    /// binding 7 one 16-byte window entry of `windows`, both placed by dynamic offsets.
    pub fn bind_uniform_x(
        &self,
        gpu: &Gpu,
        entries: &[(u32, &wgpu::Buffer)],
        windows: &wgpu::Buffer,
    ) -> wgpu::BindGroup {
        let window = |buffer, bytes| {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer,
                offset: 0,
                size: std::num::NonZeroU64::new(bytes),
            })
        };
        let entries: Vec<wgpu::BindGroupEntry> = entries
            .iter()
            .map(|(b, buf)| wgpu::BindGroupEntry {
                binding: *b,
                resource: if *b == 2 { window(buf, UNIFORM_X_BYTES) } else { whole(gpu, buf) },
            })
            .chain(std::iter::once(wgpu::BindGroupEntry { binding: 7, resource: window(windows, 16) }))
            .collect();
        gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &self.layout,
            entries: &entries,
        })
    }

    pub fn bind(&self, gpu: &Gpu, entries: &[(u32, &wgpu::Buffer)]) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> =
            entries.iter().map(|(b, buf)| wgpu::BindGroupEntry { binding: *b, resource: whole(gpu, buf) }).collect();
        gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &self.layout,
            entries: &entries,
        })
    }
}

pub struct MatmulPipelines {
    /// One per MATMUL_TILES entry.
    pub plain: Vec<wgpu::ComputePipeline>,
    /// Fused gate/up SwiGLU, one per MATMUL_TILES entry.
    pub swiglu: Vec<wgpu::ComputePipeline>,
    /// The same with x read through a uniform binding (matmul_u_family).
    pub plain_u: Vec<wgpu::ComputePipeline>,
    pub swiglu_u: Vec<wgpu::ComputePipeline>,
    pub embed: wgpu::ComputePipeline,
}

impl MatmulPipelines {
    pub fn get(&self, tile: usize, swiglu: bool, uniform_x: bool) -> &wgpu::ComputePipeline {
        match (swiglu, uniform_x) {
            (false, false) => &self.plain[tile],
            (true, false) => &self.swiglu[tile],
            (false, true) => &self.plain_u[tile],
            (true, true) => &self.swiglu_u[tile],
        }
    }
}

/// The gpu profile's matmuls of one weight format.
pub struct GpuMatmulPipelines {
    /// Decode-sized, one per GPU_DECODE_TM entry: [plain, swiglu].
    pub decode: Vec<[wgpu::ComputePipeline; 2]>,
    /// Prefill-sized tiles: [plain, swiglu].
    pub tiled: [wgpu::ComputePipeline; 2],
}

/// The gpu profile's kernels (built only for models that run it).
pub struct GpuPipelines {
    pub matmul: BTreeMap<WFormat, GpuMatmulPipelines>,
    /// Split-key attention and the merge of its splits (attn_family).
    pub attention: wgpu::ComputePipeline,
    pub combine: wgpu::ComputePipeline,
}

/// What a set of kernels is built for.
#[derive(Clone, Debug)]
pub struct KernelSpec {
    pub formats: Vec<WFormat>,
    pub head_dim: u32,
    /// Query heads per KV head (the split attention is built for it).
    pub group: u32,
    pub kv: KvDtype,
    pub kv_chunks: usize,
    /// `cpu` or `gpu` (`auto` counts as `cpu`).
    pub profile: KernelProfile,
}

/// All pipelines of one model: the weight-format-specific ones for the formats it uses.
pub struct Kernels {
    /// step(0) params(1) x(2) wq(3) ws(4) bias(5) y(6)
    pub matmul_family: Family,
    /// The same with binding 2 uniform (a UNIFORM_X_BYTES window of x).
    pub matmul_u_family: Family,
    pub matmul: BTreeMap<WFormat, MatmulPipelines>,
    /// step(0) params(1) x(2) weight(3) meta(4) y(5)
    pub norm_family: Family,
    pub rmsnorm: wgpu::ComputePipeline,
    /// step(0) params(1) weight(2) qkv(3)
    pub head_norm_family: Family,
    pub head_norm: wgpu::ComputePipeline,
    /// step(0) params(1) meta(2) cos_sin(3) qkv(4) k_cache(5) v_cache(6)
    pub rope_family: Family,
    pub rope_kv: wgpu::ComputePipeline,
    /// step(0) params(1) meta(2) qkv(3) k_cache(4) v_cache(5) out(6)
    pub attn_family: Family,
    pub attention: wgpu::ComputePipeline,
    /// step(0) params(1) meta(2) logits(3) result(4)
    pub sample_family: Family,
    pub sample: wgpu::ComputePipeline,
    /// Same layout as the sampler: step(0) params(1) meta(2) adj(3) logits(4)
    pub logit_adjust: wgpu::ComputePipeline,
    /// The KV-cache element type rope_kv and attention were built for.
    pub kv: KvDtype,
    /// Buffers per layer's K (and V) cache they bind.
    pub kv_chunks: usize,
    /// The gpu profile's kernels, when built for it.
    pub gpu: Option<GpuPipelines>,
}

impl Kernels {
    pub fn new(gpu: &Gpu, spec: &KernelSpec) -> Result<Kernels> {
        let KernelSpec { ref formats, head_dim, group, kv, kv_chunks, profile } = *spec;
        let kv_chunks = kv_chunks.clamp(1, MAX_KV_CHUNKS);
        use Slot::*;
        let matmul_family =
            Family::new(gpu, &[(0, Uniform), (1, Uniform), (2, Read), (3, Read), (4, Read), (5, Read), (6, ReadWrite)]);
        let matmul_u_family = Family::new(
            gpu,
            &[
                (0, Uniform),
                (1, Uniform),
                (2, UniformDyn),
                (3, Read),
                (4, Read),
                (5, Read),
                (6, ReadWrite),
                (7, UniformDyn),
            ],
        );
        let mut matmul = BTreeMap::new();
        for &f in formats.iter() {
            if matmul.contains_key(&f) {
                continue;
            }
            let n = f.name();
            let (mut plain, mut swiglu, mut plain_u, mut swiglu_u) = (vec![], vec![], vec![], vec![]);
            for (tm, tn) in MATMUL_TILES {
                let src = matmul_source(f, tm, tn, false);
                plain.push(matmul_family.pipeline(gpu, &format!("matmul_{n}_{tm}x{tn}"), &src, "main")?);
                swiglu.push(matmul_family.pipeline(gpu, &format!("swiglu_{n}_{tm}x{tn}"), &src, "main_swiglu")?);
                let src = matmul_source(f, tm, tn, true);
                plain_u.push(matmul_u_family.pipeline(gpu, &format!("matmul_{n}_{tm}x{tn}_ux"), &src, "main")?);
                swiglu_u.push(matmul_u_family.pipeline(
                    gpu,
                    &format!("swiglu_{n}_{tm}x{tn}_ux"),
                    &src,
                    "main_swiglu",
                )?);
            }
            let p = MatmulPipelines {
                plain,
                swiglu,
                plain_u,
                swiglu_u,
                embed: matmul_family.pipeline(gpu, &format!("embed_{n}"), &embed_source(f), "main")?,
            };
            matmul.insert(f, p);
        }
        let norm_family =
            Family::new(gpu, &[(0, Uniform), (1, Uniform), (2, Read), (3, Read), (4, Read), (5, ReadWrite)]);
        let rmsnorm = norm_family.pipeline(gpu, "rmsnorm", &plain_source(RMSNORM_WGSL), "main")?;
        let head_norm_family = Family::new(gpu, &[(0, Uniform), (1, Uniform), (2, Read), (3, ReadWrite)]);
        let head_norm = head_norm_family.pipeline(gpu, "head_norm", &plain_source(HEAD_NORM_WGSL), "main")?;
        // The KV cache's chunks beyond the first.
        let chunk_slots = |s: Slot| {
            (1..kv_chunks as u32).flat_map(move |c| [(KV_K_CHUNK_BINDING + c, s), (KV_V_CHUNK_BINDING + c, s)])
        };
        let mut rope_slots =
            vec![(0, Uniform), (1, Uniform), (2, Read), (3, Read), (4, ReadWrite), (5, ReadWrite), (6, ReadWrite)];
        rope_slots.extend(chunk_slots(ReadWrite));
        let rope_family = Family::new(gpu, &rope_slots);
        let rope_kv = rope_family.pipeline(gpu, "rope_kv", &rope_kv_source(kv, kv_chunks), "main")?;
        let mut attn_slots = vec![
            (0, Uniform),
            (1, Uniform),
            (2, Read),
            (3, Read),
            (4, Read),
            (5, Read),
            (6, ReadWrite),
            (7, ReadWrite),
        ];
        attn_slots.extend(chunk_slots(Read));
        let attn_family = Family::new(gpu, &attn_slots);
        let attention = attn_family.pipeline(gpu, "attention", &attention_source(head_dim, kv, kv_chunks), "main")?;
        let sample_family = Family::new(gpu, &[(0, Uniform), (1, Uniform), (2, Read), (3, Read), (4, ReadWrite)]);
        let sample = sample_family.pipeline(gpu, "sample", &sampler_source(SAMPLE_WGSL), "main")?;
        let logit_adjust = sample_family.pipeline(gpu, "logit_adjust", &sampler_source(LOGIT_ADJUST_WGSL), "main")?;
        let gpu_kernels = if profile == KernelProfile::Gpu {
            let mut matmul = BTreeMap::new();
            for &f in formats.iter() {
                if matmul.contains_key(&f) {
                    continue;
                }
                let n = f.name();
                let both = |make: &dyn Fn(bool) -> (String, String)| -> Result<[wgpu::ComputePipeline; 2]> {
                    let (l0, s0) = make(false);
                    let (l1, s1) = make(true);
                    Ok([matmul_family.pipeline(gpu, &l0, &s0, "main")?, matmul_family.pipeline(gpu, &l1, &s1, "main")?])
                };
                let decode = GPU_DECODE_TM
                    .iter()
                    .map(|&tm| {
                        both(&|sw| (format!("matmul_gpu_{n}_{tm}_{sw}"), matmul_gpu_source(f, tm, sw, gpu.subgroups)))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let tiled = both(&|sw| (format!("matmul_tiled_{n}_{sw}"), matmul_tiled_source(f, sw)))?;
                matmul.insert(f, GpuMatmulPipelines { decode, tiled });
            }
            let src = attention_split_source(head_dim, group.max(1), kv, kv_chunks);
            Some(GpuPipelines {
                matmul,
                attention: attn_family.pipeline(gpu, "attention_split", &src, "main")?,
                combine: attn_family.pipeline(gpu, "attention_combine", &src, "combine")?,
            })
        } else {
            None
        };
        Ok(Kernels {
            matmul_family,
            matmul_u_family,
            matmul,
            norm_family,
            rmsnorm,
            head_norm_family,
            head_norm,
            rope_family,
            rope_kv,
            attn_family,
            attention,
            sample_family,
            sample,
            logit_adjust,
            kv,
            kv_chunks,
            gpu: gpu_kernels,
        })
    }
}
