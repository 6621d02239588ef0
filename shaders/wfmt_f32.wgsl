// Weight format f32: one 32-element block = 8 vec4 words; no scales.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>; // unused

struct Sc {
    unused: u32,
}

fn wscale(blk: u32) -> Sc {
    return Sc(0u);
}

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    return Part(bitcast<vec4<f32>>(wq[blk * 8u + p]), bitcast<vec4<f32>>(wq[blk * 8u + 4u + p]));
}
