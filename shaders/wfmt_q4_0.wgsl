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
