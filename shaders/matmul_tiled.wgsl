// GPU profile, prefill-sized steps: y[t, row0 + n] (=|+=) sum_k x[t, k] * W[n, k] in tiles of
// BM tokens x BN weight rows through workgroup memory. For each 32-element block of K, the
// workgroup loads the x tile and the weight tile (dequantized while loading: one Part per
// invocation and row), then each invocation accumulates a 4 x 4 register tile.
// With SWIGLU, the BN tile rows are BN/2 gate rows and their up rows, interleaved so each
// invocation's 4 rows are (gate c, gate c+1, up c, up c+1), and y = silu(gate . x) * (up . x).
// The weight format's wfmt_*.wgsl (wq, ws, Sc, wscale, wpart) is prepended.

@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

const BM: u32 = 32u; // tokens per tile
const BN: u32 = 64u; // weight rows per tile
const WGS: u32 = 128u; // (BN / 4) x (BM / 4) invocations
const SWIGLU: bool = {{SWIGLU}};

// xt[k * (BM / 4) + t4]: x[t, k] for tokens 4 t4 .. 4 t4 + 4 of the tile, element k of the block.
var<workgroup> xt: array<vec4<f32>, 256>;
// wt[k * (BN / 4) + n4]: W[n, k] for tile rows 4 n4 .. 4 n4 + 4.
var<workgroup> wt: array<vec4<f32>, 512>;

// The weight row of tile row `r` of the tile starting at output column n0.
fn weight_row(n0: u32, r: u32) -> u32 {
    if (SWIGLU) {
        // Tile rows 4j .. 4j+4 = gate 2j, gate 2j+1, up 2j, up 2j+1.
        let c = min(n0 + 2u * (r / 4u) + r % 2u, p.n_rows - 1u);
        return select(c, c + p.n_rows, r % 4u >= 2u);
    }
    return min(n0 + r, p.n_rows - 1u);
}

@compute @workgroup_size(128)
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
    let tx = lid % (BN / 4u); // rows 4 tx .. 4 tx + 4
    let ty = lid / (BN / 4u); // tokens 4 ty .. 4 ty + 4
    var acc: array<vec4<f32>, 4>; // acc[i]: token 4 ty + i, rows 4 tx .. 4 tx + 4
    for (var b = 0u; b < p.k_blocks; b++) {
        // Weight tile: BN rows x 4 parts, two per invocation.
        for (var e = 0u; e < 2u; e++) {
            let u = lid + e * WGS;
            let r = u / 4u;
            let q = u % 4u;
            let blk = weight_row(n0, r) * p.k_blocks + b;
            let w = wpart(blk, q, wscale(blk));
            for (var c = 0u; c < 4u; c++) {
                wt[(4u * q + c) * (BN / 4u) + r / 4u][r % 4u] = w.lo[c];
                wt[(16u + 4u * q + c) * (BN / 4u) + r / 4u][r % 4u] = w.hi[c];
            }
        }
        // x tile: BM tokens x 8 vec4s, two per invocation.
        for (var e = 0u; e < 2u; e++) {
            let u = lid + e * WGS;
            let t = u / 8u;
            let k4 = u % 8u;
            let v = x[min(t0 + t, m - 1u) * p.x_stride4 + b * 8u + k4];
            for (var c = 0u; c < 4u; c++) {
                xt[(4u * k4 + c) * (BM / 4u) + t / 4u][t % 4u] = v[c];
            }
        }
        workgroupBarrier();
        for (var k = 0u; k < 32u; k++) {
            let a = xt[k * (BM / 4u) + ty];
            let w = wt[k * (BN / 4u) + tx];
            acc[0] += a.x * w;
            acc[1] += a.y * w;
            acc[2] += a.z * w;
            acc[3] += a.w * w;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let t = t0 + 4u * ty + i;
        if (t >= m) {
            break;
        }
        if (SWIGLU) {
            for (var c = 0u; c < 2u; c++) {
                let n = n0 + 2u * tx + c;
                if (n < p.n_rows) {
                    y[t * p.y_stride + p.row0 + n] = silu(acc[i][c]) * acc[i][c + 2u];
                }
            }
        } else {
            for (var c = 0u; c < 4u; c++) {
                let n = n0 + 4u * tx + c;
                if (n < p.n_rows) {
                    store(t, n, acc[i][c]);
                }
            }
        }
    }
}
