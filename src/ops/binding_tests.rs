//! Every family's bindings, by name and access, against the shaders as they are assembled: a
//! binding the shader declares must be the struct's field of that name and access, and every
//! field must be declared by one of the family's shaders (the KV cache's chunks are checked
//! by binding number).

use super::kernels::programs;
use super::matmul::gemm::matmul_coop_source;
use super::matmul::MatmulBinds;
use super::norm::{rmsnorm_source, NormBinds};
use super::Binds;
use crate::gpu::family::Slot;
use crate::gpu::WFormat;
use std::collections::BTreeMap;

/// binding -> (variable, access) of `@group(0) @binding(N) var<...> name:` lines.
fn declared(src: &str) -> BTreeMap<u32, (String, Slot)> {
    let mut out = BTreeMap::new();
    for line in src.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("@group(0) @binding(") else { continue };
        let (n, rest) = rest.split_once(')').unwrap();
        let rest = rest.trim().strip_prefix("var<").unwrap();
        let (access, rest) = rest.split_once('>').unwrap();
        let name = rest.trim().split(':').next().unwrap().trim().to_string();
        let slot = match access.replace(' ', "").as_str() {
            "uniform" => Slot::Uniform,
            "storage,read" => Slot::Read,
            "storage,read_write" => Slot::ReadWrite,
            other => panic!("unknown access {other} in {line}"),
        };
        out.insert(n.parse().unwrap(), (name, slot));
    }
    out
}

/// Checks `slots` against the family's shaders; `kv`: its first K and V cache bindings.
/// A dynamic-offset uniform is declared as a uniform.
fn check(family: &str, slots: &[(u32, &str, Slot)], sources: &[String], kv: Option<(u32, u32)>) {
    let plain = |s: Slot| if s == Slot::UniformDyn { Slot::Uniform } else { s };
    let mut seen = vec![false; slots.len()];
    for src in sources {
        for (b, (name, slot)) in declared(src) {
            if name.starts_with("k_cache") || name.starts_with("v_cache") {
                let (k0, v0) = kv.unwrap_or_else(|| panic!("{family}: no KV cache expected, got {name}"));
                let first = if name.starts_with('k') { k0 } else { v0 };
                assert!(name.ends_with('0') == (b == first), "{family}: {name} at binding {b}");
                continue;
            }
            let i = slots
                .iter()
                .position(|s| s.0 == b)
                .unwrap_or_else(|| panic!("{family}: binding {b} ({name}) has no field"));
            assert_eq!((slots[i].1, plain(slots[i].2)), (name.as_str(), slot), "{family}: binding {b}");
            seen[i] = true;
        }
    }
    for (s, seen) in slots.iter().zip(seen) {
        assert!(seen || s.1 == "unused", "{family}: no shader declares {} (binding {})", s.1, s.0);
    }
}

/// Every program of every family (kernels::programs), grouped by the bindings struct it
/// declares, against that struct; and the cooperative-matrix GEMMs (built only on devices with
/// the feature, so not among them) against the matmul's.
#[test]
fn bindings_match_the_shaders() {
    // By the struct's name: its slots, KV bindings and the sources declaring it.
    type Group = (Binds, Option<(u32, u32)>, Vec<String>);
    let mut by_binds: BTreeMap<&str, Group> = BTreeMap::new();
    for p in programs(&[64, 256]) {
        let src = p.src.unwrap_or_else(|e| panic!("{}: {e:#}", p.label));
        let entry = by_binds.entry(p.binds.0).or_insert_with(|| (p.binds, p.kv, Vec::new()));
        assert_eq!((entry.0 .1, entry.1), (p.binds.1, p.kv), "{}: one struct, one layout", p.label);
        entry.2.push(src);
    }
    for (name, ((_, slots), kv, sources)) in &by_binds {
        check(name, slots, sources, *kv);
    }
    // Every family's bindings are among them.
    for name in [
        "MatmulBinds",
        "MatmulUxBinds",
        "EmbedBinds",
        "MoeBinds",
        "AttnBinds",
        "RopeBinds",
        "NormBinds",
        "HeadNormBinds",
        "PleBinds",
        "DeltaBinds",
        "SampleBinds",
        "AdjustBinds",
    ] {
        assert!(by_binds.contains_key(name), "no program declares {name}");
    }
    for f in WFormat::ALL {
        let shape = crate::gpu::coop::CoopShape { side: 16, f16: true, subgroup: 32 };
        check("matmul_coop", MatmulBinds::SLOTS, &[matmul_coop_source(f, true, shape).unwrap()], None);
    }
    // The two sampler kernels share one layout.
    let access = |s: &[(u32, &str, Slot)]| s.iter().map(|x| (x.0, x.2)).collect::<Vec<_>>();
    let layout = |n: &str| access(by_binds[n].0 .1);
    assert_eq!(layout("AdjustBinds"), layout("SampleBinds"));
}

#[test]
fn a_misnamed_binding_is_caught() {
    let src = rmsnorm_source().unwrap().replace("var<storage, read> weight:", "var<storage, read> w:");
    let r = std::panic::catch_unwind(|| check("rmsnorm", NormBinds::SLOTS, &[src], None));
    assert!(r.is_err());
}
