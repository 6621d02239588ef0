// GGUF Q4_K: 256-element super-blocks of eight 32-element blocks, each with a 6-bit scale and
// min. Quants: 4 nibble words per block (vec4). Scale record per super-block (6 words):
// d, dmin (f32 bits), 8 scales as bytes (2 words), 8 mins as bytes (2 words).
// x = q * (d * scale) - dmin * min.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<u32>;

struct Sc {
    d: f32,
    m: f32,
}

fn wscale(blk: u32) -> Sc {
    let dm = k4_scale_min(blk);
    return Sc(dm.x, dm.y);
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    let v = wq[blk][p];
    return Part(vec4<f32>(nib_lo(v)) * s.d + s.m, vec4<f32>(nib_hi(v)) * s.d + s.m);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): nibbles times d * scale, plus -(dmin * min) times the sum of x.
const WMIN: bool = true;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    let v = wq[blk];
    var e: array<vec4<f32>, 8>;
    for (var p = 0u; p < 4u; p++) {
        e[p] = vec4<f32>(nib_lo(v[p]));
        e[4u + p] = vec4<f32>(nib_hi(v[p]));
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.d, s.d, s.m, s.m);
}

// The int8 path (matmul_gpu_xi8.wgsl): the codes as bytes (wcodes8) and their terms (wterms8:
// the halves' scales, then what multiplies the halves' sums of x).
fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    return nibs8(wq[blk]);
}

fn wterms8(s: Sc) -> vec4<f32> {
    return wterms(s);
}
