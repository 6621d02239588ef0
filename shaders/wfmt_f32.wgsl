// Weight format f32: one 32-element block = 8 vec4 words.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>; // unused

fn wdeq(blk: u32, w: ptr<function, array<vec4<f32>, 8>>) {
    let base = blk * 8u;
    for (var i = 0u; i < 8u; i++) {
        (*w)[i] = bitcast<vec4<f32>>(wq[base + i]);
    }
}
