//! `torus-wgpu bench`: a load generator for any OpenAI-compatible endpoint.

use anyhow::Result;

#[derive(clap::Args, Clone, Debug)]
pub struct BenchArgs {}

pub fn run(_args: BenchArgs) -> Result<()> {
    anyhow::bail!("bench is not implemented yet")
}
