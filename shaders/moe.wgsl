// The mixture-of-experts FFN (ops/moe.rs): routing, then the experts' gate/up and down
// projections, reading only the rows of the experts each token was routed to (ggml's mul_mat_id).
// The weight format's snippet (wq, ws, Sc, wscale, wpart) and MoeParams precede this file;
// the router is moe_route.wgsl.
//
// `route` holds, per (token t, choice j) pair p = t * top_k + j: route[2p] = the expert,
// route[2p + 1] = its weight (f32 bits). The experts of one tensor are split over chunks of whole
// experts (e0 <= e < e1 in this chunk; expert e's rows start at (e - e0) * p.rows_per_expert).

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: MoeParams;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> route: array<u32>;
@group(0) @binding(6) var<storage, read_write> y: array<f32>;
// Per-expert biases of the projection (MOE_BIAS; gpt-oss): bias[e * p.rows_per_expert + row].
@group(0) @binding(7) var<storage, read> bias: array<f32>;

const TN: u32 = {{TN}}u;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

// The expert's activation of (gate, up): SwiGLU, GeGLU (MOE_GELU), or gpt-oss's clamped SwiGLU
// (MOE_CLAMPED: gate clamped above at limit, up to [-limit, limit], gate * sigmoid(alpha * gate)
// * (up + 1)).
fn act(g: f32, u: f32) -> f32 {
    if ((p.flags & MOE_CLAMPED) != 0u) {
        let gc = min(g, p.limit);
        let uc = clamp(u, -p.limit, p.limit);
        return gc / (1.0 + exp(-p.alpha * gc)) * (uc + 1.0);
    }
    if ((p.flags & MOE_GELU) != 0u) {
        return gelu_tanh(g) * u;
    }
    return silu(g) * u;
}

// Dot products of TN consecutive weight rows from `row` (clamped to `last`) with x row `xr`.
fn dots(row: u32, last: u32, xr: u32) -> array<f32, TN> {
    var acc: array<f32, TN>;
    for (var b = 0u; b < p.k_blocks; b++) {
        var sc: array<Sc, TN>;
        for (var j = 0u; j < TN; j++) {
            sc[j] = wscale(min(row + j, last) * p.k_blocks + b);
        }
        for (var q = 0u; q < 4u; q++) {
            let xb = xr * p.x_stride4 + b * 8u + q;
            let xl = x[xb];
            let xh = x[xb + 4u];
            for (var j = 0u; j < TN; j++) {
                let w = wpart(min(row + j, last) * p.k_blocks + b, q, sc[j]);
                acc[j] += dot(w.lo, xl) + dot(w.hi, xh);
            }
        }
    }
    return acc;
}

// Gate and up of every (token, choice) pair routed to this chunk's experts: y[pair, n] (rows of
// p.y_stride floats) = act(gate_e[n] . x[t], up_e[n] . x[t]); expert e's gate rows first, then its
// up rows (p.rows_per_expert = 2 * p.n_out). One thread per (pair, TN outputs).
@compute @workgroup_size(64)
fn gate_up_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let inv = gid.x + gid.y * nwg.x * 64u;
    let groups = (p.n_out + TN - 1u) / TN;
    let pair = inv / groups;
    let n0 = (inv % groups) * TN;
    if (pair >= step.n_tokens * p.top_k) {
        return;
    }
    let e = route[2u * pair];
    if (e < p.e0 || e >= p.e1) {
        return;
    }
    let r0 = (e - p.e0) * p.rows_per_expert;
    let t = pair / p.top_k;
    let g = dots(r0 + n0, r0 + p.n_out - 1u, t);
    let u = dots(r0 + p.n_out + n0, r0 + 2u * p.n_out - 1u, t);
    for (var j = 0u; j < TN; j++) {
        let n = n0 + j;
        if (n < p.n_out) {
            var gv = g[j];
            var uv = u[j];
            if ((p.flags & MOE_BIAS) != 0u) {
                let bb = e * p.rows_per_expert;
                gv += bias[bb + n];
                uv += bias[bb + p.n_out + n];
            }
            y[pair * p.y_stride + n] = act(gv, uv);
        }
    }
}

// Down projections, weighted and summed into y (the residual): y[t, n] += sum over t's choices j
// routed to this chunk of w_j * (down_e[n] . x[pair]) (x = the gate/up output, p.x_stride4 vec4s
// per pair). One thread per (token, TN outputs).
@compute @workgroup_size(64)
fn down_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let inv = gid.x + gid.y * nwg.x * 64u;
    let groups = (p.n_out + TN - 1u) / TN;
    let t = inv / groups;
    let n0 = (inv % groups) * TN;
    if (t >= step.n_tokens) {
        return;
    }
    var acc: array<f32, TN>;
    var any = false;
    for (var j = 0u; j < p.top_k; j++) {
        let pair = t * p.top_k + j;
        let e = route[2u * pair];
        if (e < p.e0 || e >= p.e1) {
            continue;
        }
        any = true;
        let w = bitcast<f32>(route[2u * pair + 1u]);
        let r0 = (e - p.e0) * p.rows_per_expert;
        let d = dots(r0 + n0, r0 + p.n_out - 1u, pair);
        for (var k = 0u; k < TN; k++) {
            var v = d[k];
            if ((p.flags & MOE_BIAS) != 0u) {
                v += bias[e * p.rows_per_expert + min(n0 + k, p.n_out - 1u)];
            }
            acc[k] += w * v;
        }
    }
    if (!any) {
        return;
    }
    for (var k = 0u; k < TN; k++) {
        let n = n0 + k;
        if (n < p.n_out) {
            y[t * p.y_stride + n] += acc[k];
        }
    }
}
