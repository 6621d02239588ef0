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

struct MatParams {
    k_blocks: u32,  // K / 32
    n_rows: u32,    // rows of this chunk (for swiglu: rows of the gate half)
    row0: u32,      // first output column written by this chunk
    y_stride: u32,  // floats per output row
    x_stride4: u32, // vec4s per input row
    m_src: u32,     // 0: the step's n_tokens rows, 1: its n_sample rows
    flags: u32,     // 1: add bias, 2: accumulate into y, 4: y = silu(y) * result (SwiGLU's up half)
    _pad: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: MatParams;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> bias: array<f32>;
@group(0) @binding(6) var<storage, read_write> y: array<f32>;

const TM: u32 = {{TM}}u;
const NR: u32 = 4u;
const WG: u32 = 64u;
const NV: u32 = TM * NR;
const SWIGLU: bool = {{SWIGLU}};

// Partial sums, then (slot k * WG) the workgroup's total of output k.
var<workgroup> red: array<f32, NV * WG>;

fn rows_m() -> u32 {
    return select(step.n_tokens, step.n_sample, p.m_src == 1u);
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

fn store(t: u32, n: u32, v: f32) {
    var r = v;
    if ((p.flags & 1u) != 0u) {
        r += bias[p.row0 + n];
    }
    let idx = t * p.y_stride + p.row0 + n;
    if ((p.flags & 2u) != 0u) {
        r += y[idx];
    }
    if ((p.flags & 4u) != 0u) {
        r = silu(y[idx]) * r;
    }
    y[idx] = r;
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
