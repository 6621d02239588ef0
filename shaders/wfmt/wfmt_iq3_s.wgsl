// GGUF IQ3_S: 256-element super-blocks; per 32 elements, eight 9-bit indices into the 512-entry
// grid (4-element entries, values 1..15; low bytes in the quants, the ninth bits in the block's
// qh byte), 32 explicit sign bits and a 4-bit scale. Quants: 3 words per block (index low bytes,
// sign bits). Scale record (4 words): d, 8 scale nibbles, 8 qh bytes. x = d * (1 + 2 scale) *
// sign * grid.
@group(0) @binding(3) var<storage, read> wq: array<u32>;

struct Sc {
    dlo: f32,
    dhi: f32,
    i0: u32,
    i1: u32,
    signs: u32,
    qh: u32,
}

fn wscale(blk: u32) -> Sc {
    let r = grec(blk, 4u);
    let j = blk & 7u;
    let db = bitcast<f32>(ws[r]) * f32(1u + 2u * ((ws[r + 1u] >> (4u * j)) & 15u));
    let qh = ubyte(ws[r + 2u + j / 4u], j % 4u);
    return Sc(db, db, wq[3u * blk], wq[3u * blk + 1u], wq[3u * blk + 2u], qh);
}

fn gq(blk: u32, q: u32, s: Sc) -> vec4<f32> {
    let idx = ubyte(select(s.i0, s.i1, q >= 4u), q % 4u) | (((s.qh >> q) & 1u) << 8u);
    return gsigns(s.signs >> (4u * q)) * grid4(idx);
}
