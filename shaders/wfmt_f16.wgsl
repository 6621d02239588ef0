// Weight format f16: two halves per u32 (low half = lower index), a block = 4 vec4 words.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>; // unused

fn wdeq(blk: u32, w: ptr<function, array<vec4<f32>, 8>>) {
    let base = blk * 4u;
    for (var i = 0u; i < 4u; i++) {
        let v = wq[base + i];
        (*w)[2u * i] = vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
        (*w)[2u * i + 1u] = vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w));
    }
}
