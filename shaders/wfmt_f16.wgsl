// Weight format f16: two halves per u32 (low half = lower index), a block = 4 vec4 words.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>; // unused

fn halves4(v: vec4<u32>, first: u32) -> vec4<f32> {
    // Elements from words `first` and `first + 1` of v (first is 0 or 2).
    return vec4<f32>(unpack2x16float(v[first]), unpack2x16float(v[first + 1u]));
}

fn wpart(blk: u32, p: u32) -> Part {
    // Elements 4p.. live in words 2p, 2p+1; elements 16+4p.. in words 8+2p, 8+2p+1.
    let a = wq[blk * 4u + p / 2u];
    let b = wq[blk * 4u + 2u + p / 2u];
    let first = (p % 2u) * 2u;
    return Part(halves4(a, first), halves4(b, first));
}
