//! Who may call a worker: the worker token (sent by `SendToken`, checked in constant time by
//! `CheckToken`) and TLS on both sides.

use crate::config::EngineConfig;
use crate::exec::proto::stage_client::StageClient;
use anyhow::{anyhow, bail, Context, Result};
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// How a scheduler reaches its workers: the token it sends and its TLS settings.
#[derive(Clone, Default)]
pub struct Link {
    token: Option<AsciiMetadataValue>,
    tls: Option<ClientTlsConfig>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Link {{ token: {}, tls: {} }}", self.token.is_some(), self.tls.is_some())
    }
}

pub(super) fn read_pem(path: &str, key: &str) -> Result<Vec<u8>> {
    let b = std::fs::read(path).with_context(|| format!("{key}: cannot read {path}"))?;
    if !b.windows(11).any(|w| w == b"-----BEGIN ") {
        bail!("{key}: {path} is not a PEM file");
    }
    Ok(b)
}

/// `Bearer <token>` as a header value that is never logged or indexed by HPACK.
pub(super) fn bearer(token: &str) -> Result<AsciiMetadataValue> {
    let mut v: AsciiMetadataValue =
        format!("Bearer {token}").parse().map_err(|_| anyhow!("worker_token must be printable ASCII"))?;
    v.set_sensitive(true);
    Ok(v)
}

impl Link {
    /// The token and TLS settings of a scheduler config (PEM files are read now).
    pub fn from_config(cfg: &EngineConfig) -> Result<Link> {
        let token = cfg.worker_token.as_ref().map(|t| bearer(t.expose())).transpose()?;
        let tls = match &cfg.tls_ca {
            None if cfg.tls_cert.is_some() => {
                bail!("tls_cert/tls_key are the scheduler's client certificate for workers over TLS: give tls_ca too")
            }
            None => None,
            Some(ca) => {
                let mut t = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read_pem(ca, "tls_ca")?));
                if let (Some(c), Some(k)) = (&cfg.tls_cert, &cfg.tls_key) {
                    t = t.identity(Identity::from_pem(read_pem(c, "tls_cert")?, read_pem(k, "tls_key")?));
                }
                if let Some(d) = &cfg.tls_domain {
                    t = t.domain_name(d.clone());
                }
                Some(t)
            }
        };
        Ok(Link { token, tls })
    }

    /// The endpoint of the worker at `addr` (https with TLS), not yet connected.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| anyhow!("bad worker address {addr:?}: {e}"))?;
        if let Some(t) = &self.tls {
            ep = ep.tls_config(t.clone()).map_err(|e| anyhow!("TLS settings for {addr}: {e}"))?;
        }
        Ok(ep)
    }

    /// A client over `channel` that sends the token with every call.
    pub fn client(&self, channel: Channel) -> Client {
        StageClient::with_interceptor(channel, SendToken(self.token.clone()))
    }
}

/// Adds the worker token to every call.
#[derive(Clone)]
pub struct SendToken(Option<AsciiMetadataValue>);

impl tonic::service::Interceptor for SendToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A stage client that sends the worker token.
pub type Client = StageClient<InterceptedService<Channel, SendToken>>;

/// Checks the worker token of every call: SHA-256 digests of `authorization` and of the
/// expected value, compared in constant time. `None`: no token configured.
#[derive(Clone)]
pub(super) struct CheckToken(pub(super) Option<[u8; 32]>);

pub(super) fn digest(b: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(b).into()
}

/// Equal, in time that does not depend on where the inputs differ.
pub(super) fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl tonic::service::Interceptor for CheckToken {
    fn call(&mut self, req: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        let Some(want) = &self.0 else { return Ok(req) };
        let Some(got) = req.metadata().get("authorization") else {
            return Err(tonic::Status::unauthenticated(
                "this worker requires a worker token (worker_token / TORUS_WORKER_TOKEN); none was sent",
            ));
        };
        if constant_time_eq(&digest(got.as_bytes()), want) {
            Ok(req)
        } else {
            Err(tonic::Status::unauthenticated("wrong worker token"))
        }
    }
}

/// The TLS settings of a worker config, or None to serve plaintext.
pub(super) fn server_tls(cfg: &EngineConfig) -> Result<Option<ServerTlsConfig>> {
    let (Some(cert), Some(key)) = (&cfg.tls_cert, &cfg.tls_key) else {
        if cfg.tls_ca.is_some() {
            bail!("tls_ca on a worker requires client certificates over TLS: give tls_cert and tls_key too");
        }
        return Ok(None);
    };
    let mut tls =
        ServerTlsConfig::new().identity(Identity::from_pem(read_pem(cert, "tls_cert")?, read_pem(key, "tls_key")?));
    if let Some(ca) = &cfg.tls_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read_pem(ca, "tls_ca")?));
    }
    Ok(Some(tls))
}
