//! Generates the gRPC stage service (proto/stage.proto) with a pure-Rust protobuf compiler, so
//! building needs no protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/stage.proto");
    let fds = protox::compile(["proto/stage.proto"], ["proto"])?;
    // Tensor bytes as reference-counted buffers: a retried step does not copy hidden states.
    tonic_prost_build::configure().bytes(".torus.stage.Tensor.data").compile_fds(fds)?;
    Ok(())
}
