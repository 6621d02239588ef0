// Weight format f16: two halves per u32 (low half = lower index), a block = 4 vec4 words.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>; // unused

struct Sc {
    unused: u32,
}

fn wscale(blk: u32) -> Sc {
    return Sc(0u);
}

fn halves4(v: vec4<u32>, upper: bool) -> vec4<f32> {
    // Four halves from words 0, 1 of v, or from words 2, 3 when `upper`.
    let w = select(v.xy, v.zw, upper);
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    // Elements 4p.. live in words 2p, 2p+1; elements 16+4p.. in words 8+2p, 8+2p+1.
    let a = wq[blk * 4u + p / 2u];
    let b = wq[blk * 4u + 2u + p / 2u];
    let upper = (p % 2u) == 1u;
    return Part(halves4(a, upper), halves4(b, upper));
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): plain values.
const WMIN: bool = false;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    var e: array<vec4<f32>, 8>;
    for (var j = 0u; j < 4u; j++) {
        let v = wq[blk * 4u + j];
        e[2u * j] = halves4(v, false);
        e[2u * j + 1u] = halves4(v, true);
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(1.0, 1.0, 0.0, 0.0);
}
