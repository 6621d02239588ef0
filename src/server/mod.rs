//! `torus-wgpu serve`: the OpenAI-compatible HTTP server (routes, OpenAI types, SSE, errors,
//! metrics) over the engine handle.

use crate::config::EngineArgs;
use anyhow::Result;

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (also from TORUS_API_KEY).
    #[arg(long, env = "TORUS_API_KEY")]
    pub api_key: Option<String>,
}

pub fn run(_args: ServeArgs) -> Result<()> {
    anyhow::bail!("serve is not implemented yet")
}
