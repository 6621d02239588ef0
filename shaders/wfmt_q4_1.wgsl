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
