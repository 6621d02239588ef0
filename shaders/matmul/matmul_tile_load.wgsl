// The tiled kernels' loads (matmul_tiled.wgsl, matmul_coop.wgsl, moe_tiled.wgsl): an invocation
// loads one weight row's 32-element block (scale record and codes decoded once, dequantized
// here) and/or one token's x block. The kernel's params `p` give k_blocks and x_stride4.

@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

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
