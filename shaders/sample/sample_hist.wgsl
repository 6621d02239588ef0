// The sampler's thresholds by histogram (appended to sample.wgsl): instead of 32 bisection
// sweeps over the row, a few sweeps that each drop the candidates into NB bins by value
// (workgroup atomics: a count, or the fixed-point probability mass, and each bin's smallest and
// largest value), then one invocation walks the bins from the top to the one where the count or
// mass reaches what is needed; the next sweep bins only that bin's values over their own range
// [smallest, largest]. It stops when the bin holds one value, when a count is met exactly by the
// whole bin, or after HIST_PASSES sweeps; the threshold is the chosen bin's smallest value, so the
// kept set is every candidate at or above it, as a bisection's limit (ties kept).
// Mass is exp((v - gmax) / T) in units of 2^-31 (each term at most 2^31), summed exactly in 64
// bits (a low word and its carries), so no float atomics are needed.

const NB: u32 = 256u;
const HIST_PASSES: u32 = 4u;
var<workgroup> h_lo: array<atomic<u32>, NB>;
var<workgroup> h_hi: array<atomic<u32>, NB>;
var<workgroup> h_min: array<atomic<u32>, NB>;
var<workgroup> h_max: array<atomic<u32>, NB>;
// The walk's result: the chosen bin, whether to stop, and what is still needed within it.
var<workgroup> h_sel: u32;
var<workgroup> h_stop: u32;
var<workgroup> h_need: f32;

// Order-preserving u32 keys of f32 values, and back.
fn okey(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn from_okey(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u));
}

fn bin_weight(b: u32) -> f32 {
    return f32(atomicLoad(&h_hi[b])) * 4294967296.0 + f32(atomicLoad(&h_lo[b]));
}

// The smallest value such that the candidates (values >= lo0) at or above it reach `goal`: a
// count (top-k), or with `mass` a fraction of their probability mass at temperature 1 / inv_t
// (top-p).
fn hist_threshold(lid: u32, base: u32, lo0: f32, hi0: f32, goal: f32, gmax: f32, inv_t: f32, mass: bool) -> f32 {
    var lo: array<f32, HIST_PASSES>;
    var sc: array<f32, HIST_PASSES>;
    var sel: array<u32, HIST_PASSES>;
    var need = goal;
    var l = lo0;
    var h = hi0;
    var thr = lo0;
    for (var d = 0u; d < HIST_PASSES; d++) {
        lo[d] = l;
        sc[d] = select(f32(NB) / (h - l), 0.0, h <= l);
        for (var b = lid; b < NB; b += WG) {
            atomicStore(&h_lo[b], 0u);
            atomicStore(&h_hi[b], 0u);
            atomicStore(&h_min[b], 0xffffffffu);
            atomicStore(&h_max[b], 0u);
        }
        workgroupBarrier();
        for (var i = lid; i < p.vocab; i += WG) {
            let v = logits[base + i];
            if (v < lo0) {
                continue;
            }
            // Its bin at every level so far: in this sweep only if it was in each chosen bin.
            var inside = true;
            var bin = 0u;
            for (var e = 0u; e <= d; e++) {
                bin = min(u32(max(v - lo[e], 0.0) * sc[e]), NB - 1u);
                if (e < d && bin != sel[e]) {
                    inside = false;
                    break;
                }
            }
            if (!inside) {
                continue;
            }
            if (mass) {
                let q = u32(exp((v - gmax) * inv_t) * 2147483648.0);
                let old = atomicAdd(&h_lo[bin], q);
                if (old > 0xffffffffu - q) {
                    atomicAdd(&h_hi[bin], 1u);
                }
            } else {
                atomicAdd(&h_lo[bin], 1u);
            }
            atomicMin(&h_min[bin], okey(v));
            atomicMax(&h_max[bin], okey(v));
        }
        workgroupBarrier();
        if (lid == 0u) {
            if (mass && d == 0u) {
                var total = 0.0;
                for (var b = 0u; b < NB; b++) {
                    total += bin_weight(b);
                }
                need = goal * total;
            }
            var cum = 0.0;
            var pick = 0u;
            var rest = need;
            for (var b = NB; b > 0u; b--) {
                let w = bin_weight(b - 1u);
                if (w > 0.0) {
                    pick = b - 1u;
                    rest = need - cum;
                    if (cum + w >= need) {
                        break;
                    }
                }
                cum += w;
            }
            let one_value = atomicLoad(&h_min[pick]) == atomicLoad(&h_max[pick]);
            let exact = !mass && bin_weight(pick) == rest;
            h_sel = pick;
            h_need = rest;
            h_stop = select(0u, 1u, one_value || exact);
        }
        let s = workgroupUniformLoad(&h_sel);
        sel[d] = s;
        need = workgroupUniformLoad(&h_need);
        thr = from_okey(atomicLoad(&h_min[s]));
        l = thr;
        h = from_okey(atomicLoad(&h_max[s]));
        if (workgroupUniformLoad(&h_stop) == 1u) {
            break;
        }
        workgroupBarrier();
    }
    // No invocation may clear the bins (a second call) while another still reads them.
    workgroupBarrier();
    return thr;
}
