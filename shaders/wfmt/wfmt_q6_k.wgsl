// GGUF Q6_K: 256-element super-blocks, a signed 8-bit scale per 16 elements. Quants per
// 32-element block: 4 nibble words (low 4 bits) and 2 pair words (high 2 bits). Scale record
// per super-block (5 words): d (f32 bits), 16 signed scales as bytes.
// x = (q - 32) * (d * scale); elements 0..16 and 16..32 of a block have their own scale.
@group(0) @binding(3) var<storage, read> wq: array<u32>;
@group(0) @binding(4) var<storage, read> ws: array<u32>;

struct Sc {
    dlo: f32,
    dhi: f32,
    e: vec2<u32>,
}

fn wscale(blk: u32) -> Sc {
    let d = k16_scales(blk);
    return Sc(d.x, d.y, vec2<u32>(wq[blk * 6u + 4u], wq[blk * 6u + 5u]));
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    let v = wq[blk * 6u + p];
    let e = pair_bits(s.e, p);
    let lo = vec4<i32>(nib_lo(v) | (pairs_lo(e) << vec4<u32>(4u))) - vec4<i32>(32);
    let hi = vec4<i32>(nib_hi(v) | (pairs_hi(e) << vec4<u32>(4u))) - vec4<i32>(32);
    return Part(vec4<f32>(lo) * s.dlo, vec4<f32>(hi) * s.dhi);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): 6-bit codes - 32 (in integers), times each half's d * scale.
const WMIN: bool = false;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    var e: array<vec4<f32>, 8>;
    for (var p = 0u; p < 4u; p++) {
        let v = wq[blk * 6u + p];
        let b = pair_bits(s.e, p);
        e[p] = vec4<f32>(vec4<i32>(nib_lo(v) | (pairs_lo(b) << vec4<u32>(4u))) - vec4<i32>(32));
        e[4u + p] = vec4<f32>(vec4<i32>(nib_hi(v) | (pairs_hi(b) << vec4<u32>(4u))) - vec4<i32>(32));
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.dlo, s.dhi, 0.0, 0.0);
}

// The int8 path (matmul_gpu_xi8.wgsl): the codes as bytes (wcodes8) and their terms (wterms8:
// the halves' scales, then what multiplies the halves' sums of x):
// 6-bit codes, the offset -32 applied through the sums.
fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    let v = vec4<u32>(wq[blk * 6u], wq[blk * 6u + 1u], wq[blk * 6u + 2u], wq[blk * 6u + 3u]);
    var e = nibs8(v);
    let hb = pairs8(s.e);
    for (var i = 0u; i < 8u; i++) {
        e[i] |= hb[i] << 4u;
    }
    return e;
}

fn wterms8(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.dlo, s.dhi, -32.0 * s.dlo, -32.0 * s.dhi);
}
