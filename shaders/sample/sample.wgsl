// Sampling, one workgroup of WG invocations per logits row (both profiles: on llvmpipe a row's
// sweeps stay within its loop limit, 65535 iterations per invocation, at 256 invocations even for
// a 262144-token vocabulary with 20 top log-probabilities); invocation j reads logits j, j + WG, ... (consecutive invocations read consecutive
// words), and the draw's cumulative mass runs over the invocations' shares in that order.
// Per-row parameters live in md at off_params + PARAMS_STRIDE * r: temperature (f32 bits), top_p
// (f32 bits), top_k (u32), u (f32 bits, a uniform draw in [0, 1) made on the host from the
// request's seeded generator), three penalty words (used by logit_adjust.wgsl), n_top (top
// log-probabilities wanted, <= MAX_TOP), two adjustment words (logit_adjust.wgsl), min_p (f32 bits;
// word 10), the token mask (word 11, applied by logit_adjust.wgsl: tokens it does not allow hold
// MASKED_LOGIT, which the minimum below skips so the top-k/top-p thresholds span the allowed tokens
// only, and which no draw or argmax picks while any token is allowed), the forced token (word 12:
// NO_FORCE, or a token id the row reports instead of sampling, for prompt log-probabilities).
// PARAMS_STRIDE, NO_MASK, NO_FORCE and MASKED_LOGIT are prepended from Rust
// (kernels::sampler_source). temperature <= 0 is greedy (argmax, lowest id on ties). Otherwise the
// candidates are the top_k largest logits (0 = all) whose probability at this temperature is at
// least min_p times the largest (0 = off; the logit threshold max + temperature * ln(min_p)), then
// the smallest top set of those whose probability reaches top_p; thresholds are found by histogram
// on the logit value (sample_hist.wgsl), so no sort is needed. Writes per row, RESULT_STRIDE words: token id, its
// log-probability (log-softmax of the row's logits after penalties and bias, before temperature and
// filtering), then n_top (id, logprob) pairs of the most likely tokens, most likely first (ties:
// lower id first).

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: SamplerParams; // declared from Rust (ops/sample.rs)
@group(0) @binding(2) var<storage, read> md: array<u32>;
@group(0) @binding(3) var<storage, read> logits: array<f32>;
@group(0) @binding(4) var<storage, read_write> result: array<u32>;

const WG: u32 = {{WG}}u;
const RESULT_STRIDE: u32 = 42u;
var<workgroup> red_f: array<f32, WG>;
var<workgroup> red_u: array<u32, WG>;
var<workgroup> picked: u32;

fn sum_all(lid: u32, v: f32) -> f32 {
    red_f[lid] = v;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k = k / 2u) {
        if (lid < k) {
            red_f[lid] += red_f[lid + k];
        }
        workgroupBarrier();
    }
    let r = red_f[0];
    workgroupBarrier();
    return r;
}

struct Best {
    value: f32,
    index: u32,
}

// The workgroup's largest value, lowest index on ties.
fn argmax_all(lid: u32, v: f32, i: u32) -> Best {
    red_f[lid] = v;
    red_u[lid] = i;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k = k / 2u) {
        if (lid < k) {
            let ov = red_f[lid + k];
            let oi = red_u[lid + k];
            if (ov > red_f[lid] || (ov == red_f[lid] && oi < red_u[lid])) {
                red_f[lid] = ov;
                red_u[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    let b = Best(red_f[0], red_u[0]);
    workgroupBarrier();
    return b;
}

fn min_all(lid: u32, v: f32) -> f32 {
    red_f[lid] = v;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k = k / 2u) {
        if (lid < k) {
            red_f[lid] = min(red_f[lid], red_f[lid + k]);
        }
        workgroupBarrier();
    }
    let r = red_f[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // One workgroup per row; the grid may be folded into 2-D (see Gpu::fold).
    let r = wid.x + wid.y * nwg.x;
    if (r >= step.n_sample) {
        return;
    }
    let pb = p.off_params + PARAMS_STRIDE * r;
    let temperature = bitcast<f32>(md[pb + W_TEMPERATURE]);
    let top_p = bitcast<f32>(md[pb + W_TOP_P]);
    let top_k = md[pb + W_TOP_K];
    let u = bitcast<f32>(md[pb + W_U]);
    let min_p = bitcast<f32>(md[pb + W_MIN_P]);
    let n_top = min(md[pb + W_N_TOP], MAX_TOP);

    let base = r * p.vocab;

    // Pass 1: max with its lowest index, and min.
    var mx = -3.0e38;
    var am = 0xffffffffu;
    var mn = 3.0e38;
    for (var i = lid; i < p.vocab; i += WG) {
        let v = logits[base + i];
        if (v > mx) {
            mx = v;
            am = i;
        }
        if (v > MASKED_LOGIT) {
            mn = min(mn, v);
        }
    }
    let best = argmax_all(lid, mx, am);
    let gmax = best.value;
    let gargmax = best.index;
    let gmin = min_all(lid, mn);

    // Log-sum-exp of the raw logits, for log-probabilities.
    var se = 0.0;
    for (var i = lid; i < p.vocab; i += WG) {
        se += exp(logits[base + i] - gmax);
    }
    let lse = gmax + log(sum_all(lid, se));

    let force = md[pb + W_FORCE];
    if (force != NO_FORCE) {
        picked = min(force, p.vocab - 1u);
    } else if (temperature <= 0.0) {
        picked = gargmax;
    } else {
        draw(lid, base, gmin, gmax, gargmax, temperature, top_p, top_k, min_p, u);
    }
    workgroupBarrier();
    let pick = picked;
    let ob = RESULT_STRIDE * r;
    if (lid == 0u) {
        result[ob] = pick;
        result[ob + 1u] = bitcast<u32>(logits[base + pick] - lse);
    }

    // Top log-probabilities: repeated arg-max below the previous (value, id) in the order
    // value descending, id ascending.
    var pv = 3.0e38;
    var pi = 0u;
    for (var j = 0u; j < n_top; j++) {
        var bv = -3.0e38;
        var bi = 0xffffffffu;
        for (var i = lid; i < p.vocab; i += WG) {
            let v = logits[base + i];
            let below = v < pv || (v == pv && i > pi);
            if (below && (v > bv || (v == bv && i < bi))) {
                bv = v;
                bi = i;
            }
        }
        let best = argmax_all(lid, bv, bi);
        pv = best.value;
        pi = best.index;
        if (lid == 0u) {
            result[ob + 2u + 2u * j] = pi;
            result[ob + 3u + 2u * j] = bitcast<u32>(pv - lse);
        }
    }
}

// Temperature / top-k / min-p / top-p draw; leaves the chosen id in `picked` (set by one thread).
fn draw(lid: u32, base: u32, gmin: f32, gmax: f32, gargmax: u32, temperature: f32,
        top_p: f32, top_k: u32, min_p: f32, u: f32) {
    let inv_t = 1.0 / temperature;

    // Top-k: the largest threshold with at least k logits at or above it.
    var thr = gmin;
    if (top_k > 0u && top_k < p.vocab) {
        thr = hist_threshold(lid, base, gmin, gmax, f32(top_k), gmax, inv_t, false);
    }

    // Min-p: exp((v - gmax) / T) >= min_p  <=>  v >= gmax + T ln(min_p). The argmax always stays.
    if (min_p > 0.0) {
        thr = max(thr, gmax + temperature * log(min(min_p, 1.0)));
    }

    // Top-p: the largest threshold whose kept probability mass reaches top_p.
    if (top_p < 1.0) {
        thr = hist_threshold(lid, base, thr, gmax, top_p, gmax, inv_t, true);
    }

    // Draw: find the candidate where the cumulative mass passes u * total.
    var part = 0.0;
    for (var i = lid; i < p.vocab; i += WG) {
        let v = logits[base + i];
        part += select(0.0, exp((v - gmax) * inv_t), v >= thr);
    }
    red_f[lid] = part;
    workgroupBarrier();
    if (lid == 0u) {
        var total = 0.0;
        for (var k = 0u; k < WG; k++) {
            total += red_f[k];
        }
        let goal = u * total;
        var acc = 0.0;
        var owner = 0u;
        var before = 0.0;
        for (var k = 0u; k < WG; k++) {
            if (red_f[k] > 0.0) {
                owner = k;
                before = acc;
                if (acc + red_f[k] > goal) {
                    break;
                }
            }
            acc += red_f[k];
        }
        red_u[0] = owner;
        red_f[0] = goal - before;
    }
    workgroupBarrier();
    if (lid == red_u[0]) {
        let rest = red_f[0];
        var acc = 0.0;
        var pick = gargmax;
        for (var i = lid; i < p.vocab; i += WG) {
            let v = logits[base + i];
            if (v >= thr) {
                pick = i;
                acc += exp((v - gmax) * inv_t);
                if (acc > rest) {
                    break;
                }
            }
        }
        picked = pick;
    }
}
