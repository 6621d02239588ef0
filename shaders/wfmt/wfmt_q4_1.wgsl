// GGUF Q4_1: 16 bytes of nibbles (1 vec4 word), scale d and minimum m per block; x = q * d + m.
// Byte j holds element j (low nibble) and element j + 16 (high nibble).
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<vec2<f32>>;

struct Sc {
    dm: vec2<f32>,
}

fn wscale(blk: u32) -> Sc {
    return Sc(ws[blk]);
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    let v = wq[blk][p];
    return Part(vec4<f32>(nib_lo(v)) * s.dm.x + s.dm.y, vec4<f32>(nib_hi(v)) * s.dm.x + s.dm.y);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): nibbles times d, plus m times the sum of x.
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
    return vec4<f32>(s.dm.x, s.dm.x, s.dm.y, s.dm.y);
}

// The int8 path (matmul_gpu_xi8.wgsl): the codes as bytes (wcodes8) and their terms (wterms8:
// the halves' scales, then what multiplies the halves' sums of x).
fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    return nibs8(wq[blk]);
}

fn wterms8(s: Sc) -> vec4<f32> {
    return wterms(s);
}
