//! The KV cache as the kernels bind it: a layer's cache larger than one storage binding spans
//! several buffers (chunks) of whole KV blocks; RoPE writes it and attention reads it through
//! the accessors `kv_snippet` writes, and both bind its chunks with `kv_entries`.

use crate::config::KvDtype;
use crate::gpu::family::Slot;

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
pub(super) fn kv_snippet(kv: KvDtype, write: bool, chunks: usize) -> String {
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

/// Bind entries plus a layer's KV-cache chunks: chunk 0 at `first` (K, V), chunk c >= 1 at
/// KV_K_CHUNK_BINDING + c and KV_V_CHUNK_BINDING + c.
pub(crate) fn kv_entries<'a>(
    mut entries: Vec<(u32, &'a wgpu::Buffer)>,
    first: (u32, u32),
    k: &'a [wgpu::Buffer],
    v: &'a [wgpu::Buffer],
) -> Vec<(u32, &'a wgpu::Buffer)> {
    for (c, (kb, vb)) in k.iter().zip(v).enumerate() {
        let c = c as u32;
        let (ki, vi) = if c == 0 { first } else { (KV_K_CHUNK_BINDING + c, KV_V_CHUNK_BINDING + c) };
        entries.extend([(ki, kb), (vi, vb)]);
    }
    entries
}

/// The bind-group slots of a layer's KV-cache chunks beyond the first, with access `s`.
pub(crate) fn chunk_slots(kv_chunks: usize, s: Slot) -> impl Iterator<Item = (u32, Slot)> {
    (1..kv_chunks as u32).flat_map(move |c| [(KV_K_CHUNK_BINDING + c, s), (KV_V_CHUNK_BINDING + c, s)])
}
