// GGUF IQ3_XXS: 256-element super-blocks; per 32 elements, eight bytes that each pick a
// 4-element entry of the 256-entry grid (values 4..62), four 7-bit sign groups of 8 elements
// (the eighth sign from parity) and a 4-bit scale. Quants: 3 words per block (the index bytes;
// the signs and scale word). Scale record (1 word): d. x = d * (0.5 + scale) / 2 * sign * grid.
@group(0) @binding(3) var<storage, read> wq: array<u32>;

struct Sc {
    dlo: f32,
    dhi: f32,
    i0: u32,
    i1: u32,
    aux: u32,
}

fn wscale(blk: u32) -> Sc {
    let aux = wq[3u * blk + 2u];
    let db = bitcast<f32>(ws[grec(blk, 1u)]) * (0.5 + f32(aux >> 28u)) * 0.5;
    return Sc(db, db, wq[3u * blk], wq[3u * blk + 1u], aux);
}

fn gq(blk: u32, q: u32, s: Sc) -> vec4<f32> {
    let idx = ubyte(select(s.i0, s.i1, q >= 4u), q % 4u);
    let signs = ksigns(s.aux >> (7u * (q >> 1u))) >> (4u * (q & 1u));
    return gsigns(signs) * grid4(idx);
}
