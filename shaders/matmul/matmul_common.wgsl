// What every matmul variant shares (prepended after MatParams, its MAT_* flags and the weight
// format): the step, parameter, bias and output bindings, and the output epilogue.

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: MatParams;
@group(0) @binding(5) var<storage, read> bias: array<f32>;
@group(0) @binding(6) var<storage, read_write> y: array<f32>;

// Rows of x: the step's tokens, or its sampled rows (the LM head).
fn rows_m() -> u32 {
    return select(step.n_tokens, step.n_sample, p.m_src == 1u);
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

// The gated FFN's activation of the gate: SiLU (SwiGLU), or with MAT_GELU tanh-GELU (GeGLU).
fn glu(v: f32) -> f32 {
    if ((p.flags & MAT_GELU) != 0u) {
        return gelu_tanh(v);
    }
    return silu(v);
}

// y[t, row0 + n] = v, with the bias added, soft-capped (cap * tanh(v / cap): Gemma 2's final
// logits), accumulated into y, or as the gated FFN's up half.
fn store(t: u32, n: u32, v: f32) {
    var r = v;
    if ((p.flags & MAT_BIAS) != 0u) {
        r += bias[p.row0 + n];
    }
    if ((p.flags & MAT_SOFTCAP) != 0u) {
        r = p.cap * tanh_c(r / p.cap);
    }
    let idx = t * p.y_stride + p.row0 + n;
    if ((p.flags & MAT_ACCUMULATE) != 0u) {
        r += y[idx];
    }
    if ((p.flags & MAT_SWIGLU_UP) != 0u) {
        r = glu(y[idx]) * r;
    }
    y[idx] = r;
}
