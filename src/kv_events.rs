//! KV-cache events for KV-aware routers (llm-d's endpoint picker, NVIDIA Dynamo), in vLLM's
//! wire format (`--kv-events-endpoint tcp://HOST:PORT`, off by default).
//!
//! The engine thread collects the block manager's events (`kv::KvEvent`) over each engine step
//! and hands them, as one batch, to the publisher thread through an unbounded channel, so the
//! engine never waits on the network. The publisher thread encodes a batch and queues it for
//! every subscriber whose subscription matches the topic; each subscriber has a writer thread
//! with a bounded queue (a subscriber that falls 10 000 messages behind loses messages, as a
//! ZeroMQ PUB socket drops past its high-water mark).
//!
//! Wire format (vLLM's `ZmqEventPublisher`, with the array-like msgspec structs that llm-d and
//! Dynamo decode):
//! - a ZeroMQ PUB socket (ZMTP 3.0, NULL security) bound at the endpoint; each batch is a
//!   3-frame message: topic (empty), sequence number (8 bytes, big-endian, from 0, one per
//!   batch), payload;
//! - payload: MessagePack `[ts, [event, ...], data_parallel_rank]` with `ts` the Unix time in
//!   seconds (float) and rank 0; events are tagged arrays:
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name]` (lora_id and lora_name nil, medium "GPU"; msgspec's array-like structs encode
//!   every field, and these are the fields of the vLLM releases with lora_name: later ones
//!   append extra_keys, group_idx, ...), `["BlockRemoved", block_hashes,
//!   medium]`, `["AllBlocksCleared"]`.
//! - Block hashes: our prefix-cache keys are SHA-256 chains (see `kv`); a published hash is
//!   the key's first 8 bytes as a big-endian unsigned 64-bit integer (`kv::external_hash`).
//!   The parent hash of a sequence's first block is nil (its parent is the root key of the
//!   request's cache salt); any other block's parent hash is its predecessor's published hash.
//!
//! The ZeroMQ side is a minimal ZMTP 3.0 PUB implementation (greeting, NULL handshake, READY
//! with Socket-Type PUB; subscriptions as ZMTP 3.0 messages or ZMTP 3.1 SUBSCRIBE/CANCEL
//! commands; PING answered with PONG), enough for libzmq/pyzmq subscribers.
//!
//! Owns: the KV-cache event publisher (vLLM's wire format).
//! May use: kv, config.
//! Never uses: engine, server, gpu.

use crate::kv::KvEvent;
use anyhow::{anyhow, bail, Context, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Messages a subscriber may fall behind before messages to it are dropped.
const PEER_HWM: usize = 10_000;
/// Most subscriber connections at once (each costs two threads), handshakes included; more
/// are closed on arrival.
pub const MAX_SUBSCRIBERS: usize = 64;
/// The whole ZMTP handshake (greeting, READY) must be done within this.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// Most subscriptions (topic prefixes) one subscriber may hold, and their total bytes; a
/// subscriber that asks for more is disconnected.
pub const MAX_SUBSCRIPTIONS: usize = 64;
pub const MAX_SUBSCRIPTION_BYTES: usize = 16 << 10;
/// Largest frame a subscriber may send (subscriptions and READY properties are short).
const MAX_FRAME: u64 = 64 << 10;
/// vLLM's medium for blocks in device memory.
const MEDIUM: &str = "GPU";

// ---- MessagePack (the few encoders the payload needs) ----

fn mp_array(out: &mut Vec<u8>, n: usize) {
    if n < 16 {
        out.push(0x90 | n as u8);
    } else if n <= u16::MAX as usize {
        out.push(0xdc);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

fn mp_uint(out: &mut Vec<u8>, v: u64) {
    if v < 128 {
        out.push(v as u8);
    } else if v <= u8::MAX as u64 {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= u16::MAX as u64 {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= u32::MAX as u64 {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn mp_str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n <= u8::MAX as usize {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n <= u16::MAX as usize {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

fn mp_nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

fn mp_f64(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_bits().to_be_bytes());
}

fn mp_uints(out: &mut Vec<u8>, vs: impl ExactSizeIterator<Item = u64>) {
    mp_array(out, vs.len());
    for v in vs {
        mp_uint(out, v);
    }
}

/// The MessagePack payload of one batch (see the module docs).
pub fn encode_batch(ts: f64, events: &[KvEvent], block_size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 32);
    mp_array(&mut out, 3);
    mp_f64(&mut out, ts);
    mp_array(&mut out, events.len());
    for e in events {
        match e {
            KvEvent::Stored { hashes, parent, tokens } => {
                mp_array(&mut out, 8);
                mp_str(&mut out, "BlockStored");
                mp_uints(&mut out, hashes.iter().copied());
                match parent {
                    Some(p) => mp_uint(&mut out, *p),
                    None => mp_nil(&mut out),
                }
                mp_uints(&mut out, tokens.iter().map(|&t| t as u64));
                mp_uint(&mut out, block_size as u64);
                mp_nil(&mut out); // lora_id
                mp_str(&mut out, MEDIUM);
                mp_nil(&mut out); // lora_name
            }
            KvEvent::Removed { hashes } => {
                mp_array(&mut out, 3);
                mp_str(&mut out, "BlockRemoved");
                mp_uints(&mut out, hashes.iter().copied());
                mp_str(&mut out, MEDIUM);
            }
            KvEvent::AllCleared => {
                mp_array(&mut out, 1);
                mp_str(&mut out, "AllBlocksCleared");
            }
        }
    }
    mp_uint(&mut out, 0); // data_parallel_rank
    out
}

// ---- ZMTP 3.0 ----

const FLAG_MORE: u8 = 1;
const FLAG_LONG: u8 = 2;
const FLAG_COMMAND: u8 = 4;

/// One ZMTP frame (message part or command).
fn frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// The bytes of a multipart message.
pub fn multipart(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        frame(&mut out, if i + 1 < parts.len() { FLAG_MORE } else { 0 }, p);
    }
    out
}

fn command(name: &str, data: &[u8]) -> Vec<u8> {
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    let mut out = Vec::new();
    frame(&mut out, FLAG_COMMAND, &body);
    out
}

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3; // major
    g[11] = 0; // minor
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// `read_exact`, all of it before `deadline` (None: no time limit), however slowly the peer
/// sends.
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Option<std::time::Instant>) -> std::io::Result<()> {
    let Some(deadline) = deadline else { return s.read_exact(buf) };
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake took too long"));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one frame: (flags, body). Bodies are capped (a subscriber sends only short ones).
fn read_frame(s: &mut TcpStream, deadline: Option<std::time::Instant>) -> std::io::Result<(u8, Vec<u8>)> {
    let mut h = [0u8; 1];
    read_by(s, &mut h, deadline)?;
    let flags = h[0];
    let len = if flags & FLAG_LONG != 0 {
        let mut b = [0u8; 8];
        read_by(s, &mut b, deadline)?;
        u64::from_be_bytes(b)
    } else {
        let mut b = [0u8; 1];
        read_by(s, &mut b, deadline)?;
        b[0] as u64
    };
    if len > MAX_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "frame too large"));
    }
    let mut body = vec![0u8; len as usize];
    read_by(s, &mut body, deadline)?;
    Ok((flags, body))
}

/// Splits a command frame's body into (name, data).
fn split_command(body: &[u8]) -> Option<(&[u8], &[u8])> {
    let n = *body.first()? as usize;
    (body.len() > n).then(|| (&body[1..1 + n], &body[1 + n..]))
}

/// Greeting and NULL handshake, within [`HANDSHAKE_DEADLINE`]; returns the peer's socket type.
fn handshake(s: &mut TcpStream) -> Result<String> {
    let deadline = Some(std::time::Instant::now() + HANDSHAKE_DEADLINE);
    s.write_all(&greeting())?;
    let mut g = [0u8; 64];
    read_by(s, &mut g, deadline).context("reading the ZMTP greeting")?;
    if g[0] != 0xff || g[9] & 1 != 1 || g[10] < 3 {
        bail!("not a ZMTP 3 peer");
    }
    if &g[12..16] != b"NULL" || g[16..32].iter().any(|&b| b != 0) {
        bail!("the peer asks for a security mechanism other than NULL");
    }
    let mut props = Vec::new();
    props.push(b"Socket-Type".len() as u8);
    props.extend_from_slice(b"Socket-Type");
    props.extend_from_slice(&3u32.to_be_bytes());
    props.extend_from_slice(b"PUB");
    s.write_all(&command("READY", &props))?;
    let (flags, body) = read_frame(s, deadline)?;
    let Some((b"READY", mut p)) = (flags & FLAG_COMMAND != 0).then(|| split_command(&body)).flatten() else {
        bail!("expected a READY command");
    };
    let mut socket_type = String::new();
    while let Some(&n) = p.first() {
        let n = n as usize;
        if p.len() < 1 + n + 4 {
            bail!("malformed READY properties");
        }
        let name = &p[1..1 + n];
        let vlen = u32::from_be_bytes(p[1 + n..5 + n].try_into().expect("4 bytes")) as usize;
        if p.len() < 5 + n + vlen {
            bail!("malformed READY properties");
        }
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = String::from_utf8_lossy(&p[5 + n..5 + n + vlen]).into_owned();
        }
        p = &p[5 + n + vlen..];
    }
    if socket_type != "SUB" && socket_type != "XSUB" {
        bail!("a PUB socket accepts SUB and XSUB peers, not {socket_type:?}");
    }
    Ok(socket_type)
}

struct Peer {
    id: u64,
    subs: Arc<Mutex<Vec<Vec<u8>>>>,
    tx: SyncSender<Arc<Vec<u8>>>,
}

#[derive(Default)]
struct Shared {
    peers: Mutex<Vec<Peer>>,
    next_peer: AtomicU64,
    /// Subscriber connections being served (handshakes included).
    connections: std::sync::atomic::AtomicUsize,
}

/// One of the [`MAX_SUBSCRIBERS`] places, given back on drop.
struct Place(Arc<Shared>);

impl Place {
    fn take(shared: &Arc<Shared>) -> Option<Place> {
        let c = &shared.connections;
        c.fetch_update(Relaxed, Relaxed, |n| (n < MAX_SUBSCRIBERS).then_some(n + 1)).ok()?;
        Some(Place(shared.clone()))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Relaxed);
    }
}

impl Shared {
    fn update_subscribers(&self, metrics: &Counters) {
        let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let n = peers.iter().filter(|p| !p.subs.lock().unwrap_or_else(|e| e.into_inner()).is_empty()).count();
        metrics.subscribers.store(n as u64, Relaxed);
    }
}

/// Serves one subscriber: handshake, then its subscriptions until it goes.
fn serve_peer(mut s: TcpStream, shared: Arc<Shared>, metrics: Arc<Counters>) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    if let Err(e) = handshake(&mut s) {
        tracing::debug!("kv events: subscriber handshake failed: {e:#}");
        return;
    }
    let _ = s.set_read_timeout(None);
    let Ok(mut w) = s.try_clone() else { return };
    let (tx, rx) = std::sync::mpsc::sync_channel::<Arc<Vec<u8>>>(PEER_HWM);
    let writer = std::thread::Builder::new().name("torus-kv-events-peer".into()).spawn(move || {
        for msg in rx {
            if w.write_all(&msg).is_err() {
                let _ = w.shutdown(std::net::Shutdown::Both);
                break;
            }
        }
    });
    if writer.is_err() {
        return;
    }
    let id = shared.next_peer.fetch_add(1, Relaxed);
    let subs = Arc::new(Mutex::new(Vec::new()));
    shared.peers.lock().unwrap_or_else(|p| p.into_inner()).push(Peer { id, subs: subs.clone(), tx: tx.clone() });
    while let Ok((flags, body)) = read_frame(&mut s, None) {
        // ZMTP 3.1 commands, or ZMTP 3.0 messages (first byte 1: subscribe, 0: cancel).
        let (subscribe, topic) = if flags & FLAG_COMMAND != 0 {
            match split_command(&body) {
                Some((b"SUBSCRIBE", t)) => (true, t.to_vec()),
                Some((b"CANCEL", t)) => (false, t.to_vec()),
                Some((b"PING", d)) => {
                    let ctx = d.get(2..).unwrap_or_default();
                    let _ = tx.try_send(Arc::new(command("PONG", ctx)));
                    continue;
                }
                _ => continue,
            }
        } else {
            match body.split_first() {
                Some((1, t)) => (true, t.to_vec()),
                Some((0, t)) => (false, t.to_vec()),
                _ => continue,
            }
        };
        let over = {
            let mut g = subs.lock().unwrap_or_else(|p| p.into_inner());
            if subscribe {
                g.push(topic);
            } else if let Some(i) = g.iter().position(|t| *t == topic) {
                g.remove(i);
            }
            g.len() > MAX_SUBSCRIPTIONS || g.iter().map(Vec::len).sum::<usize>() > MAX_SUBSCRIPTION_BYTES
        };
        if over {
            tracing::debug!(
                "kv events: a subscriber asked for more than {MAX_SUBSCRIPTIONS} subscriptions or {MAX_SUBSCRIPTION_BYTES} bytes of them; disconnected"
            );
            break;
        }
        shared.update_subscribers(&metrics);
    }
    shared.peers.lock().unwrap_or_else(|p| p.into_inner()).retain(|p| p.id != id);
    shared.update_subscribers(&metrics);
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// How the PUB socket meets its subscribers.
#[derive(Clone, Debug)]
pub struct PubConfig {
    /// `tcp://HOST:PORT`.
    pub endpoint: String,
    /// Each message's first frame (subscribers filter on its prefix).
    pub topic: String,
    /// Connect to a subscriber bound at the endpoint instead of binding there.
    pub connect: bool,
}

/// What the publisher counts (exported by the engine's metrics): events and batches (messages)
/// published, subscribers with a subscription, and messages dropped for subscribers too far
/// behind.
#[derive(Debug, Default)]
pub struct Counters {
    pub events_published: AtomicU64,
    pub batches_published: AtomicU64,
    pub subscribers: AtomicU64,
    pub dropped: AtomicU64,
}

/// Starts the publisher: binds the PUB socket at the endpoint (or, with `connect`, keeps a
/// connection to the subscriber there, retried every second); returns the sender the engine
/// hands each step's events to, and the bound (or connected-to) address.
pub fn start(pc: &PubConfig, block_size: usize, metrics: Arc<Counters>) -> Result<(Sender<Vec<KvEvent>>, SocketAddr)> {
    let endpoint = &pc.endpoint;
    let addr_s = crate::config::parse_endpoint(endpoint)?;
    let addrs: Vec<SocketAddr> =
        addr_s.to_socket_addrs().with_context(|| format!("kv_events_endpoint {endpoint}: cannot resolve"))?.collect();
    let shared = Arc::new(Shared::default());
    let topic = pc.topic.clone().into_bytes();
    if pc.connect {
        let addr = *addrs.first().ok_or_else(|| anyhow!("kv_events_endpoint {endpoint}: no address"))?;
        let (sh, me) = (shared.clone(), metrics.clone());
        std::thread::Builder::new().name("torus-kv-events-connect".into()).spawn(move || loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
                // The same ZMTP exchange as with a subscriber that connected to us.
                Ok(conn) => {
                    let place = Place::take(&sh);
                    serve_peer(conn, sh.clone(), me.clone());
                    drop(place);
                }
                Err(e) => tracing::debug!("kv events: cannot connect to {addr}: {e}"),
            }
            std::thread::sleep(Duration::from_secs(1));
        })?;
        let (tx, rx) = std::sync::mpsc::channel::<Vec<KvEvent>>();
        std::thread::Builder::new()
            .name("torus-kv-events".into())
            .spawn(move || publish_loop(rx, shared, metrics, block_size, topic))?;
        return Ok((tx, addr));
    }
    let listener =
        TcpListener::bind(&addrs[..]).with_context(|| format!("kv_events_endpoint {endpoint}: cannot bind"))?;
    let addr = listener.local_addr()?;
    if !addr.ip().is_loopback() {
        tracing::warn!(
            "kv events: bound to {addr}, beyond this host: anyone who can reach it can subscribe and read the \
             token ids of cached blocks (those of requests with a cache_salt are sent without them)"
        );
    }
    {
        let (shared, metrics) = (shared.clone(), metrics.clone());
        std::thread::Builder::new().name("torus-kv-events-accept".into()).spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let Some(place) = Place::take(&shared) else {
                    tracing::debug!("kv events: {MAX_SUBSCRIBERS} subscribers already; a connection was closed");
                    continue;
                };
                let (shared, metrics) = (shared.clone(), metrics.clone());
                let _ = std::thread::Builder::new().name("torus-kv-events-sub".into()).spawn(move || {
                    serve_peer(conn, shared, metrics);
                    drop(place);
                });
            }
        })?;
    }
    let (tx, rx) = std::sync::mpsc::channel::<Vec<KvEvent>>();
    std::thread::Builder::new()
        .name("torus-kv-events".into())
        .spawn(move || publish_loop(rx, shared, metrics, block_size, topic))?;
    Ok((tx, addr))
}

fn publish_loop(
    rx: Receiver<Vec<KvEvent>>,
    shared: Arc<Shared>,
    metrics: Arc<Counters>,
    block_size: usize,
    topic: Vec<u8>,
) {
    for (seq, events) in (0u64..).zip(rx) {
        let ts =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let payload = encode_batch(ts, &events, block_size);
        let msg = Arc::new(multipart(&[&topic, &seq.to_be_bytes(), &payload]));
        let peers = shared.peers.lock().unwrap_or_else(|p| p.into_inner());
        for p in peers.iter() {
            let matches = p.subs.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|t| topic.starts_with(t));
            if !matches {
                continue;
            }
            match p.tx.try_send(msg.clone()) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    metrics.dropped.fetch_add(1, Relaxed);
                }
                // The subscriber is going; its reader removes it.
                Err(TrySendError::Disconnected(_)) => {}
            }
        }
        drop(peers);
        metrics.batches_published.fetch_add(1, Relaxed);
        metrics.events_published.fetch_add(events.len() as u64, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(crate::config::parse_endpoint("tcp://127.0.0.1:5557").unwrap(), "127.0.0.1:5557");
        assert_eq!(crate::config::parse_endpoint("tcp://*:5557").unwrap(), "0.0.0.0:5557");
        assert_eq!(crate::config::parse_endpoint("tcp://[::1]:5557").unwrap(), "[::1]:5557");
        assert!(crate::config::parse_endpoint("ipc:///tmp/x").is_err());
        assert!(crate::config::parse_endpoint("tcp://host").is_err());
        assert!(crate::config::parse_endpoint("tcp://:1").is_err());
    }

    #[test]
    fn msgpack_bytes() {
        let p = encode_batch(1.5, &[KvEvent::AllCleared], 16);
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
        want.extend_from_slice(&[0x91, 0x91, 0xb0]);
        want.extend_from_slice(b"AllBlocksCleared");
        want.push(0);
        assert_eq!(p, want);
        let mut v = Vec::new();
        for x in [0u64, 127, 128, 255, 256, 65535, 65536, u32::MAX as u64, u64::MAX] {
            mp_uint(&mut v, x);
        }
        assert_eq!(
            v,
            [
                &[0u8, 127, 0xcc, 128, 0xcc, 255, 0xcd, 1, 0, 0xcd, 255, 255, 0xce, 0, 1, 0, 0][..],
                &[0xce, 255, 255, 255, 255, 0xcf, 255, 255, 255, 255, 255, 255, 255, 255]
            ]
            .concat()
        );
    }

    #[test]
    fn frames() {
        let m = multipart(&[b"", &[0; 8], &[7; 300]]);
        assert_eq!(&m[..2], &[FLAG_MORE, 0]);
        assert_eq!(&m[2..4], &[FLAG_MORE, 8]);
        assert_eq!(m[12], FLAG_LONG);
        assert_eq!(&m[13..21], &300u64.to_be_bytes());
        assert_eq!(m.len(), 21 + 300);
    }
}
