//! Isolation of the hybrids with the gpu profile's per-token recurrence forced for every
//! sequence (TORUS_DELTA_CHUNK_MIN above any step, read when the kernels are built): the probe
//! of tests/isolation.rs repeats bit for bit after and beside other requests, and steps of 64
//! tokens give the same. A binary of its own: the variable is set before any kernel is built and
//! no other test shares the process.

mod common;

use common::isolation::*;
use torus_wgpu::config::KernelProfile;
use torus_wgpu::ops::delta::CHUNK_MIN_ENV;

#[test]
fn hybrids_repeat_after_others_with_the_per_token_form_only() {
    std::env::set_var(CHUNK_MIN_ENV, "100000");
    let probe = prompt(1, 300);
    let others: Vec<Vec<u32>> =
        [3usize, 17, 70, 600].iter().enumerate().map(|(i, &n)| prompt(100 + i as u64, n)).collect();
    for name in ["qwen3.5-9b", "qwen3.6-35b-a3b"] {
        let (_dir, path) = small_model(name);
        let e = engine(&path, KernelProfile::Gpu, |_| {});
        let want = assert_repeats(&e, &probe_request(&probe), &others, Some(1e-2), name);
        let chunked = engine(&path, KernelProfile::Gpu, |c| c.max_num_batched_tokens = 64);
        assert_close(&run(&chunked, &probe), &want, 1e-2, &format!("{name}: chunked prefill"));
    }
}
