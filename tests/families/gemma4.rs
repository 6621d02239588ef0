//! Gemma 4 (text, dense): the tiny model of scripts/fixtures/gen_tiny_gemma4.py (sliding-window
//! layers of 16-wide heads and 2 KV heads; full-attention layers of 32-wide heads and 1 KV head
//! whose keys are the values, proportional RoPE over a quarter of the head; plain-weight norms, a
//! v norm, unscaled scores, a scalar per layer, soft-capped logits) from its Hugging Face directory
//! and its llama.cpp-layout GGUF against transformers' float32 logits and greedy tokens, in both
//! kernel profiles, and its E2B/E4B-style (per-layer embeddings, KV sharing) and 26B-A4B-style
//! (experts beside the MLP) relatives; and the
//! engine's properties with two attention geometries in one model: batching invariance, prefix
//! cache on == off, preemption.

use crate::common::tiny::{self, local, reference};
use torus_wgpu::config::{EngineConfig, KernelProfile};
use torus_wgpu::model::config::{Arch, RopeScaling};
use torus_wgpu::model::loader::read_config;

#[test]
fn gemma4_config_from_hf_and_gguf() {
    for f in ["tiny-gemma4", "tiny-gemma4.gguf"] {
        let c = read_config(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        assert_eq!((c.arch, c.sliding_window), (Arch::Gemma4, Some(8)), "{f}");
        assert_eq!(c.style.sliding_layers.as_deref(), Some(&[true, true, false, true, true, false][..]), "{f}");
        let (s, g) = (c.geom(0), c.geom(2));
        assert_eq!((s.heads, s.kv_heads, s.head_dim), (4, 2, 16), "{f}");
        assert_eq!((g.heads, g.kv_heads, g.head_dim), (4, 1, 32), "{f}");
        assert!(c.k_eq_v(2) && c.k_eq_v(5) && !c.k_eq_v(0), "{f}");
        assert_eq!((c.rope_theta, c.style.local_rope_theta, c.rope_dim()), (1e6, Some(1e4), 32), "{f}");
        assert_eq!((c.style.attn_scale, c.style.final_softcap), (Some(1.0), Some(30.0)), "{f}");
        assert!(c.style.v_norm && c.style.layer_scalar && c.qk_norm && c.style.post_norms, "{f}");
        // The same frequencies: the HF config's proportional RoPE, the GGUF's rope_freqs (1e30
        // for the pairs that do not rotate).
        let (freqs, _) = c.rope_scaling.inv_freq(c.rope_theta, c.rope_dim());
        assert!(freqs[..4].iter().all(|&x| x > 1e-3) && freqs[4..].iter().all(|&x| x < 1e-20), "{f}: {freqs:?}");
    }
    let hf = read_config(&local("tiny-gemma4")).unwrap();
    assert_eq!(hf.rope_scaling, RopeScaling::Proportional { pairs: 4 });
}

/// Every prompt's last-position logits within 1e-3 of transformers and its greedy tokens, from
/// the HF directory and the GGUF, in both kernel profiles (the gpu profile runs the split and
/// the query-tiled attention of each geometry).
#[test]
fn gemma4_matches_transformers() {
    let r = reference("tiny-gemma4-reference.json");
    for f in ["tiny-gemma4", "tiny-gemma4.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
}

/// The E-style model (per-layer embeddings, the last two layers reading the caches of earlier
/// ones, double-wide FFNs there): config from both formats, logits and greedy tokens against
/// transformers in both profiles.
#[test]
fn gemma4_e_matches_transformers() {
    for f in ["tiny-gemma4-e", "tiny-gemma4-e.gguf"] {
        let c = read_config(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        assert_eq!((c.style.ple, c.style.kv_shared, c.style.double_wide), (Some((32, 512)), 2, true), "{f}");
        assert_eq!(
            (c.kv_source(0), c.kv_source(1), c.kv_source(2), c.kv_source(3)),
            (None, None, Some(0), Some(1)),
            "{f}"
        );
        assert_eq!((c.layer_ffn(1), c.layer_ffn(2)), (32, 64), "{f}");
        assert!(!c.k_eq_v(1), "{f}");
    }
    let r = reference("tiny-gemma4-e-reference.json");
    for f in ["tiny-gemma4-e", "tiny-gemma4-e.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
}

/// The E-style model: batching invariance and prefix cache on == off with caches shared across
/// layers.
#[test]
fn gemma4_e_engine_batched_and_prefix_cache_requests_equal_alone() {
    tiny::assert_batched_equals_alone_and_prefix_cache_on_equals_off("tiny-gemma4-e");
}

/// The 26B-A4B-style model (a dense MLP beside 6 experts, top 2, on every layer; the router's
/// scales, per-expert scales and the extra norms): config from both formats, logits and greedy
/// tokens against transformers in both profiles (a 90-token prompt takes the grouped expert
/// kernels), and the engine's batching invariance / prefix cache on == off.
#[test]
fn gemma4_moe_matches_transformers() {
    for f in ["tiny-gemma4moe", "tiny-gemma4moe.gguf"] {
        let c = read_config(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        let m = c.moe.as_ref().unwrap_or_else(|| panic!("{f}: no experts"));
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_topk, c.intermediate), (6, 2, 32, true, 64), "{f}");
        assert_eq!(m.sparse_layers, [true; 3], "{f}");
    }
    let r = reference("tiny-gemma4moe-reference.json");
    for f in ["tiny-gemma4moe", "tiny-gemma4moe.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
    tiny::assert_batched_equals_alone_and_prefix_cache_on_equals_off("tiny-gemma4moe.gguf");
}

/// Batching invariance and prefix cache on == off, with the two KV geometries in one cache.
#[test]
fn gemma4_engine_batched_and_prefix_cache_requests_equal_alone() {
    tiny::assert_batched_equals_alone_and_prefix_cache_on_equals_off("tiny-gemma4");
}

/// Requests that preempt each other in a small cache give the tokens they give alone; the cache
/// holds exactly the blocks its size pays for, each block sized by its layers' own K/V widths.
#[test]
fn gemma4_preemption() {
    let c = read_config(&local("tiny-gemma4")).unwrap();
    let floats: usize = (0..c.layers).map(|l| c.geom(l).kv_dim()).sum();
    // 4 sliding layers of 2 x 16 and 2 full ones of 1 x 32 floats per token.
    assert_eq!(floats, 4 * 32 + 2 * 32);
    let block_size = EngineConfig::default().block_size;
    // K and V, f16.
    tiny::assert_preemption_keeps_outputs("tiny-gemma4", 12, (2 * block_size * floats * 2) as u64);
}

/// A `Gemma4ForConditionalGeneration` checkpoint (how Google publishes Gemma 4: the text model
/// under `model.language_model.`, its config under `text_config`, vision tensors beside it)
/// loads its language model: the E-style fixture rewritten into that layout gives the same
/// logits and greedy tokens (the per-layer embeddings' model-level tensors are under the prefix
/// too).
#[test]
fn gemma4_multimodal_checkpoint_loads_its_language_model() {
    use safetensors::tensor::TensorView;
    let src = local("tiny-gemma4-e");
    let dir = std::env::temp_dir().join(format!("torus-gemma4-vl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let config = serde_json::json!({
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": {"hidden_size": 32},
        "tie_word_embeddings": true
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut renamed: Vec<(String, TensorView)> =
        st.tensors().into_iter().map(|(name, t)| (name.replacen("model.", "model.language_model.", 1), t)).collect();
    let vision = vec![0u8; 4 * 32];
    renamed.push((
        "model.vision_tower.patch_embedder.weight".into(),
        TensorView::new(safetensors::Dtype::F32, vec![32], &vision).unwrap(),
    ));
    safetensors::serialize_to_file(renamed, None, &dir.join("model.safetensors")).unwrap();
    let c = read_config(&dir).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!((c.arch, c.style.ple, c.style.kv_shared), (Arch::Gemma4, Some((32, 512)), 2));
    tiny::assert_matches_reference(
        dir.to_str().unwrap(),
        &reference("tiny-gemma4-e-reference.json"),
        KernelProfile::Cpu,
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The memory plan counts every weight the E-style model reads, the per-layer embeddings' token
/// table and projections included (F32 in the file and on the device).
#[test]
fn gemma4_e_memory_plan_counts_the_per_layer_embeddings() {
    let bytes = std::fs::read(local("tiny-gemma4-e").join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // The KV-sharing layers' (2 and 3) key/value tensors, if saved, are not read.
    let unread = |n: &str| {
        (n.contains("layers.2.") || n.contains("layers.3."))
            && ["k_proj", "v_proj", "k_norm"].iter().any(|x| n.contains(x))
    };
    let file: u64 = st.tensors().iter().filter(|(n, _)| !unread(n)).map(|(_, t)| t.data().len() as u64).sum();
    let ple: u64 =
        st.tensors().iter().filter(|(n, _)| n.contains("per_layer")).map(|(_, t)| t.data().len() as u64).sum();
    assert!(ple > 200_000, "{ple}");
    let gpu = std::sync::Arc::new(torus_wgpu::gpu::Gpu::new(None).expect("a wgpu adapter"));
    let (model, _) =
        torus_wgpu::engine::load_model(&local("tiny-gemma4-e"), &tiny::cfg(KernelProfile::Cpu), gpu, &|_, _| {})
            .unwrap();
    assert!(model.plan.weights >= file, "plan {} < the file's {file} bytes of weights", model.plan.weights);
}
