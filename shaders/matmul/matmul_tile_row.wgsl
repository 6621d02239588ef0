// The dense tiled kernels' weight rows (matmul_tiled.wgsl, matmul_coop.wgsl): with SWIGLU, tile
// rows 0..BN/2 are gate rows and BN/2..BN the same columns' up rows (BN: the kernel's weight
// rows per tile; p.n_rows: the matmul's output columns).

// The weight row of tile row `r` of the tile starting at output column n0.
fn weight_row(n0: u32, r: u32) -> u32 {
    if (SWIGLU) {
        let c = min(n0 + r % (BN / 2u), p.n_rows - 1u);
        return select(c, c + p.n_rows, r >= BN / 2u);
    }
    return min(n0 + r, p.n_rows - 1u);
}
