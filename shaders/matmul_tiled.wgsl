// GPU profile, prefill-sized steps: y[t, row0 + n] (=|+=) sum_k x[t, k] * W[n, k] in tiles of
// BM = 64 tokens x BN = 64 weight rows, one 32-element block of K at a time through workgroup
// memory. Each of the 64 invocations loads one weight row's block (scale record and codes decoded
// once, dequantized on the tile load) and one token's x block, and stores them transposed
// (k-major: consecutive invocations write consecutive words, no bank conflicts); then each
// accumulates an 8 x 8 register tile (tokens 4ty..4ty+3 and 32+4ty..32+4ty+3, rows 4tx..4tx+3
// and 32+4tx..32+4tx+3): per k, 4 vec4 loads from workgroup memory feed 64 multiply-adds (reads
// are broadcasts or consecutive vec4s: no conflicts, so the tiles need no padding). The next
// block's weights and x are loaded into registers before the current block is multiplied
// (double buffering through registers: one workgroup buffer of 16 KiB, two barriers per block).
// With SWIGLU, tile rows 0..31 are 32 gate rows and 32..63 the same columns' up rows, so each
// invocation holds gate and up of its 4 columns and y = glu(gate . x) * (up . x).
// The weight format's wfmt_*.wgsl (wq, ws, Sc, wscale, wcodes, wterms) and the tile loads
// (matmul_tile_load.wgsl: x, weight_row, load_w, load_x) are prepended.

const BM: u32 = 64u; // tokens per tile
const BN: u32 = 64u; // weight rows per tile
const SWIGLU: bool = {{SWIGLU}};

// xt[k * 16 + t / 4][t % 4] = x[t0 + t, 32 b + k]; wt[k * 16 + r / 4][r % 4] = W[row r, 32 b + k].
var<workgroup> xt: array<vec4<f32>, 512>;
var<workgroup> wt: array<vec4<f32>, 512>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let g = wid.x + wid.y * nwg.x;
    let outs = select(BN, BN / 2u, SWIGLU);
    let col_groups = (p.n_rows + outs - 1u) / outs;
    let m = rows_m();
    let t0 = (g / col_groups) * BM;
    let n0 = (g % col_groups) * outs;
    if (t0 >= m) {
        return;
    }
    let tx = lid % 8u; // rows 4 tx .. 4 tx + 4 and 32 + 4 tx ..
    let ty = lid / 8u; // tokens 4 ty .. 4 ty + 4 and 32 + 4 ty ..
    let my_row = weight_row(n0, lid);
    let my_tok = min(t0 + lid, m - 1u);
    // acc[2 j + h]: token j of the invocation's 8 (4 ty + j, then 32 + 4 ty + j - 4), rows half h.
    var acc: array<vec4<f32>, 16>;
    var wv = load_w(my_row, 0u);
    var xv = load_x(my_tok, 0u);
    for (var b = 0u; b < p.k_blocks; b++) {
        for (var i = 0u; i < 8u; i++) {
            for (var c = 0u; c < 4u; c++) {
                wt[(4u * i + c) * 16u + lid / 4u][lid % 4u] = wv[i][c];
                xt[(4u * i + c) * 16u + lid / 4u][lid % 4u] = xv[i][c];
            }
        }
        workgroupBarrier();
        if (b + 1u < p.k_blocks) {
            wv = load_w(my_row, b + 1u);
            xv = load_x(my_tok, b + 1u);
        }
        for (var k = 0u; k < 32u; k++) {
            let xa = xt[k * 16u + ty];
            let xb = xt[k * 16u + 8u + ty];
            let wa = wt[k * 16u + tx];
            let wb = wt[k * 16u + 8u + tx];
            acc[0] += xa.x * wa;
            acc[1] += xa.x * wb;
            acc[2] += xa.y * wa;
            acc[3] += xa.y * wb;
            acc[4] += xa.z * wa;
            acc[5] += xa.z * wb;
            acc[6] += xa.w * wa;
            acc[7] += xa.w * wb;
            acc[8] += xb.x * wa;
            acc[9] += xb.x * wb;
            acc[10] += xb.y * wa;
            acc[11] += xb.y * wb;
            acc[12] += xb.z * wa;
            acc[13] += xb.z * wb;
            acc[14] += xb.w * wa;
            acc[15] += xb.w * wb;
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < 8u; j++) {
        let t = t0 + select(4u * ty + j, 32u + 4u * ty + j - 4u, j >= 4u);
        if (t >= m) {
            continue;
        }
        if (SWIGLU) {
            for (var c = 0u; c < 4u; c++) {
                let n = n0 + 4u * tx + c;
                if (n < p.n_rows) {
                    y[t * p.y_stride + p.row0 + n] = glu(acc[2u * j][c]) * acc[2u * j + 1u][c];
                }
            }
        } else {
            for (var h = 0u; h < 2u; h++) {
                for (var c = 0u; c < 4u; c++) {
                    let n = n0 + 32u * h + 4u * tx + c;
                    if (n < p.n_rows) {
                        store(t, n, acc[2u * j + h][c]);
                    }
                }
            }
        }
    }
}
