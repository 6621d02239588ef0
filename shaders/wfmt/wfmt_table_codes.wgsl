// The table formats' codes (IQ4_NL, IQ4_XS, MXFP4; after the format's own snippet, which
// declares wq, ws, Sc with its d, and wscale): 4-bit codes through KTAB (declared from Rust after
// this), times the block's d.

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    let v = wq[blk][p];
    return Part(ktab(nib_lo(v)) * s.d, ktab(nib_hi(v)) * s.d);
}

// The block's code values in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): the table's values, times d.
const WMIN: bool = false;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    let v = wq[blk];
    var e: array<vec4<f32>, 8>;
    for (var p = 0u; p < 4u; p++) {
        e[p] = ktab(nib_lo(v[p]));
        e[4u + p] = ktab(nib_hi(v[p]));
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.d, s.d, 0.0, 0.0);
}
