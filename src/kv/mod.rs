//! Paged KV-cache bookkeeping: a pool of fixed-size blocks, ref-counted, with an automatic
//! prefix cache. Every full block is keyed by a hash chained from its parent block's key and its
//! token ids; a new sequence reuses the longest run of cached blocks. Blocks nobody references
//! stay cached (and reusable) until memory is needed, then are evicted least-recently-used first.
//! The GPU side (the cache buffers) lives in model::forward; this is host-side state only.

use std::collections::{BTreeMap, HashMap};

pub type BlockId = u32;

/// Key of a full block: hash of (parent key, the block's token ids).
pub fn block_key(parent: u64, tokens: &[u32]) -> u64 {
    // FNV-1a over the parent key and tokens, then a final mix; stable across runs and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(parent);
    for &t in tokens {
        eat(t as u64);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

#[derive(Clone, Debug, Default)]
struct Block {
    refs: u32,
    /// Prefix-cache key once the block is full and registered.
    key: Option<u64>,
    /// LRU stamp while evictable (refs == 0 and key set).
    stamp: u64,
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
    cache: HashMap<u64, BlockId>,
    /// Evictable blocks by LRU stamp.
    lru: BTreeMap<u64, BlockId>,
    clock: u64,
    stats: KvStats,
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
            lru: BTreeMap::new(),
            clock: 0,
            stats: KvStats::default(),
        }
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
            }
            self.stats.evictions += 1;
            id
        };
        let b = &mut self.blocks[id as usize];
        debug_assert_eq!(b.refs, 0);
        b.refs = 1;
        b.key = None;
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

    /// Longest run of cached full blocks for `tokens` (at most `max_tokens` tokens' worth),
    /// each retained. Returns the blocks and their chained keys.
    pub fn lookup_prefix(&mut self, tokens: &[u32], max_tokens: usize) -> (Vec<BlockId>, Vec<u64>) {
        let mut blocks = Vec::new();
        let mut keys = Vec::new();
        if !self.enable_prefix_cache {
            return (blocks, keys);
        }
        let full = max_tokens.min(tokens.len()) / self.block_size;
        let mut parent = 0u64;
        for i in 0..full {
            let key = block_key(parent, &tokens[i * self.block_size..(i + 1) * self.block_size]);
            self.stats.prefix_queries += 1;
            match self.cache.get(&key) {
                Some(&id) => {
                    self.stats.prefix_hits += 1;
                    self.retain(id);
                    blocks.push(id);
                    keys.push(key);
                    parent = key;
                }
                None => break,
            }
        }
        (blocks, keys)
    }

    /// Registers a full block under `key` so later sequences can reuse it. If another block
    /// already holds that key, the existing entry stays and this block remains private.
    pub fn register(&mut self, id: BlockId, key: u64) {
        if !self.enable_prefix_cache || self.cache.contains_key(&key) {
            return;
        }
        self.cache.insert(key, id);
        self.blocks[id as usize].key = Some(key);
    }

    /// Forgets every cached block (their contents are gone, e.g. a pipeline stage restarted).
    /// Blocks still referenced stay allocated, but are no longer shared.
    pub fn drop_prefix_cache(&mut self) {
        self.cache.clear();
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

    fn keys_of(bm: &BlockManager, tokens: &[u32]) -> Vec<u64> {
        let mut parent = 0;
        tokens
            .chunks_exact(bm.block_size)
            .map(|c| {
                parent = block_key(parent, c);
                parent
            })
            .collect()
    }

    #[test]
    fn reuse_longest_prefix_then_evict_lru() {
        let mut bm = BlockManager::new(4, 2, true);
        let a = [1, 2, 3, 4, 5];
        let t: Vec<BlockId> = (0..3).map(|_| bm.allocate().unwrap()).collect();
        for (id, k) in t.iter().zip(keys_of(&bm, &a)) {
            bm.register(*id, k);
        }
        bm.release(&t);
        assert_eq!(bm.stats().cached_idle, 2);
        assert_eq!(bm.stats().free, 2);
        // Same first block, different second block: one hit.
        let (hit, _) = bm.lookup_prefix(&[1, 2, 9, 9, 7], 4);
        assert_eq!(hit, vec![t[0]]);
        assert_eq!(bm.refs(t[0]), 1);
        // Exhaust: free blocks first, then the LRU cached block (t[1]) is evicted.
        let x = bm.allocate().unwrap();
        let y = bm.allocate().unwrap();
        let z = bm.allocate().unwrap();
        assert_eq!(z, t[1]);
        assert!(bm.allocate().is_none());
        assert_eq!(bm.stats().evictions, 1);
        bm.release(&[x, y, z]);
        bm.release(&hit);
        let s = bm.stats();
        assert_eq!(s.in_use, 0);
        assert_eq!(s.free + s.cached_idle, 4);
    }

    #[test]
    fn prefix_cache_off_never_hits() {
        let mut bm = BlockManager::new(4, 2, false);
        let id = bm.allocate().unwrap();
        bm.register(id, block_key(0, &[1, 2]));
        bm.release(&[id]);
        assert!(bm.lookup_prefix(&[1, 2, 3], 3).0.is_empty());
        assert_eq!(bm.stats().free, 4);
    }
}
