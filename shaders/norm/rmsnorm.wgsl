// y[r, :] = x[src, :] * rsqrt(mean(x[src, :]^2) + eps) * weight, one workgroup per output row.
// gather = 0: src = r over the step's n_tokens rows; gather = 1: src = md[off_sample + r]
// over its n_sample rows (the final norm, computed only where logits are needed). accumulate = 1:
// y[r, :] += the normalised row instead (Gemma's post-norms, into the residual), the sum then
// multiplied by out_scale (Gemma 4's layer_scalar; 1 elsewhere).

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: NormParams; // declared from Rust (ops/)
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> weight: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> md: array<u32>;
@group(0) @binding(5) var<storage, read_write> y: array<vec4<f32>>;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // One workgroup per row; the grid may be folded into 2-D (see Gpu::fold).
    let r = wid.x + wid.y * nwg.x;
    let m = select(step.n_tokens, step.n_sample, p.gather == 1u);
    if (r >= m) {
        return;
    }
    var src = r;
    if (p.gather == 1u) {
        src = md[p.off_sample + r];
    }
    let xb = src * p.dim4;
    var s = 0.0;
    for (var i = lid; i < p.dim4; i += WG) {
        let v = x[xb + i];
        s += dot(v, v);
    }
    partial[lid] = s;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k = k / 2u) {
        if (lid < k) {
            partial[lid] += partial[lid + k];
        }
        workgroupBarrier();
    }
    let scale = inverseSqrt(partial[0] / f32(p.dim4 * 4u) + p.eps);
    let yb = r * p.dim4;
    if (p.accumulate == 1u) {
        for (var i = lid; i < p.dim4; i += WG) {
            y[yb + i] = (y[yb + i] + x[xb + i] * scale * weight[i]) * p.out_scale;
        }
    } else {
        for (var i = lid; i < p.dim4; i += WG) {
            y[yb + i] = x[xb + i] * scale * weight[i];
        }
    }
}
