// The grid formats' shared half (IQ1_*, IQ2_*, IQ3_*; after the format's own snippet, which
// declares wq, Sc with its half scales dlo and dhi, wscale, and gq: the signed, unscaled values
// of elements 4q..4q+3 of a block). The format's lookup grid sits in front of its scale records
// in ws (GRID_WORDS words, declared from Rust; src/weights/grids.rs): one byte per element.
@group(0) @binding(4) var<storage, read> ws: array<u32>;

fn wpart(blk: u32, p: u32, s: Sc) -> Part {
    return Part(gq(blk, p, s) * s.dlo, gq(blk, 4u + p, s) * s.dhi);
}

// The block's codes in element order (e[i] = elements 4i..4i+3) and their terms (see
// matmul_gpu.wgsl): the signed grid values, times each half's scale.
const WMIN: bool = false;

fn wcodes(blk: u32, s: Sc) -> array<vec4<f32>, 8> {
    var e: array<vec4<f32>, 8>;
    for (var q = 0u; q < 8u; q++) {
        e[q] = gq(blk, q, s);
    }
    return e;
}

fn wterms(s: Sc) -> vec4<f32> {
    return vec4<f32>(s.dlo, s.dhi, 0.0, 0.0);
}

// The first word of super-block blk / 8's scale record of `words` words (d, as f32 bits).
fn grec(blk: u32, words: u32) -> u32 {
    return GRID_WORDS + (blk >> 3u) * words;
}

// Four unsigned bytes of a grid word.
fn gbytes(w: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(w, w >> 8u, w >> 16u, w >> 24u) & vec4<u32>(255u));
}

// Elements 4h..4h+3 of 8-element grid entry idx; all 4 of a 4-element entry.
fn grid8(idx: u32, h: u32) -> vec4<f32> {
    return gbytes(ws[2u * idx + h]);
}

fn grid4(idx: u32) -> vec4<f32> {
    return gbytes(ws[idx]);
}

// +1 or -1 from bits 0..3 (set: minus).
fn gsigns(bits: u32) -> vec4<f32> {
    let b = vec4<u32>(bits, bits >> 1u, bits >> 2u, bits >> 3u) & vec4<u32>(1u);
    return vec4<f32>(1.0) - 2.0 * vec4<f32>(b);
}

// ggml's ksigns: seven stored sign bits and an eighth that makes the count of minus signs even.
fn ksigns(s7: u32) -> u32 {
    let s = s7 & 127u;
    return s | ((countOneBits(s) & 1u) << 7u);
}
