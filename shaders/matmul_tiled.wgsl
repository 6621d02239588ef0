// GPU profile, GEMM-sized steps: y[t, row0 + n] (=|+=) sum_k x[t, k] * W[n, k] in tiles of
// BM tokens (64 or 32: a tuner variant) x BN = 64 weight rows, one 32-element block of K at a
// time through workgroup memory. Each of the 64 invocations loads one weight row's block (scale
// record and codes decoded once, dequantized on the tile load) and one token's x block (the
// first BM invocations store theirs), and stores them transposed (k-major: consecutive
// invocations write consecutive words, no bank conflicts), as AB: f32, or f16 where the adapter
// has shader-f16 (half the workgroup memory and its traffic; clamped to f16's range, so a large
// activation is not inf). Then each accumulates, in f32, a (BM / 8) x 8 register tile (tokens
// 4ty..4ty+3 and, for BM = 64, 32+4ty..32+4ty+3; rows 4tx..4tx+3 and 32+4tx..32+4tx+3): per k,
// 2 + BM / 32 vec4 loads from workgroup memory feed BM multiply-adds (reads are broadcasts or
// consecutive vec4s: no conflicts, so the tiles need no padding). The next block's weights and x
// are loaded into registers before the current block is multiplied (double buffering through
// registers: one workgroup buffer, two barriers per block).
// With SWIGLU, tile rows 0..31 are 32 gate rows and 32..63 the same columns' up rows, so each
// invocation holds gate and up of its 4 columns and y = glu(gate . x) * (up . x).
// The weight format's wfmt_*.wgsl (wq, ws, Sc, wscale, wcodes, wterms) and the tile loads
// (matmul_tile_load.wgsl: x, weight_row, load_w, load_x) are prepended; BM, AB, TO_AB and the
// unrolled multiply-adds (FMA) are filled in when the pipeline is built (ops/gemm.rs).

const BM: u32 = {{BM}}u; // tokens per tile
const BN: u32 = 64u; // weight rows per tile
const XQ: u32 = BM / 4u; // vec4s of one k row of the x tile
const NJ: u32 = BM / 8u; // tokens per invocation
const SWIGLU: bool = {{SWIGLU}};
alias AB = {{AB}};

// xt[k * XQ + t / 4][t % 4] = x[t0 + t, 32 b + k]; wt[k * 16 + r / 4][r % 4] = W[row r, 32 b + k].
var<workgroup> xt: array<vec4<AB>, 32u * XQ>;
var<workgroup> wt: array<vec4<AB>, 512>;

fn to_ab(v: f32) -> AB {
    {{TO_AB}}
}

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
    let ty = lid / 8u; // tokens 4 ty .. 4 ty + 4 (and 32 + 4 ty .. for BM = 64)
    let my_row = weight_row(n0, lid);
    let my_tok = min(t0 + lid % BM, m - 1u);
    // acc[2 j + h]: token j of the invocation's NJ (4 ty + j, then 32 + 4 ty + j - 4), rows half h.
    var acc: array<vec4<f32>, 2u * NJ>;
    var wv = load_w(my_row, 0u);
    var xv = load_x(my_tok, 0u);
    for (var b = 0u; b < p.k_blocks; b++) {
        for (var i = 0u; i < 8u; i++) {
            for (var c = 0u; c < 4u; c++) {
                wt[(4u * i + c) * 16u + lid / 4u][lid % 4u] = to_ab(wv[i][c]);
                if (lid < BM) {
                    xt[(4u * i + c) * XQ + lid / 4u][lid % 4u] = to_ab(xv[i][c]);
                }
            }
        }
        workgroupBarrier();
        if (b + 1u < p.k_blocks) {
            wv = load_w(my_row, b + 1u);
            xv = load_x(my_tok, b + 1u);
        }
        for (var k = 0u; k < 32u; k++) {
            let wa = vec4<f32>(wt[k * 16u + tx]);
            let wb = vec4<f32>(wt[k * 16u + 8u + tx]);
{{FMA}}
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < NJ; j++) {
        let t = t0 + (j / 4u) * 32u + 4u * ty + j % 4u;
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
