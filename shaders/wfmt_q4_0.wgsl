// GGUF Q4_0: 16 bytes of nibbles (1 vec4 word) and one scale per block; x = (q - 8) * d.
// Byte j holds element j (low nibble) and element j + 16 (high nibble).
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>;

fn wpart(blk: u32, p: u32) -> Part {
    let d = ws[blk];
    let v = wq[blk][p];
    let lo = vec4<f32>(vec4<u32>(v, v >> 8u, v >> 16u, v >> 24u) & vec4<u32>(15u));
    let hi = vec4<f32>(vec4<u32>(v >> 4u, v >> 12u, v >> 20u, v >> 28u) & vec4<u32>(15u));
    return Part((lo - 8.0) * d, (hi - 8.0) * d);
}
