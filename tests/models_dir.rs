//! `serve --models-dir DIR` end to end: the real binary serving two small models (the tiny Qwen2
//! Transformers directory and SmolLM2's GGUF) and a broken file, each loaded when a request
//! names it, in a process of its own. Checked against the PyTorch references of both models
//! (greedy tokens through `/completion`'s `return_tokens`): requests alternating between the
//! models through the OpenAI, Ollama and llama-server routes with one model loaded at a time
//! (the other unloaded each time), `/v1/models` / `/api/tags` / `/api/ps` saying which is loaded,
//! model-labelled metrics, unknown names (404 in each API's shape), a model that fails to load
//! (500 naming why, the others unharmed), several requests arriving during one load (one load),
//! a memory budget that holds one model, a busy model never unloaded under a request, and the
//! models' processes ending with the server.

mod common;

use common::served::TempDir;
use common::{assert_greedy_matches, fixtures, floats, ids, smollm2, spawn_until_ready, tiny, F16_MARGIN};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1";
const TINY: &str = "tiny-qwen2";

/// A models directory: SmolLM2 and the tiny Qwen2 (links), and a file that is not a model.
fn models_dir(tag: &str) -> TempDir {
    let d = std::env::temp_dir().join(format!("torus-models-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::os::unix::fs::symlink(smollm2(), d.join(format!("{SMOL}.gguf"))).unwrap();
    std::os::unix::fs::symlink(tiny(), d.join(TINY)).unwrap();
    std::fs::write(d.join("broken.gguf"), b"this is not a model file").unwrap();
    TempDir(d)
}

struct Server {
    child: std::process::Child,
    base: String,
    log: std::sync::mpsc::Receiver<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &TempDir, extra: &[&str]) -> Server {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
    cmd.args(["serve", "--port", "0", "--models-dir"]).arg(&dir.0).args(extra);
    let (child, lines, log) = spawn_until_ready(&mut cmd, "models", "ready on http://", Duration::from_secs(60));
    let ready = lines.last().unwrap();
    let addr = ready.split("ready on http://").nth(1).unwrap().split_whitespace().next().unwrap();
    Server { child, base: format!("http://{addr}"), log }
}

/// The key of the server with one (the other has none and ignores it).
const KEY: &str = "models-key";

fn client() -> reqwest::Client {
    let mut h = reqwest::header::HeaderMap::new();
    h.insert(reqwest::header::AUTHORIZATION, format!("Bearer {KEY}").parse().unwrap());
    reqwest::Client::builder().no_proxy().default_headers(h).build().unwrap()
}

async fn post(base: &str, path: &str, body: Value) -> (u16, Value) {
    let r = client().post(format!("{base}{path}")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
}

async fn get(base: &str, path: &str) -> Value {
    let r = client().get(format!("{base}{path}")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{path}");
    r.json().await.unwrap()
}

async fn metrics(base: &str) -> String {
    client().get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap()
}

/// The value of one exact series of a Prometheus text.
fn series(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' ')?.trim().parse().ok())
}

/// (prompt ids, greedy ids, margins) of a reference prompt: the tiny Qwen2's first, SmolLM2's
/// plain one (its first 12 tokens).
fn reference(model: &str) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let read =
        |f: &str| -> Value { serde_json::from_str(&std::fs::read_to_string(fixtures().join(f)).unwrap()).unwrap() };
    if model == TINY {
        let p = &read("tiny-qwen2-reference.json")["prompts"][0];
        (ids(&p["input_ids"]), ids(&p["greedy_ids"]), floats(&p["argmax_margins"]))
    } else {
        let p = &read("smollm2-reference.json")["prompts"][0];
        let g = &p["greedy"];
        (ids(&p["input_ids"]), ids(&g["generated_ids"])[..12].to_vec(), floats(&g["argmax_margins"])[..12].to_vec())
    }
}

/// The model's greedy continuation of its reference prompt through llama-server's
/// `/completion`, checked against the reference.
async fn check_reference(base: &str, model: &str) {
    let (prompt, want, margins) = reference(model);
    let body = json!({"model": model, "prompt": prompt, "n_predict": want.len(), "temperature": 0,
                      "ignore_eos": true, "return_tokens": true});
    let (s, v) = post(base, "/completion", body).await;
    assert_eq!(s, 200, "{model}: {v}");
    assert_greedy_matches(&ids(&v["tokens"]), &want, &margins, F16_MARGIN, model);
}

async fn loaded(base: &str) -> Vec<String> {
    let ps = get(base, "/api/ps").await;
    ps["models"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap().to_string()).collect()
}

fn status_of(models: &Value, name: &str) -> String {
    let m = models["data"].as_array().unwrap().iter().find(|m| m["id"] == name).unwrap();
    m["status"]["value"].as_str().unwrap().to_string()
}

/// The ports the models' processes listened on, from the server's log so far.
fn model_ports(log: &std::sync::mpsc::Receiver<String>, ports: &mut Vec<u16>) {
    while let Ok(line) = log.try_recv() {
        if let Some(rest) = line.split("] torus-wgpu serve: listening on http://127.0.0.1:").nth(1) {
            ports.push(rest.split_whitespace().next().unwrap().parse().unwrap());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn models_by_name_one_loaded_at_a_time() {
    let dir = models_dir("one");
    let srv = start(&dir, &["--max-loaded-models", "1"]);
    let base = srv.base.clone();

    let listed = get(&base, "/v1/models").await;
    let names: Vec<&str> = listed["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(names, [SMOL, "broken", TINY]);
    assert!(names.iter().all(|n| status_of(&listed, n) == "unloaded"));
    let tags = get(&base, "/api/tags").await;
    let tag_names: Vec<&str> = tags["models"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(tag_names, [format!("{SMOL}:latest"), "broken:latest".into(), format!("{TINY}:latest")]);
    assert!(loaded(&base).await.is_empty());
    // Ollama's /api/show of a model not loaded is answered from its files: nothing loads.
    let (s, unloaded_show) = post(&base, "/api/show", json!({"model": format!("{SMOL}:latest")})).await;
    assert_eq!(s, 200, "{unloaded_show}");
    assert!(unloaded_show["template"].as_str().unwrap().contains("<|im_start|>"), "{unloaded_show}");
    assert!(loaded(&base).await.is_empty(), "/api/show loaded nothing");

    // Alternating, one loaded at a time: every answer is the model's own.
    let chat = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "Name a color."}]});
    let mut ollama_answer = None;
    for round in 0..2 {
        check_reference(&base, TINY).await;
        assert_eq!(loaded(&base).await, [format!("{TINY}:latest")]);
        assert_eq!(status_of(&get(&base, "/v1/models").await, TINY), "loaded");
        check_reference(&base, SMOL).await;
        assert_eq!(loaded(&base).await, [format!("{SMOL}:latest")], "the tiny model was unloaded");
        // The same question through Ollama's and OpenAI's routes: the same greedy answer.
        let mut o = chat(&format!("{SMOL}:latest"));
        o["stream"] = json!(false);
        o["options"] = json!({"temperature": 0, "num_predict": 8});
        let (s, v) = post(&base, "/api/chat", o).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["model"], SMOL);
        let text = v["message"]["content"].as_str().unwrap().to_string();
        assert!(!text.is_empty());
        if round == 0 {
            ollama_answer = Some(text);
            // The loaded model's own /api/show says what the files said.
            let (s, shown) = post(&base, "/api/show", json!({"model": SMOL})).await;
            assert_eq!(s, 200, "{shown}");
            for k in ["template", "details", "capabilities", "parameters", "modelfile", "modified_at"] {
                assert_eq!(shown[k], unloaded_show[k], "{k}");
            }
            for k in ["general.file_size", "general.vocab_size"] {
                assert_eq!(shown["model_info"][k], unloaded_show["model_info"][k], "{k}");
            }
        } else {
            assert_eq!(Some(&text), ollama_answer.as_ref(), "the same answer after a reload");
        }
        let mut c = chat(SMOL);
        c["temperature"] = json!(0);
        c["max_tokens"] = json!(8);
        let (s, v) = post(&base, "/v1/chat/completions", c).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["model"], SMOL);
        assert_eq!(v["choices"][0]["message"]["content"].as_str(), ollama_answer.as_deref());
    }
    let m = metrics(&base).await;
    for (model, loads, unloads) in [(TINY, 2.0, 2.0), (SMOL, 2.0, 1.0)] {
        assert_eq!(series(&m, &format!("torus_model_loads_total{{model=\"{model}\"}}")), Some(loads), "{m}");
        let u = format!("torus_model_unloads_total{{model=\"{model}\",reason=\"max_loaded_models\"}}");
        assert_eq!(series(&m, &u), Some(unloads), "{m}");
    }
    // The loaded model's own series, labelled with its name.
    assert_eq!(series(&m, &format!("torus_model_loaded{{model=\"{SMOL}\"}}")), Some(1.0), "{m}");
    assert!(m.contains(&format!("torus_requests_total{{model=\"{SMOL}\",status=\"200\"}}")), "{m}");
    assert_eq!(m.matches("# TYPE torus_requests_total ").count(), 1);

    // Unknown names: 404 in each API's shape, naming the model.
    let (s, v) = post(&base, "/v1/chat/completions", chat("nope")).await;
    assert_eq!((s, v["error"]["code"].as_str()), (404, Some("model_not_found")), "{v}");
    let (s, v) = post(&base, "/api/chat", chat("nope:latest")).await;
    assert_eq!(s, 404);
    assert!(v["error"].as_str().unwrap().contains("`nope`"), "{v}");
    let mut a = chat("nope");
    a["max_tokens"] = json!(4);
    let (s, v) = post(&base, "/v1/messages", a).await;
    assert_eq!(
        (s, v["type"].as_str(), v["error"]["type"].as_str()),
        (404, Some("error"), Some("not_found_error")),
        "{v}"
    );
    assert_eq!(client().get(format!("{base}/v1/models/nope")).send().await.unwrap().status().as_u16(), 404);
    // Several models and none named: 400.
    let (s, v) = post(&base, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("model")), "{v}");

    // A file that is not a model: 500 saying why (its name, not where it lives), the others unharmed.
    let (s, v) = post(&base, "/v1/chat/completions", chat("broken")).await;
    let msg = v["error"]["message"].as_str().unwrap();
    assert_eq!((s, v["error"]["code"].as_str()), (500, Some("model_load_failed")), "{v}");
    assert!(msg.contains("not a GGUF file") && msg.contains("broken.gguf"), "{msg}");
    assert!(!msg.contains(dir.0.to_str().unwrap()), "{msg}");
    check_reference(&base, TINY).await;
    let m = metrics(&base).await;
    assert_eq!(series(&m, "torus_model_load_failures_total{model=\"broken\"}"), Some(1.0), "{m}");

    // `ollama stop`: `keep_alive: 0` and no prompt unloads the model.
    assert_eq!(loaded(&base).await, [format!("{TINY}:latest")]);
    let (s, v) = post(&base, "/api/generate", json!({"model": TINY, "keep_alive": 0})).await;
    assert_eq!((s, v["done_reason"].as_str(), v["done"].as_bool()), (200, Some("unload"), Some(true)), "{v}");
    assert!(loaded(&base).await.is_empty());
    let m = metrics(&base).await;
    assert_eq!(series(&m, &format!("torus_model_unloads_total{{model=\"{TINY}\",reason=\"asked\"}}")), Some(1.0));

    // A request's `keep_alive` (Ollama's): the model is unloaded once idle that long.
    let body =
        json!({"model": TINY, "prompt": "hi", "stream": false, "keep_alive": "3s", "options": {"num_predict": 2}});
    let (s, v) = post(&base, "/api/generate", body).await;
    assert_eq!(s, 200, "{v}");
    let ps = get(&base, "/api/ps").await;
    assert_eq!(ps["models"][0]["name"], format!("{TINY}:latest"), "{ps}");
    assert!(ps["models"][0]["expires_at"].as_str().unwrap() < "9999", "an expiry is shown: {ps}");
    let t0 = Instant::now();
    while !loaded(&base).await.is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(30), "the model outlived its keep-alive");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let m = metrics(&base).await;
    assert_eq!(series(&m, &format!("torus_model_unloads_total{{model=\"{TINY}\",reason=\"expired\"}}")), Some(1.0));
    let (s, v) = post(&base, "/api/generate", json!({"model": TINY, "prompt": "hi", "keep_alive": "soon"})).await;
    assert_eq!(s, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("keep_alive"), "{v}");

    // A burst for both models at once: each model is loaded once and serves all its requests
    // before it is unloaded for the other (a model just loaded for its waiters is theirs first;
    // a third load is allowed for a request arriving after its model was unloaded).
    let m = metrics(&base).await;
    let loads = |m: &str| {
        [TINY, SMOL]
            .map(|n| series(m, &format!("torus_model_loads_total{{model=\"{n}\"}}")).unwrap())
            .iter()
            .sum::<f64>()
    };
    let before = loads(&m);
    let burst: Vec<_> = (0..8)
        .map(|i| {
            let model = if i % 2 == 0 { SMOL } else { TINY };
            let body = json!({"model": model, "prompt": "hi", "n_predict": 8});
            tokio::spawn(post_owned(base.clone(), body))
        })
        .collect();
    for r in burst {
        let (s, v) = r.await.unwrap();
        assert_eq!(s, 200, "{v}");
    }
    let m = metrics(&base).await;
    assert!(loads(&m) - before <= 3.0, "loads for the burst: {} (the models thrashed)", loads(&m) - before);

    // The models' processes end with the server.
    let mut ports = Vec::new();
    model_ports(&srv.log, &mut ports);
    assert!(ports.len() >= 5, "a process per load: {ports:?}");
    drop(srv);
    let t0 = Instant::now();
    let last = *ports.last().unwrap();
    while std::net::TcpStream::connect(("127.0.0.1", last)).is_ok() {
        assert!(t0.elapsed() < Duration::from_secs(20), "the model's process outlived the server");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn loads_under_a_memory_budget() {
    let dir = models_dir("budget");
    // Each model counts its file plus the 256 MiB KV cache: 0.5 GiB holds either, not both.
    let srv = start(&dir, &["--models-memory-gb", "0.5", "--api-key", KEY]);
    let base = srv.base.clone();
    // The server's key guards every model (each model's process has a key of its own).
    let bare = reqwest::Client::builder().no_proxy().build().unwrap();
    let body = json!({"model": TINY, "prompt": "hi", "n_predict": 2});
    let r = bare.post(format!("{base}/completion")).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(status_of(&get(&base, "/v1/models").await, TINY), "unloaded", "nothing loaded for a refused request");

    // Requests arriving during one load: one load serves them all; the listing answers meanwhile.
    let (prompt, want, margins) = reference(TINY);
    let body = json!({"model": TINY, "prompt": prompt, "n_predict": want.len(), "temperature": 0,
                      "ignore_eos": true, "return_tokens": true});
    let reqs: Vec<_> = (0..3).map(|_| tokio::spawn(post_owned(base.clone(), body.clone()))).collect();
    let mut seen_loading = false;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) && !reqs.iter().all(|r| r.is_finished()) {
        seen_loading |= status_of(&get(&base, "/v1/models").await, TINY) == "loading";
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen_loading, "/v1/models said `loading` while the model loaded");
    for r in reqs {
        let (s, v) = r.await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_greedy_matches(&ids(&v["tokens"]), &want, &margins, F16_MARGIN, "during the load");
    }
    let m = metrics(&base).await;
    assert_eq!(series(&m, &format!("torus_model_loads_total{{model=\"{TINY}\"}}")), Some(1.0), "{m}");

    // A long request keeps the tiny model busy: SmolLM2 (which does not fit beside it) waits
    // for it instead of unloading it under the request; then the tiny model is unloaded for it.
    let long = json!({"model": TINY, "prompt": prompt, "n_predict": 300, "temperature": 0, "ignore_eos": true,
                      "return_tokens": true});
    let busy = tokio::spawn(post_owned(base.clone(), long));
    tokio::time::sleep(Duration::from_millis(300)).await;
    check_reference(&base, SMOL).await;
    let (s, v) = busy.await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(ids(&v["tokens"]).len(), 300, "the busy model's request ran to its end");
    assert_greedy_matches(&ids(&v["tokens"])[..want.len()], &want, &margins, F16_MARGIN, "the busy model's tokens");
    assert_eq!(loaded(&base).await, [format!("{SMOL}:latest")]);
    let m = metrics(&base).await;
    let u = format!("torus_model_unloads_total{{model=\"{TINY}\",reason=\"memory\"}}");
    assert_eq!(series(&m, &u), Some(1.0), "{m}");
    let ps = get(&base, "/api/ps").await;
    assert!(ps["models"][0]["size_vram"].as_u64().unwrap() > 256 << 20, "{ps}");
}

async fn post_owned(base: String, body: Value) -> (u16, Value) {
    post(&base, "/completion", body).await
}
