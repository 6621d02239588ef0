// Scale records of the K-quants (see QTensor::from_gguf_blocks), read through the including
// format's `ws: array<u32>`. Block `blk` is 32-element block blk % 8 of super-block blk / 8.

// Q4_K / Q5_K (6 words: d, dmin, 8 scale bytes, 8 min bytes): (d * scale, -(dmin * min)).
fn k4_scale_min(blk: u32) -> vec2<f32> {
    let r = (blk >> 3u) * 6u;
    let j = blk & 7u;
    let sc = ubyte(ws[r + 2u + j / 4u], j % 4u);
    let mn = ubyte(ws[r + 4u + j / 4u], j % 4u);
    return vec2<f32>(bitcast<f32>(ws[r]) * f32(sc), -(bitcast<f32>(ws[r + 1u]) * f32(mn)));
}

// Q3_K / Q6_K (5 words: d, 16 signed scale bytes): d * scale of the block's two 16-element halves.
fn k16_scales(blk: u32) -> vec2<f32> {
    let r = (blk >> 3u) * 5u;
    let j = blk & 7u;
    let d = bitcast<f32>(ws[r]);
    let w = ws[r + 1u + j / 2u];
    let b = 2u * (j % 2u);
    return vec2<f32>(d * sbyte(w, b), d * sbyte(w, b + 1u));
}
