// GPU profile, decode steps of one token: y[t, row0 + n] (=|+=) sum_k x[t, k] * W[n, k].
// Steps of 2-16 tokens per workgroup take matmul_gpu_tokens.wgsl (one row per 16 invocations:
// sharing x across rows, as here, keeps every token's x block live at once).
// One workgroup per NR weight rows x TM tokens; the workgroups of the same rows for the step's
// other TM-token groups are next in the grid, so they run together and the rows come from the
// cache for all but the first. The WG invocations form WG / L groups of L
// (`lanes_per_row`: 64, 32 or 16, so that rows of few blocks still keep most invocations busy);
// group q takes rows q, q + WG / L, ... of the NR, and its invocation j the 32-element blocks
// j, j + L, ..., so consecutive invocations read consecutive blocks. Per block, each token's
// x block is taken once (`xblock`) and shared by the NR rows; per block and row, `block_dot`
// decodes the scale record and the codes once and multiplies them with the x block. How x is
// read is the X part's (matmul_gpu_x*.wgsl, filled in below): f32 activations (the weights'
// codes as floats, one multiply-add per weight), or activations quantized to int8 per 32
// values by quantize_x8.wgsl (the codes packed four to a word, dot4I8Packed). The NV partial
// sums of each invocation are reduced with subgroupAdd where the adapter has subgroups,
// else through workgroup memory (the REDUCE snippet of sources.rs), into `tot`.
// With SWIGLU, the NR weight rows are NR/2 gate rows and the same up rows (gate rows first in
// the chunk, up rows n_rows later) and y = glu(gate . x) * (up . x).
// The weight format's wfmt_*.wgsl (wq, ws, Sc, wscale, wcodes, wterms, WMIN and, for int8,
// wcodes8 and wterms8) is prepended. PREP is empty, or (the table formats' int8 path) the
// workgroup's table fill (`wprep`) and a barrier, in uniform control flow: every invocation of
// a workgroup that gets past the grid check reaches it.

{{X}}

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
{{PREP}}
    var acc: array<f32, NV>;
    let lanes = lanes_per_row(p.k_blocks);
    let groups = WG / lanes;
    let grp = lid / lanes;
    for (var b = lid % lanes; b < p.k_blocks; b += lanes) {
        var xbs: array<XB, TM>;
        for (var i = 0u; i < TM; i++) {
            xbs[i] = xblock(min(t0 + i, m - 1u), b);
        }
        for (var r = 0u; r < NR; r++) {
            // Rows of other groups stay 0 here: the reduction over all invocations adds them.
            if (r % groups != grp) {
                continue;
            }
            let blk = rows[r] * p.k_blocks + b;
            for (var i = 0u; i < TM; i++) {
                acc[i * NR + r] += block_dot(blk, xbs[i]);
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
