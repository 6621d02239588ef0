// GGUF IQ1_S: 256-element super-blocks; per 32 elements, four 11-bit indices into the 2048-entry
// grid (8-element entries of -1, 0, 1; low bytes in the quants, three high bits each in the
// block's qh u16), with a 3-bit scale and the sign of a +-1/8 delta in the same u16. Quants: 1
// word per block. Scale record (5 words): d, 8 qh u16. x = d * (2 scale + 1) * (grid + delta),
// computed as (that scale / 8) * (8 grid +- 1): exact, the same single rounding. The grid's
// bytes are 0, 1, 2 for -1, 0, 1.
@group(0) @binding(3) var<storage, read> wq: array<u32>;

struct Sc {
    dlo: f32,
    dhi: f32,
    idx: u32,
    qh: u32,
    delta: f32,
}

fn wscale(blk: u32) -> Sc {
    let r = grec(blk, 5u);
    let j = blk & 7u;
    let qh = (ws[r + 1u + j / 2u] >> (16u * (j % 2u))) & 0xffffu;
    let dl = bitcast<f32>(ws[r]) * f32(2u * ((qh >> 12u) & 7u) + 1u) * 0.125;
    return Sc(dl, dl, wq[blk], qh, select(1.0, -1.0, (qh & 0x8000u) != 0u));
}

fn gq(blk: u32, q: u32, s: Sc) -> vec4<f32> {
    let g = q >> 1u;
    let idx = ((s.idx >> (8u * g)) & 255u) | (((s.qh >> (3u * g)) & 7u) << 8u);
    return 8.0 * (grid8(idx, q & 1u) - 1.0) + s.delta;
}
