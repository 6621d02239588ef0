//! Every WGSL program, assembled with `Shader` from the files in shaders/ and the shared
//! declarations of gpu/shared.rs: the matmul variants per weight format and tile, attention,
//! RoPE + KV write, norms and the sampler.

use super::kernels::{GPU_DECODE_TM, MATMUL_TILES, MATMUL_WG, UNIFORM_X_VEC4};
pub use super::moe::{moe_route_source, moe_source, moe_tiled_source};
use crate::config::KvDtype;
use crate::gpu::coop::CoopShape;
use crate::gpu::shader::Shader;
use crate::gpu::wformat::{WFormat, XQuant};
use anyhow::Result;

/// Binding of chunk c >= 1 of a layer's K cache (chunk 0 keeps the kernel's own binding); V
/// chunks at KV_V_CHUNK_BINDING + c. A layer's cache larger than one storage binding spans
/// several buffers of whole KV blocks.
pub const KV_K_CHUNK_BINDING: u32 = 10;
pub const KV_V_CHUNK_BINDING: u32 = 20;
pub use crate::gpu::MAX_KV_CHUNKS;

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
            // Beyond f16's range a value is clamped to it (the largest finite half), not turned
            // into an infinity that would poison every later attention score.
            (KvDtype::F16, true) => {
                format!("{name}_cache{c}[j / 2u] = pack2x16float(clamp(v, vec2<f32>(-F16_MAX), vec2<f32>(F16_MAX)));")
            }
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
pub(super) fn common() -> String {
    format!("{}\n{COMMON}", crate::gpu::shared::wgsl_common())
}

/// The matmul shaders' shared part after the weight format: MatParams, its flags, bindings and
/// epilogue.
fn matmul_common() -> String {
    format!("{}\n{}", super::matmul::wgsl_matmul(), include_str!("../../shaders/matmul_common.wgsl"))
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

/// The matmul program for a weight format and register tile. With `uniform_x`, the activations
/// are read through a uniform binding: every thread of a workgroup reads the same x values, which
/// llvmpipe then loads once per SIMD batch instead of once per lane (steps whose x fits 64 KiB).
pub fn matmul_source(f: WFormat, tm: u32, tn: u32, uniform_x: bool) -> Result<String> {
    let (x, window) = if uniform_x {
        (format!("@group(0) @binding(2) var<uniform> x: array<vec4<f32>, {UNIFORM_X_VEC4}>;"), WINDOW_UNIFORM)
    } else {
        ("@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;".to_string(), WINDOW_ALL)
    };
    matmul_shader(Shader::new(format!("matmul_{}_{tm}x{tn}", f.name()), include_str!("../../shaders/matmul.wgsl")), f)
        .fill("X_BINDING", x)
        .fill("WINDOW", window)
        .fill_if(uniform_x, "UX", UNIFORM_X_VEC4)
        .fill("TM", tm)
        .fill("TN", tn)
        .fill("WG", MATMUL_WG)
        .build()
}

/// A matmul template after the shared declarations, the format's snippet and the matmul epilogue
/// (and after the parts `shader` has already, such as `enable` directives).
pub(super) fn matmul_shader(shader: Shader, f: WFormat) -> Shader {
    shader.after(common()).after(f.snippet()).after(matmul_common())
}

/// Reduction of matmul_gpu.wgsl's partial sums into `tot`: subgroupAdd, then one value per
/// subgroup through workgroup memory (at most 16 subgroups: subgroups have 4 lanes or more).
const RED_SUBGROUP: &str = "var<workgroup> red: array<f32, NV * 16u>;";
const REDUCE_SUBGROUP: &str = "    for (var k = 0u; k < NV; k++) {
        let v = subgroupAdd(acc[k]);
        if (sid == 0u) {
            red[k * 16u + sg] = v;
        }
    }
    workgroupBarrier();
    if (lid < NV) {
        var s = 0.0;
        for (var j = 0u; j < nsg; j++) {
            s += red[lid * 16u + j];
        }
        tot[lid] = s;
    }";

/// The same through workgroup memory only (adapters without subgroups): a tree over the WG
/// invocations for RB outputs at a time (RB * WG floats of workgroup memory).
const RED_WORKGROUP: &str = "const RB: u32 = min(NV, 32u);
var<workgroup> red: array<f32, RB * WG>;";
const REDUCE_WORKGROUP: &str = "    for (var k0 = 0u; k0 < NV; k0 += RB) {
        for (var k = 0u; k < RB; k++) {
            red[k * WG + lid] = acc[k0 + k];
        }
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s = s / 2u) {
            if (lid < s) {
                for (var k = 0u; k < RB; k++) {
                    red[k * WG + lid] += red[k * WG + lid + s];
                }
            }
            workgroupBarrier();
        }
        if (lid < RB) {
            tot[k0 + lid] = red[lid * WG];
        }
        workgroupBarrier();
    }";

/// The gpu profile's decode-sized matmul for `tm` tokens per workgroup: matmul_gpu.wgsl for one
/// (`subgroups`: reduce with subgroupAdd), matmul_gpu_tokens.wgsl for more (one weight row per
/// 16 invocations, so that the tokens' x values are never all live at once).
pub fn matmul_gpu_source(f: WFormat, tm: u32, swiglu: bool, subgroups: bool) -> Result<String> {
    if tm > 1 {
        let template = include_str!("../../shaders/matmul_gpu_tokens.wgsl");
        return matmul_shader(Shader::new(format!("matmul_gpu_{}_{tm}", f.name()), template), f)
            .fill("TM", tm)
            .fill("SWIGLU", swiglu)
            .build();
    }
    one_token_source(
        format!("matmul_gpu_{}_{tm}", f.name()),
        f,
        include_str!("../../shaders/matmul_gpu_xf32.wgsl"),
        "",
        swiglu,
        subgroups,
    )
    .build()
}

/// The gpu profile's one-token decode matmul on int8 activations (matmul_gpu_xi8.wgsl; the
/// formats with `WFormat::has_int8`), after quantize_x8_source's kernel.
/// The table formats (IQ4_NL, IQ4_XS, MXFP4) add wfmt_table_codes8.wgsl: their codes through a
/// workgroup table that each workgroup fills first.
pub fn matmul_gpu_i8_source(f: WFormat, swiglu: bool, subgroups: bool) -> Result<String> {
    let xi8 = include_str!("../../shaders/matmul_gpu_xi8.wgsl");
    let (x_part, prep) = if f.table().is_some() {
        let codes8 = include_str!("../../shaders/wfmt_table_codes8.wgsl");
        (format!("{xi8}\n{codes8}"), "    wprep(lid);\n    workgroupBarrier();")
    } else {
        (xi8.to_string(), "")
    };
    one_token_source(format!("matmul_gpu_i8_{}", f.name()), f, &x_part, prep, swiglu, subgroups).build()
}

/// matmul_gpu.wgsl for one token with its X part (how it reads x) and PREP (what every
/// invocation does before the loop over K); the X part's own placeholders are the caller's.
fn one_token_source(label: String, f: WFormat, x_part: &str, prep: &str, swiglu: bool, subgroups: bool) -> Shader {
    let (args, decl, reduce) =
        if subgroups { (SG_ARGS, RED_SUBGROUP, REDUCE_SUBGROUP) } else { ("", RED_WORKGROUP, REDUCE_WORKGROUP) };
    matmul_shader(Shader::new(label, include_str!("../../shaders/matmul_gpu.wgsl")), f)
        .fill("X", x_part)
        .fill("PREP", prep)
        .fill("TM", 1)
        .fill("SWIGLU", swiglu)
        .fill("SG_ARGS", args)
        .fill("RED_DECL", decl)
        .fill("REDUCE", reduce)
}

/// The quantization of a matmul's activations to int8 blocks (quantize_x8.wgsl), as `xq` says
/// (`WFormat::int8_x`).
pub fn quantize_x8_source(xq: XQuant) -> Result<String> {
    Shader::new(quantize_x8_label(xq), include_str!("../../shaders/quantize_x8.wgsl"))
        .after(crate::gpu::shared::wgsl_common())
        .after(super::matmul::wgsl_matmul())
        .fill("GROUP", xq.group())
        .fill("WHOLE", xq == XQuant::Q8_1)
        .build()
}

/// quantize_x8's pipeline label for `xq` (quantize_x8_q8_0, _q8_1, _q8k).
pub(super) fn quantize_x8_label(xq: XQuant) -> String {
    format!("quantize_x8_{}", format!("{xq:?}").to_lowercase())
}

pub(super) const TILE_LOAD: &str = include_str!("../../shaders/matmul_tile_load.wgsl");
pub(super) const TILE_ROW: &str = include_str!("../../shaders/matmul_tile_row.wgsl");
/// The prefill-sized matmul on cooperative matrices of `shape` (see matmul_coop.wgsl and
/// gpu::coop): the `enable` directives first, then the usual parts.
pub fn matmul_coop_source(f: WFormat, swiglu: bool, shape: CoopShape) -> Result<String> {
    let enables =
        if shape.f16 { "enable f16;\nenable wgpu_cooperative_matrix;" } else { "enable wgpu_cooperative_matrix;" };
    let to_ab = if shape.f16 { "return f16(clamp(v, -65504.0, 65504.0));" } else { "return v;" };
    let body = include_str!("../../shaders/matmul_coop.wgsl");
    Shader::new(format!("matmul_coop_{}_{}", f.name(), shape.side), body)
        .after(enables)
        .after(common())
        .after(f.snippet())
        .after(matmul_common())
        .after(TILE_LOAD)
        .after(TILE_ROW)
        .fill("MS", shape.side)
        .fill("SG", shape.subgroup)
        .fill("AB", if shape.f16 { "f16" } else { "f32" })
        .fill("TO_AB", to_ab)
        .fill("SWIGLU", swiglu)
        .build()
}

/// Every cooperative-matrix GEMM the engine can build (each format, SwiGLU or not, the shapes
/// gpu::coop chooses), with a label: what the naga and SPIR-V test checks.
pub fn coop_sources() -> Vec<(String, String)> {
    let shapes = [(16, true, 32), (16, true, 64), (16, true, 16), (8, false, 32), (8, false, 16)];
    let mut v = Vec::new();
    for f in WFormat::ALL {
        for (side, f16, subgroup) in shapes {
            for swiglu in [false, true] {
                let shape = CoopShape { side, f16, subgroup };
                let label = format!("matmul_coop_{}_{side}_{subgroup}_{swiglu}", f.name());
                let src = matmul_coop_source(f, swiglu, shape).unwrap_or_else(|e| panic!("{label}: {e:#}"));
                v.push((label, src));
            }
        }
    }
    v
}

/// Keys per tile of the split and the tiled attention (one per invocation of their workgroups).
const ATTN_KT: u32 = 64;

/// The tile softmax's state, for G rows (query heads, or a tile's tokens times heads): the
/// tile's exponentials and each row's running max, sum and correction.
const SOFTMAX_STATE_DECL: &str = "var<workgroup> sc: array<f32, G * KT>;
var<workgroup> mstat: array<f32, G>;
var<workgroup> lstat: array<f32, G>;
var<workgroup> corr: array<f32, G>;";

/// The attention tile softmax (split and tiled kernels) with subgroup reductions: the tile's
/// max per row (subgroupMax, then one value per subgroup), every invocation's exponential,
/// their sum per row (subgroupAdd), then G invocations update the running statistics.
const SOFTMAX_SUBGROUP_DECL: &str = "var<workgroup> red_max: array<f32, G * 16u>;
var<workgroup> red_sum: array<f32, G * 16u>;";
const SOFTMAX_SUBGROUP: &str = "        for (var h = 0u; h < G; h++) {
            let v = subgroupMax(sh[h]);
            if (sid == 0u) {
                red_max[h * 16u + sg] = v;
            }
        }
        workgroupBarrier();
        for (var h = 0u; h < G; h++) {
            var mx = mstat[h];
            for (var q = 0u; q < nsg; q++) {
                mx = max(mx, red_max[h * 16u + q]);
            }
            let e = select(0.0, exp(sh[h] - mx), j < ke && sh[h] > -1.0e38);
            sc[h * KT + lid] = e;
            let v = subgroupAdd(e);
            if (sid == 0u) {
                red_sum[h * 16u + sg] = v;
            }
        }
        workgroupBarrier();
        if (lid < G) {
            var mx = mstat[lid];
            var sum = 0.0;
            for (var q = 0u; q < nsg; q++) {
                mx = max(mx, red_max[lid * 16u + q]);
                sum += red_sum[lid * 16u + q];
            }
            let c = exp(mstat[lid] - mx);
            corr[lid] = c;
            lstat[lid] = lstat[lid] * c + sum;
            mstat[lid] = mx;
        }
        workgroupBarrier();";

/// The same without subgroups: G invocations each walk their head's KT scores.
const SOFTMAX_WORKGROUP: &str = "        for (var h = 0u; h < G; h++) {
            sc[h * KT + lid] = sh[h];
        }
        workgroupBarrier();
        if (lid < G) {
            var mx = mstat[lid];
            for (var i = 0u; i < KT; i++) {
                mx = max(mx, sc[lid * KT + i]);
            }
            let c = exp(mstat[lid] - mx);
            var sum = 0.0;
            for (var i = 0u; i < KT; i++) {
                let x = sc[lid * KT + i];
                let e = select(0.0, exp(x - mx), tile + i < ke && x > -1.0e38);
                sc[lid * KT + i] = e;
                sum += e;
            }
            corr[lid] = c;
            lstat[lid] = lstat[lid] * c + sum;
            mstat[lid] = mx;
        }
        workgroupBarrier();";

/// The builtins of a subgroup reduction.
const SG_ARGS: &str =
    "@builtin(subgroup_invocation_id) sid: u32,\n    @builtin(subgroup_id) sg: u32,\n    @builtin(num_subgroups) nsg: u32,";

/// An attention kernel with the tile softmax (the split and the tiled one), its shared parts
/// filled: HD4, the KV cache's loads, and the softmax with subgroup reductions (`subgroups`) or
/// through workgroup memory.
fn tile_softmax_attention(
    label: &str,
    body: &str,
    head_dim: u32,
    kv: KvDtype,
    kv_chunks: usize,
    subgroups: bool,
) -> Shader {
    let (args, decl, softmax) =
        if subgroups { (SG_ARGS, SOFTMAX_SUBGROUP_DECL, SOFTMAX_SUBGROUP) } else { ("", "", SOFTMAX_WORKGROUP) };
    Shader::new(label, body)
        .after(common())
        .after(super::attention::AttnParams::WGSL)
        .after(super::attention::WGSL_SCORE)
        .fill("HD4", head_dim / 4)
        .fill("KT", ATTN_KT)
        .fill("KV", kv_snippet(kv, false, kv_chunks))
        .fill("SG_ARGS", args)
        .fill("SOFTMAX_DECL", format!("{SOFTMAX_STATE_DECL}\n{decl}"))
        .fill("SOFTMAX", softmax)
}

/// The gpu profile's split-key attention for `group` query heads per KV head; `subgroups`: the
/// tile softmax reduces with subgroup operations.
pub fn attention_split_source(
    head_dim: u32,
    group: u32,
    kv: KvDtype,
    kv_chunks: usize,
    subgroups: bool,
) -> Result<String> {
    let body = include_str!("../../shaders/attention_split.wgsl");
    tile_softmax_attention("attention_split", body, head_dim, kv, kv_chunks, subgroups).fill("G", group).build()
}

/// Workgroup memory the tiled attention may use (WebGPU's guaranteed minimum).
const TILED_ATTN_WG_BYTES: u32 = 16384;
/// Most tokens per tile of the tiled attention.
pub const TILED_ATTN_MAX_QT: u32 = 16;

/// Tokens per query tile of the gpu profile's tiled (prefill) attention for `group` query heads
/// per KV head: as many as fit the workgroup memory (queries, scores, statistics, the subgroup
/// reductions' arrays) up to TILED_ATTN_MAX_QT rows; 0 when not even one token's rows fit or a
/// tile would have one token only (the split kernel is then as good).
pub fn tiled_attention_tokens(head_dim: u32, group: u32, subgroups: bool) -> u32 {
    let kt = ATTN_KT;
    let per_row = head_dim * 4 + kt * 4 + 3 * 4 + if subgroups { 2 * 16 * 4 } else { 0 };
    let per_token = 2 * 4 + group.max(1) * per_row;
    let fit = (TILED_ATTN_WG_BYTES - kt * 4) / per_token;
    let qt = fit.min(TILED_ATTN_MAX_QT / group.max(1));
    if qt >= 2 {
        qt
    } else {
        0
    }
}

/// The gpu profile's query-tiled attention (`qt` tokens per tile, from `tiled_attention_tokens`).
pub fn attention_tiled_source(
    head_dim: u32,
    group: u32,
    qt: u32,
    kv: KvDtype,
    kv_chunks: usize,
    subgroups: bool,
) -> Result<String> {
    let body = include_str!("../../shaders/attention_tiled.wgsl");
    tile_softmax_attention("attention_tiled", body, head_dim, kv, kv_chunks, subgroups)
        .fill("GQ", group.max(1))
        .fill("QT", qt)
        .build()
}

pub fn embed_source(f: WFormat) -> Result<String> {
    Shader::new(format!("embed_{}", f.name()), include_str!("../../shaders/embed.wgsl"))
        .after(common())
        .after(super::matmul::EmbedParams::WGSL)
        .after(f.snippet())
        .build()
}

pub fn attention_source(head_dim: u32, kv: KvDtype, kv_chunks: usize) -> Result<String> {
    // One statement per vec4 of the head (see the shader: llvmpipe's loop-iteration limit).
    Shader::new("attention", include_str!("../../shaders/attention.wgsl"))
        .after(common())
        .after(super::attention::AttnParams::WGSL)
        .after(super::attention::WGSL_SCORE)
        .fill("SCORE", unrolled(head_dim / 4, 2, "s4 += q[{i}] * load_k(kb + {i});"))
        .fill("ACCUM", unrolled(head_dim / 4, 2, "acc[{i}] = acc[{i}] * corr + e * load_v(kb + {i});"))
        .fill("HD4", head_dim / 4)
        .fill("KV", kv_snippet(kv, false, kv_chunks))
        .build()
}

/// `line` written out `n` times, `{i}` and `{i+1}` replaced by the copy's index (and the next)
/// as u32 literals, each indented by `depth` levels: a loop with no loop iteration, for the
/// kernels that must stay within llvmpipe's loop-iteration limit (65535 iterations per
/// invocation in total, after which every loop stops silently).
pub(crate) fn unrolled(n: u32, depth: usize, line: &str) -> String {
    let indent = "    ".repeat(depth);
    (0..n)
        .map(|i| {
            format!("{indent}{}\n", line.replace("{i}", &format!("{i}u")).replace("{i+1}", &format!("{}u", i + 1)))
        })
        .collect()
}

pub fn rope_kv_source(kv: KvDtype, kv_chunks: usize) -> Result<String> {
    Shader::new("rope_kv", include_str!("../../shaders/rope_kv.wgsl"))
        .after(common())
        .after(super::rope::RopeParams::WGSL)
        .fill("KV", kv_snippet(kv, true, kv_chunks))
        .build()
}

pub fn rmsnorm_source() -> Result<String> {
    Shader::new("rmsnorm", RMSNORM_WGSL).after(common()).after(super::norm::NormParams::WGSL).build()
}

/// delta.wgsl and delta_chunk.wgsl for keys of `k_dim`; `chunked`: sequences of chunk_min()
/// tokens or more take the chunked form (else every sequence the per-token recurrence). The
/// per-token loops' inner loops (the state's k_dim rows, the convolution's taps) are written out
/// (the shader's LOOP_NOTE).
pub fn delta_source(k_dim: u32, chunked: bool) -> Result<String> {
    let body = [include_str!("../../shaders/delta.wgsl"), include_str!("../../shaders/delta_chunk.wgsl")].join("\n");
    let taps = super::delta::MAX_CONV_TAPS;
    // The state's rows: read (from zero on a reset) and copied to the backup, decayed and read
    // against k, updated and read against q, copied to a snapshot, written back.
    let load = unrolled(k_dim, 1, "col[{i}] = select(rec_state[lbase + {i} * p.v_dim], 0.0, reset);");
    let backup = unrolled(k_dim, 2, "rec_state[bbase + {i} * p.v_dim] = col[{i}];");
    // The convolution's taps, statement j under j < taps; the shift puts the input last.
    let conv_load = "if ({i} < taps) { hist[{i}] = select(conv_state[lbase + {i} * conv_dim], 0.0, reset); \
                     if (backup) { conv_state[bbase + {i} * conv_dim] = hist[{i}]; } }";
    let shift = "if ({i+1} < taps) { hist[{i}] = hist[{i+1}]; } else if ({i+1} == taps) { hist[{i}] = v; }";
    Shader::new("delta", &body)
        .after(common())
        .after(super::delta::DeltaParams::WGSL)
        .fill("DK", k_dim)
        .fill("REC_LOAD", format!("{load}    if (backup) {{\n{backup}    }}"))
        .fill("REC_DECAY", unrolled(k_dim, 2, "col[{i}] *= decay; kv += col[{i}] * x[kb + {i}];"))
        .fill("REC_UPDATE", unrolled(k_dim, 2, "col[{i}] += x[kb + {i}] * delta; o += col[{i}] * x[qb + {i}];"))
        .fill("REC_SNAP", unrolled(k_dim, 3, "rec_state[nb + {i} * p.v_dim] = col[{i}];"))
        .fill("REC_STORE", unrolled(k_dim, 1, "rec_state[sbase + {i} * p.v_dim] = col[{i}];"))
        .fill("CONV_LOAD", unrolled(taps, 1, conv_load))
        .fill("CONV_ACC", unrolled(taps, 2, "if ({i} < taps) { acc += w[wb + {i}] * hist[{i}]; }"))
        .fill("CONV_SHIFT", unrolled(taps, 2, shift))
        .fill("CONV_SNAP", unrolled(taps, 3, "if ({i} < taps) { conv_state[nb + {i} * conv_dim] = hist[{i}]; }"))
        .fill("CONV_STORE", unrolled(taps, 1, "if ({i} < taps) { conv_state[sbase + {i} * conv_dim] = hist[{i}]; }"))
        .fill("CH", super::delta::CHUNK)
        .fill("CHUNK_MIN", if chunked { super::delta::chunk_min() as u32 } else { u32::MAX })
        .fill("CB", super::delta::CHUNK_COLS)
        .build()
}

pub fn head_norm_source() -> Result<String> {
    Shader::new("head_norm", HEAD_NORM_WGSL).after(common()).after(super::norm::HeadNormParams::WGSL).build()
}

pub const RMSNORM_WGSL: &str = include_str!("../../shaders/rmsnorm.wgsl");
/// Invocations per row of the sampler, in both profiles: on a GPU many loads in flight for one
/// row's logits; on llvmpipe each invocation's share of a row small enough that its sweeps (two
/// for the maximum and the sum, up to four per histogram threshold, one per top log-probability)
/// stay within the loop limit (`Gpu::loop_limit`), which 64 per row passed at Qwen's vocabulary.
pub const SAMPLE_WG: u32 = 256;
pub const SAMPLE_WGSL: &str = include_str!("../../shaders/sample.wgsl");
pub const HEAD_NORM_WGSL: &str = include_str!("../../shaders/head_norm.wgsl");
pub const PLE_WGSL: &str = include_str!("../../shaders/ple.wgsl");

pub fn ple_source() -> Result<String> {
    Shader::new("ple", PLE_WGSL).after(common()).after(super::ple::PleParams::WGSL).build()
}
pub const LOGIT_ADJUST_WGSL: &str = include_str!("../../shaders/logit_adjust.wgsl");
/// The sampler's shaders (sample.wgsl, logit_adjust.wgsl) with the constants they share with Rust.
pub fn sampler_source(label: &str, body: &str) -> Shader {
    Shader::new(label, body)
        .after(common())
        .after(super::sample::SamplerParams::WGSL)
        .after(crate::sampling::row::wgsl_constants())
}

/// The sampler (both profiles): SAMPLE_WG invocations per row, its top-k / top-p thresholds by
/// histogram (sample_hist.wgsl). The cpu profile's earlier one (64 per row, 32 bisection sweeps
/// per threshold) overran llvmpipe's loop limit at Qwen's vocabulary, and was slower there.
pub fn sample_source() -> Result<String> {
    sampler_source("sample", SAMPLE_WGSL)
        .after(include_str!("../../shaders/sample_hist.wgsl"))
        .fill("WG", SAMPLE_WG)
        .build()
}

/// The logit adjustment kernel (logit_adjust.wgsl).
pub fn logit_adjust_source() -> Result<String> {
    sampler_source("logit_adjust", LOGIT_ADJUST_WGSL).build()
}

/// Every WGSL program the engine can build, with a label: what the naga test validates.
/// Panics on a template that does not assemble (for tests and tools).
pub fn all_sources(head_dims: &[u32]) -> Vec<(String, String)> {
    let mut v: Vec<(String, Result<String>)> = Vec::new();
    for f in WFormat::ALL {
        for (tm, tn) in MATMUL_TILES {
            v.push((format!("matmul_{}_{tm}x{tn}", f.name()), matmul_source(f, tm, tn, false)));
            v.push((format!("matmul_{}_{tm}x{tn}_ux", f.name()), matmul_source(f, tm, tn, true)));
        }
        v.push((format!("embed_{}", f.name()), embed_source(f)));
        v.push((format!("moe_{}", f.name()), moe_source(f)));
        for gu in [false, true] {
            v.push((format!("moe_tiled_{}_{gu}", f.name()), moe_tiled_source(f, gu)));
        }
        for swiglu in [false, true] {
            for tm in GPU_DECODE_TM {
                for sg in [false, true] {
                    v.push((
                        format!("matmul_gpu_{}_{tm}_{swiglu}_{sg}", f.name()),
                        matmul_gpu_source(f, tm, swiglu, sg),
                    ));
                }
            }
            if f.has_int8() {
                for sg in [false, true] {
                    v.push((format!("matmul_gpu_i8_{}_{swiglu}_{sg}", f.name()), matmul_gpu_i8_source(f, swiglu, sg)));
                }
            }
            for k in super::gemm::GemmKernel::TILES {
                if let super::gemm::GemmKernel::Tile { bm, f16 } = k {
                    let src = super::gemm::matmul_tiled_source(f, swiglu, bm, f16);
                    v.push((format!("matmul_{}_{}_{swiglu}", k.name(), f.name()), src));
                }
            }
        }
    }
    for xq in XQuant::ALL {
        v.push((quantize_x8_label(xq), quantize_x8_source(xq)));
    }
    for &d in head_dims {
        for group in [1, 3, 7, 8] {
            for chunks in [1, MAX_KV_CHUNKS] {
                for sg in [false, true] {
                    v.push((
                        format!("attention_split_hd{d}_g{group}_x{chunks}_{sg}"),
                        attention_split_source(d, group, KvDtype::F16, chunks, sg),
                    ));
                    let qt = tiled_attention_tokens(d, group, sg);
                    if qt > 0 {
                        v.push((
                            format!("attention_tiled_hd{d}_g{group}_x{chunks}_{sg}"),
                            attention_tiled_source(d, group, qt, KvDtype::F16, chunks, sg),
                        ));
                    }
                }
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
    v.push(("rmsnorm".into(), rmsnorm_source()));
    v.push(("head_norm".into(), head_norm_source()));
    v.push(("ple".into(), ple_source()));
    v.push(("delta".into(), delta_source(128, false)));
    v.push(("delta_chunked".into(), delta_source(128, true)));
    v.push(("delta_256".into(), delta_source(256, false)));
    v.push(("sample".into(), sample_source()));
    v.push(("logit_adjust".into(), logit_adjust_source()));
    v.push(("moe_route".into(), moe_route_source()));
    // Tests and tools: an assembly error is a bug in a template, named here.
    v.into_iter().map(|(l, s)| (s.unwrap_or_else(|e| panic!("{l}: {e:#}")), l)).map(|(s, l)| (l, s)).collect()
}
