// matmul_gpu.wgsl's X part for activations quantized to int8 (quantize_x8.wgsl): per token and
// 32-value block three words of four, the 32 values as signed bytes (element order, four to a
// word) and (d, d * sum(q) over elements 0..16, over 16..32), x ~= d * q. Per row, the weight
// format's `wcodes8` (its 32 integer codes as bytes, four to a word, in the same order) and
// `wterms8` (the halves' scales and the terms that multiply the halves' sums of the quantized
// x: a format's mins and its codes' offsets), so that
//   d * (d_lo * (codes_lo . q_lo) + d_hi * (codes_hi . q_hi)) + t_lo * d * sum(q_lo) + t_hi * d * sum(q_hi)
// with the dot products in integers, four bytes per dot4I8Packed, two independent chains: the
// dequantized weights times the quantized x, offsets and mins included. (For Q4_1 and Q5_1,
// whose offset is one per block, t_lo = t_hi and the quantization leaves the whole block's
// sum in the first half's place and 0 in the second.)
@group(0) @binding(2) var<storage, read> x: array<vec4<u32>>;

struct XB {
    q0: vec4<u32>,
    q1: vec4<u32>,
    // d, the halves' d * sum(q) (f32 bits).
    ds: vec4<u32>,
}

fn xblock(t: u32, b: u32) -> XB {
    let at = (t * p.k_blocks + b) * 3u;
    return XB(x[at], x[at + 1u], x[at + 2u]);
}

fn block_dot(blk: u32, xb: XB) -> f32 {
    let s = wscale(blk);
    let c = wcodes8(blk, s);
    let tm = wterms8(s);
    let lo = dot4I8Packed(c[0], xb.q0.x) + dot4I8Packed(c[1], xb.q0.y) + dot4I8Packed(c[2], xb.q0.z)
        + dot4I8Packed(c[3], xb.q0.w);
    let hi = dot4I8Packed(c[4], xb.q1.x) + dot4I8Packed(c[5], xb.q1.y) + dot4I8Packed(c[6], xb.q1.z)
        + dot4I8Packed(c[7], xb.q1.w);
    let ds = bitcast<vec3<f32>>(xb.ds.xyz);
    return ds.x * (f32(lo) * tm.x + f32(hi) * tm.y) + ds.y * tm.z + ds.z * tm.w;
}
