// matmul_gpu.wgsl's X part for f32 activations: a token's x block is where it starts (and, for
// formats with a min, its halves' sums); per row, the block's codes as floats times x,
//   d_lo * (codes_lo . x_lo) + d_hi * (codes_hi . x_hi) [+ m_lo * sum(x_lo) + m_hi * sum(x_hi)]
// (`wterms`: the halves' scales and, with WMIN, their mins, applied through the sums of x).
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

struct XB {
    at: u32,
    sums: vec2<f32>,
}

fn xblock(t: u32, b: u32) -> XB {
    let at = t * p.x_stride4 + b * 8u;
    var sums = vec2<f32>(0.0);
    if (WMIN) {
        let lo = x[at] + x[at + 1u] + x[at + 2u] + x[at + 3u];
        let hi = x[at + 4u] + x[at + 5u] + x[at + 6u] + x[at + 7u];
        sums = vec2<f32>(dot(lo, vec4<f32>(1.0)), dot(hi, vec4<f32>(1.0)));
    }
    return XB(at, sums);
}

fn block_dot(blk: u32, xb: XB) -> f32 {
    let s = wscale(blk);
    let c = wcodes(blk, s);
    let tm = wterms(s);
    let a = xb.at;
    let lo = dot(c[0], x[a]) + dot(c[1], x[a + 1u]) + dot(c[2], x[a + 2u]) + dot(c[3], x[a + 3u]);
    let hi = dot(c[4], x[a + 4u]) + dot(c[5], x[a + 5u]) + dot(c[6], x[a + 6u]) + dot(c[7], x[a + 7u]);
    var v = lo * tm.x + hi * tm.y;
    if (WMIN) {
        v += xb.sums.x * tm.z + xb.sums.y * tm.w;
    }
    return v;
}
