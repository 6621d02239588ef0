// GGUF IQ1_M: 256-element super-blocks; per 32 elements, four 11-bit indices into IQ1_S's grid
// (8-element entries of -1, 0, 1; low bytes in the quants, three high bits each in a qh nibble
// whose fourth bit is the sign of that entry's +-1/8 delta), a 3-bit scale per 16 elements, and
// d (an f16 spread over the scales' top nibbles, joined at load). Quants: 1 word per block.
// Scale record (7 words): d, the 4 scale u16, the 16 qh bytes. x = d * (2 scale + 1) * (grid +
// delta), computed as (that scale / 8) * (8 grid +- 1), as IQ1_S.
@group(0) @binding(3) var<storage, read> wq: array<u32>;

struct Sc {
    dlo: f32,
    dhi: f32,
    idx: u32,
    qh: u32,
}

fn wscale(blk: u32) -> Sc {
    let r = grec(blk, 7u);
    let j = blk & 7u;
    let d = bitcast<f32>(ws[r]);
    // Both halves' 3-bit scales are in u16 j / 2, at 3 (2j % 4) and 3 (2j % 4 + 1).
    let sc = (ws[r + 1u + j / 4u] >> (16u * ((j / 2u) % 2u) + 3u * (2u * j % 4u))) & 63u;
    let dlo = d * f32(2u * (sc & 7u) + 1u) * 0.125;
    let dhi = d * f32(2u * (sc >> 3u) + 1u) * 0.125;
    return Sc(dlo, dhi, wq[blk], (ws[r + 3u + j / 2u] >> (16u * (j % 2u))) & 0xffffu);
}

fn gq(blk: u32, q: u32, s: Sc) -> vec4<f32> {
    let g = q >> 1u;
    let nib = (s.qh >> (4u * g)) & 15u;
    let idx = ((s.idx >> (8u * g)) & 255u) | ((nib & 7u) << 8u);
    return 8.0 * (grid8(idx, q & 1u) - 1.0) + select(1.0, -1.0, (nib & 8u) != 0u);
}
