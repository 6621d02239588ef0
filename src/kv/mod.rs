//! Paged KV-cache bookkeeping: a pool of fixed-size blocks, ref-counted, with an automatic
//! prefix cache. Every full block is keyed by SHA-256 of (parent block's key, its token ids),
//! chained from a root key that a request's `cache_salt` changes; a hit also compares the
//! cached block's parent key and token ids, so even a key collision never shares a block. A new
//! sequence reuses the longest run of cached blocks. Blocks nobody references stay cached (and
//! reusable) until memory is needed, then are evicted least-recently-used first.
//! The GPU side (the cache buffers) lives in model::plan; this is host-side state only.
//!
//! Owns: KV block ids and keys, the block manager (ref counts, prefix cache, LRU, events), and
//! the recurrent-state slots of hybrid models (`state`).
//! May use: nothing.
//! Never uses: gpu, wgpu, model, engine.

pub mod state;
pub use state::StateSlots;

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};

pub type BlockId = u32;

/// Key of a full block in the prefix cache.
pub type BlockKey = [u8; 32];

/// Key of a full block: SHA-256 of (parent key, the block's token ids as little-endian u32s).
pub fn block_key(parent: &BlockKey, tokens: &[u32]) -> BlockKey {
    let mut h = Sha256::new();
    h.update(parent);
    for &t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The parent key of a sequence's first block: one per cache salt (None: the shared cache).
pub fn root_key(salt: Option<&str>) -> BlockKey {
    let mut h = Sha256::new();
    h.update(b"torus-wgpu prefix cache v1\0");
    if let Some(salt) = salt {
        h.update([1u8]);
        h.update(salt.as_bytes());
    }
    h.finalize().into()
}

/// The hash a block key is published under in KV-cache events (`kv_events`): its first 8
/// bytes as a big-endian u64 (routers such as llm-d's decode 64-bit block hashes).
pub fn external_hash(key: &BlockKey) -> u64 {
    u64::from_be_bytes(key[..8].try_into().expect("32-byte key"))
}

/// A change to the set of cached blocks, for KV-cache events (vLLM's BlockStored,
/// BlockRemoved, AllBlocksCleared). Hashes are `external_hash`es.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one sequence were cached: `parent` is the hash of the block before
    /// the first (None: the first block of a sequence), `tokens` the blocks' token ids.
    Stored { hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32> },
    /// Cached blocks were evicted.
    Removed { hashes: Vec<u64> },
    /// Every cached block was forgotten.
    AllCleared,
}

/// How block keys are computed (tests swap in a weak one to force collisions).
pub type KeyFn = fn(&BlockKey, &[u32]) -> BlockKey;

#[derive(Clone, Debug, Default)]
struct Block {
    refs: u32,
    /// Prefix-cache key once the block is full and registered, with what it was computed from:
    /// the parent key and the block's token ids (compared on every hit).
    key: Option<BlockKey>,
    parent: BlockKey,
    tokens: Vec<u32>,
    /// LRU stamp while evictable (refs == 0 and key set).
    stamp: u64,
}

/// What a prefix look-up found: the cached blocks (each retained), their keys, and how many
/// full blocks were looked up.
#[derive(Clone, Debug, Default)]
pub struct PrefixHit {
    pub blocks: Vec<BlockId>,
    pub keys: Vec<BlockKey>,
    pub queried: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    pub total: usize,
    pub free: usize,
    /// Unreferenced blocks kept for the prefix cache (reusable, evictable).
    pub cached_idle: usize,
    pub in_use: usize,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub evictions: u64,
}

pub struct BlockManager {
    pub block_size: usize,
    pub enable_prefix_cache: bool,
    blocks: Vec<Block>,
    free: Vec<BlockId>,
    cache: HashMap<BlockKey, BlockId>,
    key_fn: KeyFn,
    /// Evictable blocks by LRU stamp.
    lru: BTreeMap<u64, BlockId>,
    clock: u64,
    stats: KvStats,
    /// Changes to the cached set since the last `take_events` (None: not recorded).
    events: Option<Vec<KvEvent>>,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_cache: bool) -> BlockManager {
        BlockManager {
            block_size,
            enable_prefix_cache,
            blocks: vec![Block::default(); num_blocks],
            // Pop from the end: lowest ids first.
            free: (0..num_blocks as BlockId).rev().collect(),
            cache: HashMap::new(),
            key_fn: block_key,
            lru: BTreeMap::new(),
            clock: 0,
            stats: KvStats::default(),
            events: None,
        }
    }

    /// The same with another key function (tests: a weak hash that collides on purpose).
    pub fn with_key_fn(mut self, key_fn: KeyFn) -> BlockManager {
        self.key_fn = key_fn;
        self
    }

    /// Records changes to the cached set as `KvEvent`s (see `take_events`).
    pub fn with_events(mut self) -> BlockManager {
        self.events = Some(Vec::new());
        self
    }

    /// The events recorded since the last call (empty when not recording).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The keys of every cached block, in no particular order.
    pub fn cached_keys(&self) -> Vec<BlockKey> {
        self.cache.keys().copied().collect()
    }

    fn record_removed(&mut self, key: &BlockKey) {
        let Some(ev) = self.events.as_mut() else { return };
        let h = external_hash(key);
        match ev.last_mut() {
            Some(KvEvent::Removed { hashes }) => hashes.push(h),
            _ => ev.push(KvEvent::Removed { hashes: vec![h] }),
        }
    }

    fn record_stored(&mut self, key: &BlockKey, parent: Option<&BlockKey>, tokens: &[u32]) {
        let Some(ev) = self.events.as_mut() else { return };
        let (h, parent) = (external_hash(key), parent.map(external_hash));
        // A block that continues the previous event's chain joins it (as vLLM batches a
        // sequence's new blocks in one event).
        if let (Some(KvEvent::Stored { hashes, tokens: t, .. }), Some(p)) = (ev.last_mut(), parent) {
            if hashes.last() == Some(&p) {
                hashes.push(h);
                t.extend_from_slice(tokens);
                return;
            }
        }
        ev.push(KvEvent::Stored { hashes: vec![h], parent, tokens: tokens.to_vec() });
    }

    /// Blocks that can be handed out now (free, or cached and evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub fn stats(&self) -> KvStats {
        KvStats {
            total: self.blocks.len(),
            free: self.free.len(),
            cached_idle: self.lru.len(),
            in_use: self.blocks.len() - self.free.len() - self.lru.len(),
            ..self.stats.clone()
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Takes one block: a free one, else the least recently used cached one (evicting its key).
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = if let Some(id) = self.free.pop() {
            id
        } else {
            let (&stamp, &id) = self.lru.iter().next()?;
            self.lru.remove(&stamp);
            if let Some(k) = self.blocks[id as usize].key.take() {
                self.cache.remove(&k);
                self.record_removed(&k);
            }
            self.stats.evictions += 1;
            id
        };
        let b = &mut self.blocks[id as usize];
        debug_assert_eq!(b.refs, 0);
        b.refs = 1;
        b.key = None;
        b.tokens.clear();
        Some(id)
    }

    fn retain(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 {
            self.lru.remove(&b.stamp);
        }
        b.refs += 1;
    }

    /// Drops one reference to each block; unreferenced blocks with a key stay cached.
    pub fn release(&mut self, table: &[BlockId]) {
        // Release in reverse so a sequence's later blocks are evicted before its earlier ones
        // (earlier blocks are the more shareable prefix).
        for &id in table.iter().rev() {
            let stamp = self.tick();
            let b = &mut self.blocks[id as usize];
            assert!(b.refs > 0, "block {id} released more often than taken");
            b.refs -= 1;
            if b.refs == 0 {
                if b.key.is_some() {
                    b.stamp = stamp;
                    self.lru.insert(stamp, id);
                } else {
                    self.free.push(id);
                }
            }
        }
    }

    /// Longest run of cached full blocks for `tokens` (at most `max_tokens` tokens' worth) under
    /// the root key `root`, each retained. A block counts only when its parent key and token ids
    /// are the ones asked for, whatever its key. The look-up is not counted: the engine counts a
    /// request once, when it is admitted (`count_lookup`).
    pub fn lookup_prefix(&mut self, tokens: &[u32], max_tokens: usize, root: &BlockKey) -> PrefixHit {
        let mut hit = PrefixHit::default();
        if !self.enable_prefix_cache {
            return hit;
        }
        let full = max_tokens.min(tokens.len()) / self.block_size;
        hit.queried = full;
        let mut parent = *root;
        for i in 0..full {
            let toks = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let key = (self.key_fn)(&parent, toks);
            let Some(&id) = self.cache.get(&key) else { break };
            let b = &self.blocks[id as usize];
            if b.parent != parent || b.tokens != toks {
                break;
            }
            self.retain(id);
            hit.blocks.push(id);
            hit.keys.push(key);
            parent = key;
        }
        hit
    }

    /// Counts one admitted request's look-up: `queried` full blocks, `hits` of them cached.
    pub fn count_lookup(&mut self, queried: usize, hits: usize) {
        self.stats.prefix_queries += queried as u64;
        self.stats.prefix_hits += hits as u64;
    }

    /// Registers full block `id`, holding `tokens` after the block keyed `parent` (a root key
    /// when `first`: the sequence's first block), so later sequences can reuse it; returns its
    /// key. If another block already holds that key, the existing entry stays and this block
    /// remains private. `salted`: the sequence has a cache salt, and its event carries the
    /// block's hash only, never its token ids (a subscriber must not read a salted prompt).
    pub fn register(&mut self, id: BlockId, parent: &BlockKey, first: bool, tokens: &[u32], salted: bool) -> BlockKey {
        let key = (self.key_fn)(parent, tokens);
        if !self.enable_prefix_cache || self.cache.contains_key(&key) {
            return key;
        }
        self.cache.insert(key, id);
        self.record_stored(&key, (!first).then_some(parent), if salted { &[] } else { tokens });
        let b = &mut self.blocks[id as usize];
        b.key = Some(key);
        b.parent = *parent;
        b.tokens = tokens.to_vec();
        key
    }

    /// Forgets every cached block (their contents are gone, e.g. a pipeline stage restarted).
    /// Blocks still referenced stay allocated, but are no longer shared.
    pub fn drop_prefix_cache(&mut self) {
        self.cache.clear();
        if let Some(ev) = self.events.as_mut() {
            ev.push(KvEvent::AllCleared);
        }
        for (_, id) in std::mem::take(&mut self.lru) {
            self.free.push(id);
        }
        for b in &mut self.blocks {
            b.key = None;
        }
    }

    /// Reference count of a block (tests).
    pub fn refs(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].refs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Registers `tokens`' full blocks (after the unsalted root) on fresh blocks.
    fn fill(bm: &mut BlockManager, tokens: &[u32], root: &BlockKey) -> Vec<BlockId> {
        let mut parent = *root;
        tokens
            .chunks_exact(bm.block_size)
            .enumerate()
            .map(|(i, c)| {
                let id = bm.allocate().unwrap();
                parent = bm.register(id, &parent, i == 0, c, false);
                id
            })
            .collect()
    }

    #[test]
    fn reuse_longest_prefix_then_evict_lru() {
        let mut bm = BlockManager::new(4, 2, true);
        let root = root_key(None);
        let mut t = fill(&mut bm, &[1, 2, 3, 4], &root);
        t.push(bm.allocate().unwrap());
        bm.release(&t);
        assert_eq!(bm.stats().cached_idle, 2);
        assert_eq!(bm.stats().free, 2);
        // Same first block, different second block: one hit.
        let hit = bm.lookup_prefix(&[1, 2, 9, 9, 7], 4, &root);
        assert_eq!((hit.blocks.clone(), hit.queried), (vec![t[0]], 2));
        assert_eq!(bm.refs(t[0]), 1);
        // Exhaust: free blocks first, then the LRU cached block (t[1]) is evicted.
        let x = bm.allocate().unwrap();
        let y = bm.allocate().unwrap();
        let z = bm.allocate().unwrap();
        assert_eq!(z, t[1]);
        assert!(bm.allocate().is_none());
        assert_eq!(bm.stats().evictions, 1);
        bm.release(&[x, y, z]);
        bm.release(&hit.blocks);
        let s = bm.stats();
        assert_eq!(s.in_use, 0);
        assert_eq!(s.free + s.cached_idle, 4);
    }

    #[test]
    fn prefix_cache_off_never_hits() {
        let mut bm = BlockManager::new(4, 2, false);
        let root = root_key(None);
        let id = bm.allocate().unwrap();
        bm.register(id, &root, true, &[1, 2], false);
        bm.release(&[id]);
        assert!(bm.lookup_prefix(&[1, 2, 3], 3, &root).blocks.is_empty());
        assert_eq!(bm.stats().free, 4);
    }

    /// Every block gets the same key: a hit must still compare tokens and parent.
    fn colliding(_: &BlockKey, _: &[u32]) -> BlockKey {
        [7; 32]
    }

    #[test]
    fn colliding_keys_never_share_blocks() {
        let mut bm = BlockManager::new(8, 2, true).with_key_fn(colliding);
        let root = root_key(None);
        let a = fill(&mut bm, &[1, 2, 3, 4], &root);
        bm.release(&a);
        // Another prompt, same (forced) keys: no hit.
        assert!(bm.lookup_prefix(&[5, 6, 7, 8, 9], 4, &root).blocks.is_empty());
        // The same prompt still hits its first block (its second has the same key as the first,
        // so the cache holds only the first).
        assert_eq!(bm.lookup_prefix(&[1, 2, 3, 4, 9], 4, &root).blocks, vec![a[0]]);
    }

    #[test]
    fn salted_requests_never_hit_each_others_blocks() {
        let mut bm = BlockManager::new(8, 2, true);
        let (none, t1, t2) = (root_key(None), root_key(Some("tenant-1")), root_key(Some("tenant-2")));
        assert!(none != t1 && t1 != t2 && root_key(Some("")) != none);
        let a = fill(&mut bm, &[1, 2, 3, 4], &t1);
        bm.release(&a);
        assert!(bm.lookup_prefix(&[1, 2, 3, 4, 5], 4, &t2).blocks.is_empty());
        assert!(bm.lookup_prefix(&[1, 2, 3, 4, 5], 4, &none).blocks.is_empty());
        let hit = bm.lookup_prefix(&[1, 2, 3, 4, 5], 4, &t1);
        assert_eq!(hit.blocks, a);
        // Look-ups count nothing until the engine counts an admitted request.
        assert_eq!((bm.stats().prefix_queries, bm.stats().prefix_hits), (0, 0));
        bm.count_lookup(hit.queried, hit.blocks.len());
        assert_eq!((bm.stats().prefix_queries, bm.stats().prefix_hits), (2, 2));
    }

    #[test]
    fn events_track_the_cached_set() {
        let mut bm = BlockManager::new(3, 2, true).with_events();
        let root = root_key(None);
        let a = fill(&mut bm, &[1, 2, 3, 4], &root);
        let k0 = block_key(&root, &[1, 2]);
        let k1 = block_key(&k0, &[3, 4]);
        let (h0, h1) = (external_hash(&k0), external_hash(&k1));
        assert_eq!(
            bm.take_events(),
            vec![KvEvent::Stored { hashes: vec![h0, h1], parent: None, tokens: vec![1, 2, 3, 4] }]
        );
        // A block after a cached one names it as its parent.
        let c = bm.allocate().unwrap();
        let k2 = bm.register(c, &k1, false, &[5, 6], false);
        let want = KvEvent::Stored { hashes: vec![external_hash(&k2)], parent: Some(h1), tokens: vec![5, 6] };
        assert_eq!(bm.take_events(), vec![want]);
        // Registering a key already cached changes nothing.
        bm.register(c, &k1, false, &[5, 6], false);
        assert!(bm.take_events().is_empty());
        // A salted sequence's blocks are published by hash only.
        let mut salted = BlockManager::new(2, 2, true).with_events();
        let sroot = root_key(Some("tenant"));
        let b = salted.allocate().unwrap();
        let sk = salted.register(b, &sroot, true, &[7, 8], true);
        assert_eq!(
            salted.take_events(),
            vec![KvEvent::Stored { hashes: vec![external_hash(&sk)], parent: None, tokens: vec![] }]
        );
        let mut keys = bm.cached_keys();
        keys.sort();
        let mut want = vec![k0, k1, k2];
        want.sort();
        assert_eq!(keys, want);
        bm.release(&[a[0], a[1], c]);
        // Evicted least recently used first (a sequence's later blocks first).
        let x = bm.allocate().unwrap();
        let y = bm.allocate().unwrap();
        assert_eq!((x, y), (c, a[1]));
        assert_eq!(bm.take_events(), vec![KvEvent::Removed { hashes: vec![external_hash(&k2), h1] }]);
        assert_eq!(bm.cached_keys(), vec![k0]);
        bm.drop_prefix_cache();
        assert_eq!(bm.take_events(), vec![KvEvent::AllCleared]);
        assert!(bm.cached_keys().is_empty());
        bm.release(&[x, y]);
        // Not recording: nothing is kept.
        let mut off = BlockManager::new(2, 2, true);
        fill(&mut off, &[1, 2], &root);
        assert!(off.take_events().is_empty());
    }

    #[test]
    fn block_keys_are_sha256_chains() {
        let root = root_key(None);
        let k = block_key(&root, &[1, 2]);
        assert_ne!(k, block_key(&root, &[2, 1]));
        assert_ne!(block_key(&k, &[3]), block_key(&root, &[3]));
        assert_eq!(k, block_key(&root, &[1, 2]));
    }
}
