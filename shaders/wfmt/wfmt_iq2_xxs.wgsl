// GGUF IQ2_XXS: 256-element super-blocks; per 32 elements, four bytes that each pick an
// 8-element entry of the 256-entry grid (values 8, 25, 43), four 7-bit sign groups (the eighth
// sign from parity) and a 4-bit scale. Quants: 2 words per block (the index bytes; the signs
// and scale word). Scale record (1 word): d. x = d * (0.5 + scale) / 4 * sign * grid.
@group(0) @binding(3) var<storage, read> wq: array<u32>;

struct Sc {
    dlo: f32,
    dhi: f32,
    idx: u32,
    aux: u32,
}

fn wscale(blk: u32) -> Sc {
    let aux = wq[2u * blk + 1u];
    let db = bitcast<f32>(ws[grec(blk, 1u)]) * (0.5 + f32(aux >> 28u)) * 0.25;
    return Sc(db, db, wq[2u * blk], aux);
}

fn gq(blk: u32, q: u32, s: Sc) -> vec4<f32> {
    let g = q >> 1u;
    let h = q & 1u;
    let signs = ksigns(s.aux >> (7u * g)) >> (4u * h);
    return gsigns(signs) * grid8((s.idx >> (8u * g)) & 255u, h);
}
