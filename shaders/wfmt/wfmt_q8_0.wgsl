// GGUF Q8_0: 32 signed bytes (2 vec4 words) and one scale per block; x = q * d.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>;

struct Sc {
    d: f32,
}

fn wscale(blk: u32) -> Sc {
    return Sc(ws[blk]);
}

fn sbytes(v: u32) -> vec4<f32> {
    let s = bitcast<vec4<i32>>(vec4<u32>(v << 24u, v << 16u, v << 8u, v)) >> vec4<u32>(24u);
    return vec4<f32>(s);
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    return Part(sbytes(wq[2u * blk][p]) * s.d, sbytes(wq[2u * blk + 1u][p]) * s.d);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): signed bytes times d.
const WMIN: bool = false;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    let a = wq[2u * blk];
    let b = wq[2u * blk + 1u];
    var e: array<vec4<f32>, 8>;
    for (var p = 0u; p < 4u; p++) {
        e[p] = sbytes(a[p]);
        e[4u + p] = sbytes(b[p]);
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.d, s.d, 0.0, 0.0);
}

// The int8 path (matmul_gpu_xi8.wgsl): the codes as bytes (wcodes8) and their terms (wterms8:
// the halves' scales, then what multiplies the halves' sums of x).
fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    let a = wq[2u * blk];
    let b = wq[2u * blk + 1u];
    return array<u32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
}

fn wterms8(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.d, s.d, 0.0, 0.0);
}
