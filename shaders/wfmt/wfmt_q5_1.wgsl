// GGUF Q5_1, re-packed: per block 4 nibble words and 1 word of fifth bits; scale d and minimum
// m; x = q * d + m.
@group(0) @binding(3) var<storage, read> wq: array<u32>;
@group(0) @binding(4) var<storage, read> ws: array<vec2<f32>>;

struct Sc {
    dm: vec2<f32>,
    h: u32,
}

fn wscale(blk: u32) -> Sc {
    return Sc(ws[blk], wq[blk * 5u + 4u]);
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    let v = wq[blk * 5u + p];
    let lo = vec4<f32>(nib_lo(v) | (bits_lo(s.h, p) << vec4<u32>(4u)));
    let hi = vec4<f32>(nib_hi(v) | (bits_hi(s.h, p) << vec4<u32>(4u)));
    return Part(lo * s.dm.x + s.dm.y, hi * s.dm.x + s.dm.y);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): 5-bit codes times d, plus m times the sum of x.
const WMIN: bool = true;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    var e: array<vec4<f32>, 8>;
    for (var p = 0u; p < 4u; p++) {
        let v = wq[blk * 5u + p];
        e[p] = vec4<f32>(nib_lo(v) | (bits_lo(s.h, p) << vec4<u32>(4u)));
        e[4u + p] = vec4<f32>(nib_hi(v) | (bits_hi(s.h, p) << vec4<u32>(4u)));
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.dm.x, s.dm.x, s.dm.y, s.dm.y);
}

// The int8 path (matmul_gpu_xi8.wgsl): the codes as bytes (wcodes8) and their terms (wterms8:
// the halves' scales, then what multiplies the halves' sums of x).
fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    return fifth8(vec4<u32>(wq[blk * 5u], wq[blk * 5u + 1u], wq[blk * 5u + 2u], wq[blk * 5u + 3u]), s.h);
}

fn wterms8(s: Sc) -> vec4<f32> {
    return wterms(s);
}
