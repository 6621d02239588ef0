// GPU profile, decode-sized steps (m <= 64 rows): y[t, row0 + n] (=|+=) sum_k x[t, k] * W[n, k].
// Built for one token per workgroup (TM = 1, a step of one token); steps of more take
// matmul_gpu_tokens.wgsl (one row per 16 invocations: sharing x across rows, as here, keeps
// every token's x block live at once).
// One workgroup per NR weight rows x TM tokens; the workgroups of the same rows for the step's
// other TM-token groups are next in the grid, so they run together and the rows come from the
// cache for all but the first (more than 16 rows: several groups of 16, a grid as large as at
// batch 1 instead of a few 64 x 64 tiles). The WG invocations form WG / L groups of L
// (`lanes_per_row`: 64, 32 or 16, so that rows of few blocks still keep most invocations busy);
// group q takes rows q, q + WG / L, ... of the NR, and its invocation j the 32-element blocks
// j, j + L, ..., so consecutive invocations read consecutive blocks. Per block and
// row, the scale record is decoded once (`wscale`), the codes once (`wcodes`: 32 raw codes,
// integer offsets already subtracted), and each token's contribution is
//   d_lo * (codes_lo . x_lo) + d_hi * (codes_hi . x_hi) [+ m_lo * sum(x_lo) + m_hi * sum(x_hi)]
// (`wterms`: the block's two 16-element halves' scales and, for formats with a min (`WMIN`),
// their mins, applied once through the sums of x, which are shared by the NR rows). So a weight
// costs one multiply-add per token and each weight is read once for all TM tokens. The NV
// partial sums of each invocation are reduced with subgroupAdd where the adapter has subgroups,
// else through workgroup memory (the REDUCE snippet of sources.rs), into `tot`.
// With SWIGLU, the NR weight rows are NR/2 gate rows and the same up rows (gate rows first in
// the chunk, up rows n_rows later) and y = glu(gate . x) * (up . x).
// The weight format's wfmt_*.wgsl (wq, ws, Sc, wscale, wcodes, wterms, WMIN) is prepended.

@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

const TM: u32 = {{TM}}u;
const NR: u32 = 4u;
const WG: u32 = 64u;
const NV: u32 = TM * NR;
const SWIGLU: bool = {{SWIGLU}};

// The workgroup's total of output k = token * NR + row.
var<workgroup> tot: array<f32, NV>;
{{RED_DECL}}

// Invocations per row group: the most of 64, 32 and 16 that still keeps 3 in 4 invocations busy
// on the row's blocks (rows of 48 blocks or more: all 64 on every row, sharing each token's x
// across the NR rows; short rows: NR groups of 16, one row each).
fn lanes_per_row(k_blocks: u32) -> u32 {
    if (k_blocks >= 48u) {
        return 64u;
    }
    return select(16u, 32u, k_blocks >= 24u);
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
    // The grid may be folded into 2-D (see Gpu::fold): the linear workgroup index.
    let g = wid.x + wid.y * nwg.x;
    let outs = select(NR, NR / 2u, SWIGLU); // output columns per workgroup
    let col_groups = (p.n_rows + outs - 1u) / outs;
    let m = rows_m();
    let t_groups = (m + TM - 1u) / TM;
    if (g >= col_groups * t_groups) {
        return;
    }
    let t0 = (g % t_groups) * TM;
    let n0 = (g / t_groups) * outs;
    var rows: array<u32, NR>;
    for (var r = 0u; r < NR; r++) {
        if (SWIGLU) {
            let c = min(n0 + r % (NR / 2u), p.n_rows - 1u);
            rows[r] = select(c, c + p.n_rows, r >= NR / 2u);
        } else {
            rows[r] = min(n0 + r, p.n_rows - 1u);
        }
    }
    var acc: array<f32, NV>;
    let lanes = lanes_per_row(p.k_blocks);
    let groups = WG / lanes;
    let grp = lid / lanes;
    for (var b = lid % lanes; b < p.k_blocks; b += lanes) {
        // Sums of each token's x over the block's halves (formats with a min only).
        var xs: array<vec2<f32>, TM>;
        if (WMIN) {
            for (var i = 0u; i < TM; i++) {
                let xb = min(t0 + i, m - 1u) * p.x_stride4 + b * 8u;
                let lo = x[xb] + x[xb + 1u] + x[xb + 2u] + x[xb + 3u];
                let hi = x[xb + 4u] + x[xb + 5u] + x[xb + 6u] + x[xb + 7u];
                xs[i] = vec2<f32>(dot(lo, vec4<f32>(1.0)), dot(hi, vec4<f32>(1.0)));
            }
        }
        for (var r = 0u; r < NR; r++) {
            // Rows of other groups stay 0 here: the reduction over all invocations adds them.
            if (r % groups != grp) {
                continue;
            }
            let blk = rows[r] * p.k_blocks + b;
            let s = wscale(blk);
            let c = wcodes(blk, s);
            let tm = wterms(s);
            for (var i = 0u; i < TM; i++) {
                let xb = min(t0 + i, m - 1u) * p.x_stride4 + b * 8u;
                let lo = dot(c[0], x[xb]) + dot(c[1], x[xb + 1u]) + dot(c[2], x[xb + 2u]) + dot(c[3], x[xb + 3u]);
                let hi =
                    dot(c[4], x[xb + 4u]) + dot(c[5], x[xb + 5u]) + dot(c[6], x[xb + 6u]) + dot(c[7], x[xb + 7u]);
                var v = lo * tm.x + hi * tm.y;
                if (WMIN) {
                    v += xs[i].x * tm.z + xs[i].y * tm.w;
                }
                acc[i * NR + r] += v;
            }
        }
    }
{{REDUCE}}
    workgroupBarrier();
    if (SWIGLU) {
        let h = NR / 2u;
        if (lid < TM * h) {
            let i = lid / h;
            let c = lid % h;
            if (t0 + i < m && n0 + c < p.n_rows) {
                let gate = tot[i * NR + c];
                let up = tot[i * NR + c + h];
                y[(t0 + i) * p.y_stride + p.row0 + n0 + c] = glu(gate) * up;
            }
        }
    } else if (lid < NV) {
        let i = lid / NR;
        let r = lid % NR;
        if (t0 + i < m && n0 + r < p.n_rows) {
            store(t0 + i, n0 + r, tot[lid]);
        }
    }
}
