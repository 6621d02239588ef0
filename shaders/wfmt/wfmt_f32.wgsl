// Weight format f32: one 32-element block = 8 vec4 words; no scales.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>; // unused

struct Sc {
    unused: u32,
}

fn wscale(blk: u32) -> Sc {
    return Sc(0u);
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    return Part(bitcast<vec4<f32>>(wq[blk * 8u + p]), bitcast<vec4<f32>>(wq[blk * 8u + 4u + p]));
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): plain values.
const WMIN: bool = false;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    var e: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        e[i] = bitcast<vec4<f32>>(wq[blk * 8u + i]);
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(1.0, 1.0, 0.0, 0.0);
}
