// GGUF IQ4_XS: 256-element super-blocks of 4-bit codes into IQ4_NL's table (KTAB, appended from
// Rust), a signed 6-bit scale per 32-element block. Quants: 4 nibble words per block (vec4), in
// Q4_0's order. Scale record per super-block (3 words): d (f32 bits), 8 signed scales (the
// 6-bit scale - 32) as bytes. x = (d * scale) * KTAB[q]; the codes' functions are
// wfmt_table_codes.wgsl's, with Sc.d the block's d * scale.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<u32>;

struct Sc {
    d: f32,
}

fn wscale(blk: u32) -> Sc {
    let r = (blk >> 3u) * 3u;
    let j = blk & 7u;
    return Sc(bitcast<f32>(ws[r]) * sbyte(ws[r + 1u + j / 4u], j % 4u));
}
