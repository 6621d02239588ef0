// GGUF Q4_0: 16 bytes of nibbles (1 vec4 word) and one scale per block; x = (q - 8) * d.
// Byte j holds element j (low nibble) and element j + 16 (high nibble).
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>;

struct Sc {
    d: f32,
}

fn wscale(blk: u32) -> Sc {
    return Sc(ws[blk]);
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    let v = wq[blk][p];
    let lo = vec4<f32>(vec4<i32>(nib_lo(v)) - vec4<i32>(8));
    let hi = vec4<f32>(vec4<i32>(nib_hi(v)) - vec4<i32>(8));
    return Part(lo * s.d, hi * s.d);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): nibbles - 8 (in integers), times d.
const WMIN: bool = false;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    let v = wq[blk];
    var e: array<vec4<f32>, 8>;
    for (var p = 0u; p < 4u; p++) {
        e[p] = vec4<f32>(vec4<i32>(nib_lo(v[p])) - vec4<i32>(8));
        e[4u + p] = vec4<f32>(vec4<i32>(nib_hi(v[p])) - vec4<i32>(8));
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.d, s.d, 0.0, 0.0);
}

// The int8 path (matmul_gpu_xi8.wgsl): the codes as bytes (wcodes8) and their terms (wterms8:
// the halves' scales, then what multiplies the halves' sums of x):
// nibbles, the offset -8 applied through the sums.
fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    return nibs8(wq[blk]);
}

fn wterms8(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.d, s.d, -8.0 * s.d, -8.0 * s.d);
}
