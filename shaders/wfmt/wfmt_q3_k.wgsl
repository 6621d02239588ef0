// GGUF Q3_K: 256-element super-blocks, a 6-bit scale per 16 elements (stored unpacked as signed
// bytes, minus 32). Quants per 32-element block: 2 pair words (low 2 bits) and 1 bit word (the
// third bit). Scale record per super-block (5 words): d (f32 bits), 16 signed scales as bytes.
// x = (q - 4) * (d * scale).
@group(0) @binding(3) var<storage, read> wq: array<u32>;
@group(0) @binding(4) var<storage, read> ws: array<u32>;

struct Sc {
    dlo: f32,
    dhi: f32,
    e: vec2<u32>,
    h: u32,
}

fn wscale(blk: u32) -> Sc {
    let d = k16_scales(blk);
    let q = blk * 3u;
    return Sc(d.x, d.y, vec2<u32>(wq[q], wq[q + 1u]), wq[q + 2u]);
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    let e = pair_bits(s.e, p);
    let lo = vec4<i32>(pairs_lo(e) | (bits_lo(s.h, p) << vec4<u32>(2u))) - vec4<i32>(4);
    let hi = vec4<i32>(pairs_hi(e) | (bits_hi(s.h, p) << vec4<u32>(2u))) - vec4<i32>(4);
    return Part(vec4<f32>(lo) * s.dlo, vec4<f32>(hi) * s.dhi);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): 3-bit codes - 4 (in integers), times each half's d * scale.
const WMIN: bool = false;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    var e: array<vec4<f32>, 8>;
    for (var p = 0u; p < 4u; p++) {
        let b = pair_bits(s.e, p);
        e[p] = vec4<f32>(vec4<i32>(pairs_lo(b) | (bits_lo(s.h, p) << vec4<u32>(2u))) - vec4<i32>(4));
        e[4u + p] = vec4<f32>(vec4<i32>(pairs_hi(b) | (bits_hi(s.h, p) << vec4<u32>(2u))) - vec4<i32>(4));
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.dlo, s.dhi, 0.0, 0.0);
}

// The int8 path (matmul_gpu_xi8.wgsl): the codes as bytes (wcodes8) and their terms (wterms8:
// the halves' scales, then what multiplies the halves' sums of x):
// 3-bit codes, the offset -4 applied through the sums.
fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    var e = pairs8(s.e);
    for (var p = 0u; p < 4u; p++) {
        e[p] |= spread4(s.h >> (8u * p)) << 2u;
        e[4u + p] |= spread4(s.h >> (8u * p + 4u)) << 2u;
    }
    return e;
}

fn wterms8(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.dlo, s.dhi, -4.0 * s.dlo, -4.0 * s.dhi);
}
