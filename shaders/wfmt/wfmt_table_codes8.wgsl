// The table formats' int8 path (IQ4_NL, IQ4_XS, MXFP4; matmul_gpu_xi8.wgsl, after the format's
// snippet and wfmt_table_codes.wgsl): every table value is an integer of at most 8 bits, so the
// codes become the table's values as signed bytes and d stays the block's scale. WGSL has no
// byte permute, and a 16-entry array indexed per code is a memory read per weight (what RADV
// emits for KTAB), so `wprep` fills a workgroup table once per workgroup: KPAIR[byte] holds
// the values of the byte's two nibbles (low nibble's value in bits 0..8, high nibble's in
// 16..24). Per word of codes (elements 4p..4p+3 in the low nibbles, 16+4p.. in the high ones):
// four table reads, and shifts and masks that pack the low values and the high values four to
// a word each.
var<workgroup> KPAIR: array<u32, 256>;

fn kbyte(c: u32) -> u32 {
    return u32(i32(KTAB[c])) & 0xFFu;
}

// Called by every invocation of the workgroup before its first wcodes8, then a barrier.
fn wprep(lid: u32) {
    for (var i = lid; i < 256u; i += WG) {
        KPAIR[i] = kbyte(i & 15u) | (kbyte(i >> 4u) << 16u);
    }
}

fn wcodes8(blk: u32, s: Sc) -> array<u32, 8> {
    let v = wq[blk];
    var c: array<u32, 8>;
    for (var p = 0u; p < 4u; p++) {
        let w = v[p];
        // Bytes (lo0, lo1, hi0, hi1) and (lo2, lo3, hi2, hi3).
        let a = KPAIR[w & 0xFFu] | (KPAIR[(w >> 8u) & 0xFFu] << 8u);
        let b = KPAIR[(w >> 16u) & 0xFFu] | (KPAIR[w >> 24u] << 8u);
        c[p] = (a & 0xFFFFu) | (b << 16u);
        c[4u + p] = (a >> 16u) | (b & 0xFFFF0000u);
    }
    return c;
}

fn wterms8(s: Sc) -> vec4<f32> {
    return wterms(s);
}
