// GGUF IQ2_XS: 256-element super-blocks; per 32 elements, four u16 of a 9-bit index into the
// 512-entry grid (8-element entries, values 8, 25, 43) and 7 sign bits (the eighth from parity);
// a 4-bit scale per 16 elements. Quants: 2 words per block (the four u16). Scale record (3
// words): d, the 8 scale bytes (low nibble: first half of a block). x = d * (0.5 + scale) / 4 *
// sign * grid.
@group(0) @binding(3) var<storage, read> wq: array<u32>;

struct Sc {
    dlo: f32,
    dhi: f32,
    a: u32,
    b: u32,
}

fn wscale(blk: u32) -> Sc {
    let r = grec(blk, 3u);
    let j = blk & 7u;
    let d = bitcast<f32>(ws[r]);
    let sc = ubyte(ws[r + 1u + j / 4u], j % 4u);
    let dlo = d * (0.5 + f32(sc & 15u)) * 0.25;
    let dhi = d * (0.5 + f32(sc >> 4u)) * 0.25;
    return Sc(dlo, dhi, wq[2u * blk], wq[2u * blk + 1u]);
}

fn gq(blk: u32, q: u32, s: Sc) -> vec4<f32> {
    let g = q >> 1u;
    let h = q & 1u;
    let u = (select(s.a, s.b, g >= 2u) >> (16u * (g % 2u))) & 0xffffu;
    let signs = ksigns(u >> 9u) >> (4u * h);
    return gsigns(signs) * grid8(u & 511u, h);
}
