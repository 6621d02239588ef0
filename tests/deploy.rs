//! The deployment files (deploy/kubernetes/, Dockerfile) against the server they deploy: every
//! manifest parses; the container's `--port` is its `http` port, which the Service, the
//! InferencePool and the EPP values target; the Service, pool and EPP select the Deployment's
//! pods; every HTTP probe path answers 200 on a running server (the tiny model); every vLLM
//! metric name the files mention (EPP flags, the autoscaler's adapter rule) is in that server's
//! /metrics; the HPA asks for the name the adapter rule publishes; each GPU overlay requests one
//! device-plugin resource; the Dockerfile installs Mesa's Vulkan drivers and exposes the port.

mod common;

use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::server::{model_id_for_path, start, ServerConfig};

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
}

/// Every document of every manifest, with its file.
fn manifests() -> Vec<(PathBuf, Value)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes");
    let mut files = vec![];
    yaml_files(&root, &mut files);
    files.sort();
    assert!(files.len() >= 10, "{files:?}");
    let mut docs = vec![];
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for d in serde_yaml_ng::Deserializer::from_str(&text) {
            let v = Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            if !v.is_null() {
                docs.push((f.clone(), v));
            }
        }
    }
    docs
}

fn find<'a>(docs: &'a [(PathBuf, Value)], kind: &str, file_part: &str) -> &'a Value {
    docs.iter()
        .find(|(f, v)| v["kind"] == kind && f.to_string_lossy().contains(file_part))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {kind} in a file matching {file_part}"))
}

/// Strings anywhere in `v`.
fn strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::String(s) => out.push(s),
        Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        Value::Object(o) => o.values().for_each(|x| strings(x, out)),
        _ => {}
    }
}

/// `vllm:` metric names in a text.
fn vllm_names(s: &str) -> Vec<String> {
    let mut out = vec![];
    let mut rest = s;
    while let Some(i) = rest.find("vllm:") {
        let name: String =
            rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':').collect();
        out.push(name);
        rest = &rest[i + 5..];
    }
    out
}

fn subset(labels: &Value, of: &Value) -> bool {
    let (Some(a), Some(b)) = (labels.as_object(), of.as_object()) else { return false };
    !a.is_empty() && a.iter().all(|(k, v)| b.get(k) == Some(v))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_match_the_server() {
    let docs = manifests();
    let deploy = find(&docs, "Deployment", "base/deployment");
    let pod_labels = &deploy["spec"]["template"]["metadata"]["labels"];
    assert!(subset(&deploy["spec"]["selector"]["matchLabels"], pod_labels));
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(args[0], "serve");
    let arg = |flag: &str| args.iter().position(|a| *a == flag).map(|i| args[i + 1]);
    let port: u64 = arg("--port").unwrap().parse().unwrap();
    assert_eq!(arg("--host"), Some("0.0.0.0"), "a pod must listen beyond localhost");
    let http = c["ports"].as_array().unwrap().iter().find(|p| p["name"] == "http").expect("an http port");
    assert_eq!(http["containerPort"].as_u64(), Some(port));
    let mut probe_paths = BTreeSet::new();
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let g = &c[probe]["httpGet"];
        assert_eq!(g["port"], "http", "{probe}");
        probe_paths.insert(g["path"].as_str().unwrap().to_string());
    }
    assert!(probe_paths.contains("/health"), "readiness on /health");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");

    let svc = find(&docs, "Service", "base/service");
    assert!(subset(&svc["spec"]["selector"], pod_labels));
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "http");
    let pool = find(&docs, "InferencePool", "inference-pool");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    assert!(subset(&pool["spec"]["selector"]["matchLabels"], pod_labels));
    assert_eq!(pool["spec"]["targetPorts"][0]["number"].as_u64(), Some(port));
    let route = find(&docs, "HTTPRoute", "inference-pool");
    assert_eq!(route["spec"]["rules"][0]["backendRefs"][0]["name"], pool["metadata"]["name"]);
    let values = &docs.iter().find(|(f, _)| f.ends_with("epp-values.yaml")).expect("epp-values.yaml").1;
    assert!(subset(&values["inferencePool"]["modelServers"]["matchLabels"], pod_labels));
    assert_eq!(values["inferencePool"]["targetPorts"][0]["number"].as_u64(), Some(port));
    assert_eq!(values["inferencePool"]["modelServerType"], "vllm");

    // The autoscaler: the adapter rule's published name is the one the HPA asks for.
    let hpa = find(&docs, "HorizontalPodAutoscaler", "hpa");
    assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], deploy["metadata"]["name"]);
    let rules = find(&docs, "ConfigMap", "hpa")["data"]["config.yaml"].as_str().unwrap();
    let rules: Value = serde_yaml_ng::from_str(rules).unwrap();
    let published = rules["rules"][0]["name"]["as"].as_str().unwrap();
    assert_eq!(hpa["spec"]["metrics"][0]["pods"]["metric"]["name"], published);

    // GPU overlays: each requests one device plugin's resource on the same container.
    for (vendor, resource) in [("nvidia", "nvidia.com/gpu"), ("amd", "amd.com/gpu"), ("intel", "gpu.intel.com/i915")] {
        let (f, patch) = docs
            .iter()
            .find(|(f, v)| f.to_string_lossy().contains(&format!("overlays/{vendor}/")) && v["kind"] == "Deployment")
            .unwrap();
        let pc = &patch["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(pc["name"], c["name"], "{}", f.display());
        assert_eq!(pc["resources"]["limits"][resource].as_u64(), Some(1), "{}", f.display());
        let k = &docs.iter().find(|(kf, v)| kf.parent() == f.parent() && v["kind"] == "Kustomization").unwrap().1;
        assert_eq!(k["resources"][0], "../../base");
        assert!(f.parent().unwrap().join("../../base/kustomization.yaml").exists());
    }

    // The Dockerfile: Mesa's Vulkan drivers, the port, the server.
    let dockerfile = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Dockerfile")).unwrap();
    assert!(dockerfile.contains("mesa-vulkan-drivers") && dockerfile.contains("cargo build --release"));
    assert!(dockerfile.contains(&format!("EXPOSE {port}")), "EXPOSE {port}");

    // A running server: the probe paths answer 200 and every vLLM name mentioned is exported.
    let cfg = EngineConfig { max_sequence_length: 256, total_cache_size: 4 << 20, ..Default::default() };
    let path = common::tiny();
    let engine = common::start_engine_async(&path, &cfg).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handle = start(listener, ServerConfig::new(model_id_for_path(&path), &cfg), Some(engine)).unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let base = format!("http://{}", handle.addr);
    for p in &probe_paths {
        let r = http.get(format!("{base}{p}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "probe path {p}");
    }
    let exposition = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    let exported: BTreeSet<&str> =
        exposition.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split(' ').next()).collect();
    let mut mentioned = BTreeSet::new();
    for (_, d) in &docs {
        let mut s = vec![];
        strings(d, &mut s);
        for x in s {
            mentioned.extend(vllm_names(x));
        }
    }
    assert!(mentioned.contains("vllm:num_requests_waiting") && mentioned.contains("vllm:kv_cache_usage_perc"));
    for m in &mentioned {
        assert!(exported.contains(m.as_str()), "{m} is named in deploy/ but not exported by /metrics");
    }
    handle.shutdown().await;
}
