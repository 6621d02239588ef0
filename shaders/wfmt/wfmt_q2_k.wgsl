// GGUF Q2_K: 256-element super-blocks, a 4-bit scale and 4-bit min per 16 elements. Quants per
// 32-element block: 2 pair words. Scale record per super-block (6 words): d, dmin (f32 bits),
// GGUF's 16 bytes of (scale | min << 4).
// x = q * (d * scale) - dmin * min; elements 0..16 and 16..32 of a block have their own pair.
@group(0) @binding(3) var<storage, read> wq: array<u32>;
@group(0) @binding(4) var<storage, read> ws: array<u32>;

struct Sc {
    dlo: f32,
    mlo: f32,
    dhi: f32,
    mhi: f32,
    e: vec2<u32>,
}

fn wscale(blk: u32) -> Sc {
    let r = (blk >> 3u) * 6u;
    let j = blk & 7u;
    let d = bitcast<f32>(ws[r]);
    let dmin = bitcast<f32>(ws[r + 1u]);
    let w = ws[r + 2u + j / 2u] >> (16u * (j % 2u));
    let lo = w & 255u;
    let hi = (w >> 8u) & 255u;
    return Sc(
        d * f32(lo & 15u),
        -(dmin * f32(lo >> 4u)),
        d * f32(hi & 15u),
        -(dmin * f32(hi >> 4u)),
        vec2<u32>(wq[blk * 2u], wq[blk * 2u + 1u]),
    );
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    let e = pair_bits(s.e, p);
    return Part(vec4<f32>(pairs_lo(e)) * s.dlo + s.mlo, vec4<f32>(pairs_hi(e)) * s.dhi + s.mhi);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): 2-bit codes times each half's d * scale, plus each half's -(dmin * min)
// times its sum of x.
const WMIN: bool = true;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    var e: array<vec4<f32>, 8>;
    for (var p = 0u; p < 4u; p++) {
        let b = pair_bits(s.e, p);
        e[p] = vec4<f32>(pairs_lo(b));
        e[4u + p] = vec4<f32>(pairs_hi(b));
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.dlo, s.dhi, s.mlo, s.mhi);
}

// The int8 path (matmul_gpu_xi8.wgsl): the codes as bytes (wcodes8) and their terms (wterms8:
// the halves' scales, then what multiplies the halves' sums of x).
fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    return pairs8(s.e);
}

fn wterms8(s: Sc) -> vec4<f32> {
    return wterms(s);
}
