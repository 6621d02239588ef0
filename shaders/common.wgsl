// The step header `Step` (src/gpu/shared.rs, generated from its Rust definition) precedes this.

// Eight weights of one 32-element block, as the weight formats hand them out: part p (0..3)
// holds elements 4p..4p+3 (lo) and 16+4p..16+4p+3 (hi), the nibble order of GGUF's Q4 blocks.
struct Part {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// Bit fields of re-packed quant words (see QTensor::from_gguf_blocks). Part p of a 32-element
// block is elements 4p..4p+4 ("lo") and 16+4p..16+4p+4 ("hi").
// Nibble word p: byte i = element 4p+i (low nibble) | element 16+4p+i (high nibble).
fn nib_lo(v: u32) -> vec4<u32> {
    return vec4<u32>(v, v >> 8u, v >> 16u, v >> 24u) & vec4<u32>(15u);
}

fn nib_hi(v: u32) -> vec4<u32> {
    return vec4<u32>(v >> 4u, v >> 12u, v >> 20u, v >> 28u) & vec4<u32>(15u);
}

// Bit word: byte p = part p, bits 0..4 lo, 4..8 hi.
fn bits_lo(h: u32, p: u32) -> vec4<u32> {
    let b = h >> (8u * p);
    return vec4<u32>(b, b >> 1u, b >> 2u, b >> 3u) & vec4<u32>(1u);
}

fn bits_hi(h: u32, p: u32) -> vec4<u32> {
    let b = h >> (8u * p + 4u);
    return vec4<u32>(b, b >> 1u, b >> 2u, b >> 3u) & vec4<u32>(1u);
}

// Pair words (two): part p's 16 bits are half p % 2 of word p / 2; 2 bits per element,
// lo in bits 0..8, hi in 8..16.
fn pair_bits(e: vec2<u32>, p: u32) -> u32 {
    return select(e.x, e.y, p >= 2u) >> (16u * (p % 2u));
}

fn pairs_lo(v: u32) -> vec4<u32> {
    return vec4<u32>(v, v >> 2u, v >> 4u, v >> 6u) & vec4<u32>(3u);
}

fn pairs_hi(v: u32) -> vec4<u32> {
    return vec4<u32>(v >> 8u, v >> 10u, v >> 12u, v >> 14u) & vec4<u32>(3u);
}

// Byte i (0..4) of w as a signed value.
fn sbyte(w: u32, i: u32) -> f32 {
    return f32(bitcast<i32>(w << (24u - 8u * i)) >> 24u);
}

fn ubyte(w: u32, i: u32) -> u32 {
    return (w >> (8u * i)) & 255u;
}

// The int8 path's codes (wcodes8 of the weight formats, see matmul_gpu_xi8.wgsl): 32 codes as
// bytes, four to a word, word i = elements 4i..4i+3.
// A nibble word's low and high nibbles (elements 4p.. and 16+4p..) as bytes.
fn nibs8(v: vec4<u32>) -> array<u32, 8> {
    let lo = v & vec4<u32>(0x0F0F0F0Fu);
    let hi = (v >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
    return array<u32, 8>(lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w);
}

// Bits 0..4 of x, one to each byte (bit i to bit 8i).
fn spread4(x: u32) -> u32 {
    return ((x & 15u) * 0x00204081u) & 0x01010101u;
}

// The four 2-bit fields of bits 0..8 of x, one to each byte (field i to bits 8i..8i+2).
fn spread2(x: u32) -> u32 {
    let t = ((x & 255u) | ((x & 255u) << 12u)) & 0x000F000Fu;
    return (t | (t << 6u)) & 0x03030303u;
}

// Nibble words with a bit word of fifth bits (Q5_0, Q5_1, Q5_K) as 5-bit bytes.
fn fifth8(v: vec4<u32>, h: u32) -> array<u32, 8> {
    var e = nibs8(v);
    for (var p = 0u; p < 4u; p++) {
        e[p] |= spread4(h >> (8u * p)) << 4u;
        e[4u + p] |= spread4(h >> (8u * p + 4u)) << 4u;
    }
    return e;
}

// Pair words (Q2_K, and the low bits of Q3_K) as 2-bit bytes.
fn pairs8(e2: vec2<u32>) -> array<u32, 8> {
    var e: array<u32, 8>;
    for (var p = 0u; p < 4u; p++) {
        let b = pair_bits(e2, p);
        e[p] = spread2(b);
        e[4u + p] = spread2(b >> 8u);
    }
    return e;
}

// tanh with its argument clamped to +-15 (where it is +-1 in f32): a driver's tanh may compute
// (e^2x - 1) / (e^2x + 1), which is inf / inf for large x.
fn tanh_c(x: f32) -> f32 {
    return tanh(clamp(x, -15.0, 15.0));
}

// GELU, tanh approximation (PyTorch's approximate="tanh", Gemma's gelu_pytorch_tanh).
fn gelu_tanh(x: f32) -> f32 {
    return 0.5 * x * (1.0 + tanh_c(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
