// GGUF Q5_0, re-packed: per block 4 nibble words and 1 word of fifth bits; one scale d;
// x = (q - 16) * d.
@group(0) @binding(3) var<storage, read> wq: array<u32>;
@group(0) @binding(4) var<storage, read> ws: array<f32>;

struct Sc {
    d: f32,
    h: u32,
}

fn wscale(blk: u32) -> Sc {
    return Sc(ws[blk], wq[blk * 5u + 4u]);
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    let v = wq[blk * 5u + p];
    let lo = vec4<i32>(nib_lo(v) | (bits_lo(s.h, p) << vec4<u32>(4u))) - vec4<i32>(16);
    let hi = vec4<i32>(nib_hi(v) | (bits_hi(s.h, p) << vec4<u32>(4u))) - vec4<i32>(16);
    return Part(vec4<f32>(lo) * s.d, vec4<f32>(hi) * s.d);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): 5-bit codes - 16 (in integers), times d.
const WMIN: bool = false;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    var e: array<vec4<f32>, 8>;
    for (var p = 0u; p < 4u; p++) {
        let v = wq[blk * 5u + p];
        e[p] = vec4<f32>(vec4<i32>(nib_lo(v) | (bits_lo(s.h, p) << vec4<u32>(4u))) - vec4<i32>(16));
        e[4u + p] = vec4<f32>(vec4<i32>(nib_hi(v) | (bits_hi(s.h, p) << vec4<u32>(4u))) - vec4<i32>(16));
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.d, s.d, 0.0, 0.0);
}

// The int8 path (matmul_gpu_xi8.wgsl): the codes as bytes (wcodes8) and their terms (wterms8:
// the halves' scales, then what multiplies the halves' sums of x):
// 5-bit codes, the offset -16 applied through the sums.
fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    return fifth8(vec4<u32>(wq[blk * 5u], wq[blk * 5u + 1u], wq[blk * 5u + 2u], wq[blk * 5u + 3u]), s.h);
}

fn wterms8(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.d, s.d, -16.0 * s.d, -16.0 * s.d);
}
