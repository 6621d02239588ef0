// GGUF IQ2_S: 256-element super-blocks; per 32 elements, four 10-bit indices into the
// 1024-entry grid (8-element entries, values 8, 25, 43; low bytes in the quants, the two high
// bits each in the block's qh byte), 32 explicit sign bits, a 4-bit scale per 16 elements.
// Quants: 2 words per block (index low bytes, sign bytes). Scale record (5 words): d, 8 scale
// bytes, 8 qh bytes. x = d * (0.5 + scale) / 4 * sign * grid.
@group(0) @binding(3) var<storage, read> wq: array<u32>;

struct Sc {
    dlo: f32,
    dhi: f32,
    idx: u32,
    signs: u32,
    qh: u32,
}

fn wscale(blk: u32) -> Sc {
    let r = grec(blk, 5u);
    let j = blk & 7u;
    let d = bitcast<f32>(ws[r]);
    let sc = ubyte(ws[r + 1u + j / 4u], j % 4u);
    let dlo = d * (0.5 + f32(sc & 15u)) * 0.25;
    let dhi = d * (0.5 + f32(sc >> 4u)) * 0.25;
    return Sc(dlo, dhi, wq[2u * blk], wq[2u * blk + 1u], ubyte(ws[r + 3u + j / 4u], j % 4u));
}

fn gq(blk: u32, q: u32, s: Sc) -> vec4<f32> {
    let g = q >> 1u;
    let h = q & 1u;
    let idx = ((s.idx >> (8u * g)) & 255u) | (((s.qh >> (2u * g)) & 3u) << 8u);
    return gsigns(s.signs >> (8u * g + 4u * h)) * grid8(idx, h);
}
