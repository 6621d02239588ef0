// y[t, row0 + n] (=|+=) sum_k x[t, k] * W[n, k] (+ bias[n])
// W is one row-chunk of a weight matrix in the format given by the wfmt_*.wgsl prepended to this
// file (it defines wq, ws, the per-block scale struct Sc, wscale(block) and wpart(block, part, Sc)).
// Each thread computes TM tokens x TN rows in registers;
// no workgroup memory (fast on llvmpipe, still fine on real GPUs for decode).
// TM, TN and WG are substituted when the pipeline is built: TM = 1 for decode-sized steps.

// Activations: storage, or a uniform window (see matmul_source).
{{X_BINDING}}

const TM: u32 = {{TM}}u;
const TN: u32 = {{TN}}u;

{{WINDOW}}

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    // This dispatch covers rows base .. base + m of the step (a uniform-x window; else all).
    let base = window_base();
    let m = window_rows(rows_m());
    let n0 = gid.x * TN;
    let t0 = gid.y * TM;
    if (n0 >= p.n_rows || t0 >= m) {
        return;
    }
    var acc: array<array<f32, TN>, TM>;
    var w: array<Part, TN>;
    var sc: array<Sc, TN>;
    for (var b = 0u; b < p.k_blocks; b++) {
        // Each row's block scales once per block, then its four parts.
        for (var j = 0u; j < TN; j++) {
            sc[j] = wscale(min(n0 + j, p.n_rows - 1u) * p.k_blocks + b);
        }
        for (var q = 0u; q < 4u; q++) {
            for (var j = 0u; j < TN; j++) {
                w[j] = wpart(min(n0 + j, p.n_rows - 1u) * p.k_blocks + b, q, sc[j]);
            }
            for (var i = 0u; i < TM; i++) {
                let xb = min(t0 + i, m - 1u) * p.x_stride4 + b * 8u + q;
                let xl = x[xb];
                let xh = x[xb + 4u];
                for (var j = 0u; j < TN; j++) {
                    acc[i][j] += dot(w[j].lo, xl) + dot(w[j].hi, xh);
                }
            }
        }
    }
    for (var i = 0u; i < TM; i++) {
        for (var j = 0u; j < TN; j++) {
            if (t0 + i < m && n0 + j < p.n_rows) {
                store(base + t0 + i, n0 + j, acc[i][j]);
            }
        }
    }
}

// Gate and up projections in one chunk (gate rows first, then up rows, n_rows each);
// y[t, row0 + n] = glu(gate[n] . x[t]) * (up[n] . x[t]).
@compute @workgroup_size({{WG}})
fn main_swiglu(@builtin(global_invocation_id) gid: vec3<u32>) {
    // This dispatch covers rows base .. base + m of the step (a uniform-x window; else all).
    let base = window_base();
    let m = window_rows(rows_m());
    let n0 = gid.x * TN;
    let t0 = gid.y * TM;
    if (n0 >= p.n_rows || t0 >= m) {
        return;
    }
    var g: array<array<f32, TN>, TM>;
    var u: array<array<f32, TN>, TM>;
    var wg: array<Part, TN>;
    var wu: array<Part, TN>;
    var sg: array<Sc, TN>;
    var su: array<Sc, TN>;
    for (var b = 0u; b < p.k_blocks; b++) {
        for (var j = 0u; j < TN; j++) {
            let n = min(n0 + j, p.n_rows - 1u);
            sg[j] = wscale(n * p.k_blocks + b);
            su[j] = wscale((n + p.n_rows) * p.k_blocks + b);
        }
        for (var q = 0u; q < 4u; q++) {
            for (var j = 0u; j < TN; j++) {
                let n = min(n0 + j, p.n_rows - 1u);
                wg[j] = wpart(n * p.k_blocks + b, q, sg[j]);
                wu[j] = wpart((n + p.n_rows) * p.k_blocks + b, q, su[j]);
            }
            for (var i = 0u; i < TM; i++) {
                let xb = min(t0 + i, m - 1u) * p.x_stride4 + b * 8u + q;
                let xl = x[xb];
                let xh = x[xb + 4u];
                for (var j = 0u; j < TN; j++) {
                    g[i][j] += dot(wg[j].lo, xl) + dot(wg[j].hi, xh);
                    u[i][j] += dot(wu[j].lo, xl) + dot(wu[j].hi, xh);
                }
            }
        }
    }
    for (var i = 0u; i < TM; i++) {
        for (var j = 0u; j < TN; j++) {
            if (t0 + i < m && n0 + j < p.n_rows) {
                y[(base + t0 + i) * p.y_stride + p.row0 + n0 + j] = glu(g[i][j]) * u[i][j];
            }
        }
    }
}
