// RoPE (Hugging Face rotate-half layout) on this step's q and k, and the paged KV-cache write.
// qkv rows hold [q heads | k heads | v heads] (head_dim each). One thread per
// (token, head of the n_heads + 2 * n_kv_heads, pair i = 2j < head_dim / 2): elements i, i + 1
// are rotated with i + rot_dim / 2, i + rot_dim / 2 + 1 (below rot_dim, the rotated part); q heads in place, k heads into k_cache, v heads copied
// into v_cache. Cache layout: [slot = block * block_size + offset, kv_head, head_dim], in the
// cache's element type (the KV snippet defines the bindings and store_k/store_v).

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: RopeParams; // declared from Rust (ops/)
@group(0) @binding(2) var<storage, read> md: array<u32>;
@group(0) @binding(3) var<storage, read> cos_sin: array<vec2<f32>>; // [position, head_dim / 2]
@group(0) @binding(4) var<storage, read_write> qkv: array<f32>;

{{KV}}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    // The grid may be folded into 2-D (see Gpu::fold): the linear invocation index.
    let id = gid.x + gid.y * nwg.x * 64u;
    let half = p.head_dim / 2u;
    let quarter = p.head_dim / 4u;
    // q heads only (q_only: a layer that reads another layer's cache writes none).
    let heads = select(p.n_heads + 2u * p.n_kv_heads, p.n_heads, p.q_only == 1u);
    let i = 2u * (id % quarter);
    let h = (id / quarter) % heads;
    let t = id / (quarter * heads);
    if (t >= step.n_tokens) {
        return;
    }
    let src = t * p.qkv_stride + h * p.head_dim + i;
    let slot = md[step.off_slot + t];
    if (h >= p.n_heads + p.n_kv_heads) {
        let dst = (slot * p.n_kv_heads + (h - p.n_heads - p.n_kv_heads)) * p.head_dim + i;
        store_v(dst, vec2<f32>(qkv[src], qkv[src + 1u]));
        store_v(dst + half, vec2<f32>(qkv[src + half], qkv[src + half + 1u]));
        return;
    }
    // Partial rotary: pairs (i, i + rhalf) below rot_dim; the threads past rhalf copy the
    // unrotated elements rot_dim.. of k heads (four each) into the cache.
    let rhalf = p.rot_dim / 2u;
    if (i >= rhalf) {
        if (h >= p.n_heads) {
            let e = p.rot_dim + 2u * (i - rhalf);
            let s0 = t * p.qkv_stride + h * p.head_dim + e;
            let dst = (slot * p.n_kv_heads + (h - p.n_heads)) * p.head_dim + e;
            store_k(dst, vec2<f32>(qkv[s0], qkv[s0 + 1u]));
            store_k(dst + 2u, vec2<f32>(qkv[s0 + 2u], qkv[s0 + 3u]));
        }
        return;
    }
    let a = vec2<f32>(qkv[src], qkv[src + 1u]);
    let b = vec2<f32>(qkv[src + rhalf], qkv[src + rhalf + 1u]);
    let row = md[step.off_pos + t] * rhalf + i;
    let c0 = cos_sin[row];
    let c1 = cos_sin[row + 1u];
    let c = vec2<f32>(c0.x, c1.x);
    let s = vec2<f32>(c0.y, c1.y);
    let ra = a * c - b * s;
    let rb = b * c + a * s;
    if (h < p.n_heads) {
        qkv[src] = ra.x;
        qkv[src + 1u] = ra.y;
        qkv[src + rhalf] = rb.x;
        qkv[src + rhalf + 1u] = rb.y;
    } else {
        let dst = (slot * p.n_kv_heads + (h - p.n_heads)) * p.head_dim + i;
        store_k(dst, ra);
        store_k(dst + rhalf, rb);
    }
}
