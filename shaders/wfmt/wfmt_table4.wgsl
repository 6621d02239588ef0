// GGUF IQ4_NL and MXFP4: 32-element blocks of 4-bit codes that index a table of values (KTAB,
// appended from Rust: IQ4_NL's non-linear values, or MXFP4's e2m1 values doubled), and one scale
// per block (IQ4_NL: the f16 d; MXFP4: 2^(e - 128) from the e8m0 byte, both as f32 in ws).
// Quants: 4 nibble words per block (vec4), in Q4_0's order. x = d * KTAB[q]; the codes'
// functions are wfmt_table_codes.wgsl's.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>;

struct Sc {
    d: f32,
}

fn wscale(blk: u32) -> Sc {
    return Sc(ws[blk]);
}
