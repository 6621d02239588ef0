// GPU profile, prefill-sized steps, on the subgroups' matrix units (cooperative matrices; wgpu's
// experimental feature, off by default: see gpu::coop). The tile is the tiled kernel's (64
// tokens x 64 weight rows, one 32-element block of K at a time): the 64 invocations load,
// dequantize and store the block k-major as there (xs[k * 64 + t], wt[k * 64 + r], as AB: f32,
// or f16 where the adapter's units take f16), then each of the NSG subgroups multiplies its FT
// token fragments of MS x MS by the tile's FR row fragments, accumulating in f32 (C fragments
// held through the whole K loop). At the end the fragments go to workgroup memory (ct[t * 64 +
// r]) and the epilogue writes them with the usual bias / accumulate flags, consecutive
// invocations on consecutive columns. With SWIGLU, tile rows 0..31 are gate rows and 32..63 the
// same columns' up rows, and y = glu(gate . x) * (up . x).
// The weight format's wfmt_*.wgsl and the tile loads (matmul_tile_load.wgsl) are prepended, and
// the `enable` directives before everything.

const MS: u32 = {{MS}}u; // fragment side: 8 (8x8x8) or 16 (16x16x16)
const NSG: u32 = 64u / {{SG}}u; // subgroups per workgroup (the adapter's one subgroup size)
const FR: u32 = 64u / MS; // fragments per tile side
const FT: u32 = FR / NSG; // token fragments per subgroup
const SWIGLU: bool = {{SWIGLU}};
const BN: u32 = 64u; // weight rows per tile (matmul_tile_load.wgsl reads it)
alias AB = {{AB}};
alias MA = coop_mat{{MS}}x{{MS}}<AB, A>;
alias MB = coop_mat{{MS}}x{{MS}}<AB, B>;
alias MC = coop_mat{{MS}}x{{MS}}<f32, C>;

var<workgroup> xs: array<AB, 2048>;
var<workgroup> wt: array<AB, 2048>;
var<workgroup> ct: array<f32, 4096>;

// A tile element in AB (f16: clamped to its range, so a large activation is not inf).
fn to_ab(v: f32) -> AB {
    {{TO_AB}}
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
) {
    let g = wid.x + wid.y * nwg.x;
    let outs = select(64u, 32u, SWIGLU);
    let col_groups = (p.n_rows + outs - 1u) / outs;
    let m = rows_m();
    let t0 = (g / col_groups) * 64u;
    let n0 = (g % col_groups) * outs;
    if (t0 >= m) {
        return;
    }
    let my_row = weight_row(n0, lid);
    let my_tok = min(t0 + lid, m - 1u);
    // acc[i * FR + j]: tokens of fragment sg * FT + i, rows of fragment j.
    var acc: array<MC, FT * FR>;
    var wv = load_w(my_row, 0u);
    var xv = load_x(my_tok, 0u);
    for (var b = 0u; b < p.k_blocks; b++) {
        for (var i = 0u; i < 8u; i++) {
            for (var c = 0u; c < 4u; c++) {
                xs[(4u * i + c) * 64u + lid] = to_ab(xv[i][c]);
                wt[(4u * i + c) * 64u + lid] = to_ab(wv[i][c]);
            }
        }
        workgroupBarrier();
        if (b + 1u < p.k_blocks) {
            wv = load_w(my_row, b + 1u);
            xv = load_x(my_tok, b + 1u);
        }
        for (var kk = 0u; kk < 32u; kk += MS) {
            for (var i = 0u; i < FT; i++) {
                // A = tokens x k, column-major in xs; B = k x rows, row-major in wt.
                let a = coopLoad<MA>(&xs[kk * 64u + (sg * FT + i) * MS], 64u);
                for (var j = 0u; j < FR; j++) {
                    let w = coopLoadT<MB>(&wt[kk * 64u + j * MS], 64u);
                    acc[i * FR + j] = coopMultiplyAdd(a, w, acc[i * FR + j]);
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < FT; i++) {
        for (var j = 0u; j < FR; j++) {
            coopStoreT(acc[i * FR + j], &ct[(sg * FT + i) * MS * 64u + j * MS], 64u);
        }
    }
    workgroupBarrier();
    if (SWIGLU) {
        // Two tokens per pass: invocations 0..31 and 32..63 each on 32 consecutive columns.
        for (var tt = lid / 32u; tt < 64u; tt += 2u) {
            let t = t0 + tt;
            let c = lid % 32u;
            if (t < m && n0 + c < p.n_rows) {
                y[t * p.y_stride + p.row0 + n0 + c] = glu(ct[tt * 64u + c]) * ct[tt * 64u + 32u + c];
            }
        }
    } else {
        for (var tt = 0u; tt < 64u; tt++) {
            let t = t0 + tt;
            if (t < m && n0 + lid < p.n_rows) {
                store(t, n0 + lid, ct[tt * 64u + lid]);
            }
        }
    }
}
