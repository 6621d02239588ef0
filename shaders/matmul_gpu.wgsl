// GPU profile, decode-sized steps (m <= 8 rows): y[t, row0 + n] (=|+=) sum_k x[t, k] * W[n, k].
// One workgroup per NR weight rows x TM tokens. The K dimension is cut into units of 8 weights
// (one part of a 32-element block, see Part): invocation i takes units i, i + WG, ..., so
// consecutive invocations read consecutive weight words and consecutive x vec4s. Each weight
// unit is loaded once and used for all TM tokens (batched decode reads each weight once per TM
// rows). The WG partial sums of each output are reduced with subgroupAdd where the adapter has
// subgroups, else through workgroup memory (the REDUCE snippet of kernels.rs).
// With SWIGLU, the NR weight rows are NR/2 gate rows and the same up rows (gate rows first in
// the chunk, up rows n_rows later) and y = silu(gate . x) * (up . x).
// The weight format's wfmt_*.wgsl (wq, ws, Sc, wscale, wpart) is prepended.

@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

const TM: u32 = {{TM}}u;
const NR: u32 = 4u;
const WG: u32 = 64u;
const NV: u32 = TM * NR;
const SWIGLU: bool = {{SWIGLU}};

// Partial sums, then (slot k * WG) the workgroup's total of output k.
var<workgroup> red: array<f32, NV * WG>;

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
    let t0 = (g / col_groups) * TM;
    let n0 = (g % col_groups) * outs;
    if (t0 >= m) {
        return;
    }
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
    let units = p.k_blocks * 4u;
    for (var u = lid; u < units; u += WG) {
        let b = u / 4u;
        let q = u % 4u;
        var w: array<Part, NR>;
        for (var r = 0u; r < NR; r++) {
            let blk = rows[r] * p.k_blocks + b;
            w[r] = wpart(blk, q, wscale(blk));
        }
        for (var i = 0u; i < TM; i++) {
            let xb = min(t0 + i, m - 1u) * p.x_stride4 + b * 8u + q;
            let xl = x[xb];
            let xh = x[xb + 4u];
            for (var r = 0u; r < NR; r++) {
                acc[i * NR + r] += dot(w[r].lo, xl) + dot(w[r].hi, xh);
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
                let gate = red[(i * NR + c) * WG];
                let up = red[(i * NR + c + h) * WG];
                y[(t0 + i) * p.y_stride + p.row0 + n0 + c] = silu(gate) * up;
            }
        }
    } else if (lid < NV) {
        let i = lid / NR;
        let r = lid % NR;
        if (t0 + i < m && n0 + r < p.n_rows) {
            store(t0 + i, n0 + r, red[lid * WG]);
        }
    }
}
