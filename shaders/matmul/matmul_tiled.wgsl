// GPU profile, GEMM-sized steps: y[t, row0 + n] (=|+=) sum_k x[t, k] * W[n, k] in tiles of
// BM tokens x BN weight rows (a tuner variant: 64 x 64 or 32 x 64 with 64 invocations, 128 x 128
// with 256), one 32-element block of K at a time through workgroup memory. An invocation loads
// one weight row's block (scale record and codes decoded once, dequantized on the tile load)
// and/or one token's x block: with 64 invocations each loads a weight row and a token (the first
// BM store theirs), with 256 the first BN load weight rows and the next BM tokens. The blocks are
// stored transposed (k-major: consecutive invocations write consecutive words, no bank
// conflicts), as AB: f32, or f16 where the adapter has shader-f16 (half the workgroup memory and
// its traffic; clamped to f16's range, so a large activation is not inf). Then each invocation
// accumulates, in f32, an NJ x 8 register tile (tokens 4ty..4ty+3 and, for NJ = 8,
// BM/2+4ty..BM/2+4ty+3; rows 4tx..4tx+3 and BN/2+4tx..BN/2+4tx+3): per k, 2 + NJ / 4 vec4 loads
// from workgroup memory feed 8 NJ multiply-adds (reads are broadcasts or consecutive vec4s: no
// conflicts, so the tiles need no padding). The next block is loaded into registers before the
// current block is multiplied (double buffering through registers: one workgroup buffer, two
// barriers per block).
// With SWIGLU, tile rows 0..BN/2 are gate rows and BN/2..BN the same columns' up rows, so each
// invocation holds gate and up of its 4 columns and y = glu(gate . x) * (up . x).
// The weight format's wfmt_*.wgsl (wq, ws, Sc, wscale, wcodes, wterms) and the tile loads
// (matmul_tile_load.wgsl: x, weight_row, load_w, load_x) are prepended; BM, BN, WG, AB, TO_AB
// and the unrolled multiply-adds (FMA) are filled in when the pipeline is built (ops/gemm.rs).

const BM: u32 = {{BM}}u; // tokens per tile
const BN: u32 = {{BN}}u; // weight rows per tile
const WG: u32 = {{WG}}u; // invocations
const XQ: u32 = BM / 4u; // vec4s of one k row of the x tile
const WQ: u32 = BN / 4u; // vec4s of one k row of the weight tile
const NJ: u32 = {{NJ}}u; // tokens per invocation (4 or 8)
const TXN: u32 = BN / 8u; // invocations across a tile's rows
// Whether the loads are split (weight rows by the first BN invocations, tokens by the next BM).
const SPLIT: bool = WG >= BM + BN;
const SWIGLU: bool = {{SWIGLU}};
alias AB = {{AB}};

// xt[k * XQ + t / 4][t % 4] = x[t0 + t, 32 b + k]; wt[k * WQ + r / 4][r % 4] = W[row r, 32 b + k].
var<workgroup> xt: array<vec4<AB>, 32u * XQ>;
var<workgroup> wt: array<vec4<AB>, 32u * WQ>;

fn to_ab(v: f32) -> AB {
    {{TO_AB}}
}

@compute @workgroup_size(WG)
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
    let tx = lid % TXN; // rows 4 tx .. 4 tx + 4 and BN / 2 + 4 tx ..
    let ty = lid / TXN; // tokens 4 ty .. 4 ty + 4 (and BM / 2 + 4 ty .. for NJ = 8)
    // The weight row and the token this invocation loads (SPLIT: one of them).
    let wr = select(lid, min(lid, BN - 1u), SPLIT);
    let tr = select(lid % BM, min(lid - min(lid, BN), BM - 1u), SPLIT);
    let loads_w = !SPLIT || lid < BN;
    let loads_x = select((lid < BM), (lid >= BN), SPLIT);
    let my_row = weight_row(n0, wr);
    let my_tok = min(t0 + tr, m - 1u);
    // acc[2 j + h]: token j of the invocation's NJ (4 ty + j, then BM / 2 + 4 ty + j - 4), rows half h.
    var acc: array<vec4<f32>, 2u * NJ>;
    var wv: array<vec4<f32>, 8>;
    var xv: array<vec4<f32>, 8>;
    if (loads_w) {
        wv = load_w(my_row, 0u);
    }
    if (loads_x) {
        xv = load_x(my_tok, 0u);
    }
    for (var b = 0u; b < p.k_blocks; b++) {
        for (var i = 0u; i < 8u; i++) {
            for (var c = 0u; c < 4u; c++) {
                if (loads_w) {
                    wt[(4u * i + c) * WQ + wr / 4u][wr % 4u] = to_ab(wv[i][c]);
                }
                if (loads_x) {
                    xt[(4u * i + c) * XQ + tr / 4u][tr % 4u] = to_ab(xv[i][c]);
                }
            }
        }
        workgroupBarrier();
        if (b + 1u < p.k_blocks) {
            if (loads_w) {
                wv = load_w(my_row, b + 1u);
            }
            if (loads_x) {
                xv = load_x(my_tok, b + 1u);
            }
        }
        for (var k = 0u; k < 32u; k++) {
            let wa = vec4<f32>(wt[k * WQ + tx]);
            let wb = vec4<f32>(wt[k * WQ + TXN + tx]);
{{FMA}}
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < NJ; j++) {
        let t = t0 + (j / 4u) * (BM / 2u) + 4u * ty + j % 4u;
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
                    let n = n0 + (BN / 2u) * h + 4u * tx + c;
                    if (n < p.n_rows) {
                        store(t, n, acc[2u * j + h][c]);
                    }
                }
            }
        }
    }
}
