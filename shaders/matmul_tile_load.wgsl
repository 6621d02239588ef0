// The tiled kernels' loads (matmul_tiled.wgsl, matmul_coop.wgsl): an invocation loads one weight
// row's 32-element block (scale record and codes decoded once, dequantized here) and/or one
// token's x block. With SWIGLU, tile rows 0..BN/2 are gate rows and BN/2..BN the same columns'
// up rows (BN: the kernel's weight rows per tile).

@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

// The weight row of tile row `r` of the tile starting at output column n0.
fn weight_row(n0: u32, r: u32) -> u32 {
    if (SWIGLU) {
        let c = min(n0 + r % (BN / 2u), p.n_rows - 1u);
        return select(c, c + p.n_rows, r >= BN / 2u);
    }
    return min(n0 + r, p.n_rows - 1u);
}

// Block b of weight row `row`, dequantized, in element order.
fn load_w(row: u32, b: u32) -> array<vec4<f32>, 8> {
    let blk = row * p.k_blocks + b;
    let s = wscale(blk);
    var c = wcodes(blk, s);
    let tm = wterms(s);
    for (var i = 0u; i < 4u; i++) {
        c[i] = c[i] * tm.x + tm.z;
        c[4u + i] = c[4u + i] * tm.y + tm.w;
    }
    return c;
}

// Block b of x row t.
fn load_x(t: u32, b: u32) -> array<vec4<f32>, 8> {
    let xb = t * p.x_stride4 + b * 8u;
    var v: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = x[xb + i];
    }
    return v;
}
