// RoPE (Hugging Face rotate-half layout) on this step's q and k, and the paged KV-cache write.
// qkv rows hold [q heads | k heads | v heads] (head_dim each). One thread per
// (token, head of the n_heads + 2 * n_kv_heads, pair i < head_dim / 2):
// q heads are rotated in place, k heads rotated into k_cache, v heads copied into v_cache.
// Cache layout: [slot = block * block_size + offset, kv_head, head_dim].

struct RopeParams {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    qkv_stride: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: RopeParams;
@group(0) @binding(2) var<storage, read> md: array<u32>;
@group(0) @binding(3) var<storage, read> cos_sin: array<vec2<f32>>; // [position, head_dim / 2]
@group(0) @binding(4) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(5) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let half = p.head_dim / 2u;
    let heads = p.n_heads + 2u * p.n_kv_heads;
    let i = gid.x % half;
    let h = (gid.x / half) % heads;
    let t = gid.x / (half * heads);
    if (t >= step.n_tokens) {
        return;
    }
    let src = t * p.qkv_stride + h * p.head_dim + i;
    let a = qkv[src];
    let b = qkv[src + half];
    let slot = md[step.off_slot + t];
    if (h >= p.n_heads + p.n_kv_heads) {
        let dst = (slot * p.n_kv_heads + (h - p.n_heads - p.n_kv_heads)) * p.head_dim + i;
        v_cache[dst] = a;
        v_cache[dst + half] = b;
        return;
    }
    let cs = cos_sin[md[step.off_pos + t] * half + i];
    let ra = a * cs.x - b * cs.y;
    let rb = b * cs.x + a * cs.y;
    if (h < p.n_heads) {
        qkv[src] = ra;
        qkv[src + half] = rb;
    } else {
        let dst = (slot * p.n_kv_heads + (h - p.n_heads)) * p.head_dim + i;
        k_cache[dst] = ra;
        k_cache[dst + half] = rb;
    }
}
