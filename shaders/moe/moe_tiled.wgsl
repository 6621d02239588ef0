// GPU profile, prefill-sized MoE steps: each expert's grouped pairs times its weights as a GEMM
// (a grouped GEMM), in tiles of BM = 32 pairs of one expert x BN = 64 weight rows through
// workgroup memory, so an expert's weights are read once per 32 of its pairs (moe.wgsl's grouped
// kernel reads them once per TG). The tiles: routing (moe_route.wgsl) put each expert's pairs in
// one run and counted, from p.off_tiles, how many tiles of BM the runs before each expert take
// (and at n_experts, all of them); workgroup g's tile is found by a binary search over those
// counts (every value the same in all invocations), its slots are the expert's run from its
// start + BM * (tile - the expert's first tile), up to the run's last pair.
// The loop is matmul_tiled.wgsl's with 32-token tiles and f32 operands: invocation lid loads
// weight row lid and (lid < 32) the x row of slot lid (the pair's token for gate/up, the pair
// for down; a slot past the run loads its first pair and stores nothing); then each
// accumulates 4 slots x 8 rows. Gate/up (GU): tile rows 0..31 are 32 gate rows and 32..63 the
// same columns' up rows, written act(gate + bias, up + bias) per pair; down: 64 rows, written
// per pair (the combine weights and sums them).
// MoeParams, the format's snippet, moe_common.wgsl and matmul_tile_load.wgsl precede this file.

const BM: u32 = 32u;
const BN: u32 = 64u;
const XQ: u32 = BM / 4u;
const WQ: u32 = BN / 4u;
const GU: bool = {{GU}};

var<workgroup> xt: array<vec4<f32>, 32u * XQ>;
var<workgroup> wt: array<vec4<f32>, 32u * WQ>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let g = wid.x + wid.y * nwg.x;
    let outs = select(BN, BN / 2u, GU);
    let col_groups = (p.n_out + outs - 1u) / outs;
    let tile = g / col_groups;
    let n0 = (g % col_groups) * outs;
    let ne = p.n_experts;
    if (tile >= route[p.off_tiles + ne]) {
        return;
    }
    // The last expert whose first tile is at or before `tile` (experts without pairs have as
    // many tiles before them as the next one, and tile < all tiles).
    var lo = 0u;
    var hi = ne;
    while (hi - lo > 1u) {
        let mid = (lo + hi) / 2u;
        if (route[p.off_tiles + mid] <= tile) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let e = lo;
    if (e < p.e0 || e >= p.e1) {
        return;
    }
    let run = route[p.off_counts + ne + e];
    let s0 = run + (tile - route[p.off_tiles + e]) * BM;
    let s_end = run + route[p.off_counts + e];
    let r0 = (e - p.e0) * p.rows_per_expert;
    // This invocation's weight row and x row.
    var my_row = r0 + min(n0 + lid, p.n_out - 1u);
    if (GU) {
        let c = min(n0 + lid % 32u, p.n_out - 1u);
        my_row = r0 + select(c, c + p.n_out, lid >= 32u);
    }
    let slot = select(s0, s0 + lid, s0 + lid < s_end);
    let pair = route[p.off_order + slot];
    let my_x = select(pair, pair / p.top_k, GU);
    let tx = lid % 8u;
    let ty = lid / 8u;
    var acc: array<vec4<f32>, 8>;
    var wv = load_w(my_row, 0u);
    var xv: array<vec4<f32>, 8>;
    if (lid < BM) {
        xv = load_x(my_x, 0u);
    }
    for (var b = 0u; b < p.k_blocks; b++) {
        for (var i = 0u; i < 8u; i++) {
            for (var c = 0u; c < 4u; c++) {
                wt[(4u * i + c) * WQ + lid / 4u][lid % 4u] = wv[i][c];
                if (lid < BM) {
                    xt[(4u * i + c) * XQ + lid / 4u][lid % 4u] = xv[i][c];
                }
            }
        }
        workgroupBarrier();
        if (b + 1u < p.k_blocks) {
            wv = load_w(my_row, b + 1u);
            if (lid < BM) {
                xv = load_x(my_x, b + 1u);
            }
        }
        for (var k = 0u; k < 32u; k++) {
            let wa = wt[k * WQ + tx];
            let wb = wt[k * WQ + 8u + tx];
{{FMA}}
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < 4u; j++) {
        let s = s0 + 4u * ty + j;
        if (s >= s_end) {
            continue;
        }
        let pr = route[p.off_order + s];
        for (var c = 0u; c < 4u; c++) {
            if (GU) {
                let n = n0 + 4u * tx + c;
                if (n < p.n_out) {
                    let gv = acc[2u * j][c] + bias_of(e, n);
                    let uv = acc[2u * j + 1u][c] + bias_of(e, p.n_out + n);
                    y[pr * p.y_stride + n] = act(gv, uv);
                }
            } else {
                for (var h = 0u; h < 2u; h++) {
                    let n = n0 + 32u * h + 4u * tx + c;
                    if (n < p.n_out) {
                        y[pr * p.y_stride + n] = acc[2u * j + h][c] + bias_of(e, n);
                    }
                }
            }
        }
    }
}
