//! Recurrent-state slots (hybrid models' Gated DeltaNet layers): a fixed-size state per running
//! sequence, beside its KV blocks. A sequence takes a slot when it is admitted and gives it back
//! when it finishes or is preempted (recomputed from its tokens later, from a zero state). The
//! GPU side (the state buffers) lives in model::recurrent; this is host-side bookkeeping only.
//!
//! Free slots also hold **state snapshots** for the prefix cache: the state after a full KV
//! block, kept under that block's key (which names the whole prefix up to it). A new sequence
//! whose cached prefix ends at such a block takes the snapshot's slot as its own and starts
//! after the prefix. Snapshots are a cache: the least recently stored is given up whenever a slot
//! is needed and none is free.

use super::BlockKey;

/// The slots of a hybrid model: free, lent to sequences, or holding snapshots.
#[derive(Clone, Debug)]
pub struct StateSlots {
    free: Vec<u32>,
    /// Snapshots, least recently used first.
    snapshots: Vec<(BlockKey, u32)>,
    /// Snapshot slots steps in flight read from, with how many.
    pinned: Vec<(u32, usize)>,
    total: usize,
}

impl StateSlots {
    /// `total` slots (0: the model has no recurrent layers, and sequences need none).
    pub fn new(total: usize) -> StateSlots {
        // Handed out lowest first.
        StateSlots { free: (0..total as u32).rev().collect(), snapshots: Vec::new(), pinned: Vec::new(), total }
    }

    /// Whether sequences need a slot at all.
    pub fn needed(&self) -> bool {
        self.total > 0
    }

    /// Slots that `acquire` can give: free ones and those of unpinned snapshots.
    pub fn available(&self) -> usize {
        self.free.len() + self.snapshots.iter().filter(|s| !self.is_pinned(s.1)).count()
    }

    /// Slots lent to sequences (or to snapshots being taken).
    pub fn in_use(&self) -> usize {
        self.total - self.free.len() - self.snapshots.len()
    }

    fn is_pinned(&self, slot: u32) -> bool {
        self.pinned.iter().any(|p| p.0 == slot)
    }

    pub fn snapshots(&self) -> usize {
        self.snapshots.len()
    }

    /// A free slot, else the least recently used unpinned snapshot's.
    pub fn acquire(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let i = self.snapshots.iter().position(|s| !self.is_pinned(s.1))?;
        Some(self.snapshots.remove(i).1)
    }

    /// Gives a slot back (one that is already free or cached, or out of range, is ignored).
    pub fn release(&mut self, slot: u32) {
        if (slot as usize) < self.total && !self.free.contains(&slot) && !self.snapshots.iter().any(|s| s.1 == slot) {
            self.free.push(slot);
        }
    }

    /// Keeps `slot` (lent, and now holding the state after the block `key`) as that block's
    /// snapshot; a snapshot already there for the key stays, and `slot` is freed.
    pub fn store(&mut self, key: BlockKey, slot: u32) {
        if self.snapshots.iter().any(|s| s.0 == key) {
            self.release(slot);
        } else if (slot as usize) < self.total && !self.free.contains(&slot) {
            self.snapshots.push((key, slot));
        }
    }

    /// Whether the state after block `key` is kept.
    pub fn has(&self, key: &BlockKey) -> bool {
        self.snapshots.iter().any(|s| &s.0 == key)
    }

    /// Forgets every snapshot (the KV cache they follow is gone).
    pub fn drop_snapshots(&mut self) {
        self.free.extend(self.snapshots.drain(..).map(|s| s.1));
        self.pinned.clear();
    }

    /// The slot of the snapshot after block `key`, pinned (and marked most recently used) until
    /// `unpin`: a step reads it.
    pub fn read(&mut self, key: &BlockKey) -> Option<u32> {
        let i = self.snapshots.iter().position(|s| &s.0 == key)?;
        let s = self.snapshots.remove(i);
        self.snapshots.push(s);
        match self.pinned.iter_mut().find(|p| p.0 == s.1) {
            Some(p) => p.1 += 1,
            None => self.pinned.push((s.1, 1)),
        }
        Some(s.1)
    }

    /// A step that read snapshot slot `slot` is done.
    pub fn unpin(&mut self, slot: u32) {
        if let Some(i) = self.pinned.iter().position(|p| p.0 == slot) {
            self.pinned[i].1 -= 1;
            if self.pinned[i].1 == 0 {
                self.pinned.remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_lent_once_and_come_back() {
        let mut s = StateSlots::new(2);
        let (a, b) = (s.acquire().unwrap(), s.acquire().unwrap());
        assert_ne!(a, b);
        assert_eq!(s.acquire(), None);
        assert_eq!(s.in_use(), 2);
        s.release(a);
        s.release(a);
        s.release(7);
        assert_eq!((s.available(), s.in_use()), (1, 1));
        assert_eq!(s.acquire(), Some(a));
        assert!(!StateSlots::new(0).needed());
    }

    #[test]
    fn snapshots_are_kept_taken_and_given_up_oldest_first() {
        let mut s = StateSlots::new(3);
        let (a, b, c) = (s.acquire().unwrap(), s.acquire().unwrap(), s.acquire().unwrap());
        s.store([1; 32], a);
        s.store([2; 32], b);
        // A second snapshot of the same block frees its slot.
        s.store([2; 32], c);
        assert_eq!((s.snapshots(), s.available(), s.in_use()), (2, 3, 0));
        assert!(s.has(&[1; 32]) && !s.has(&[3; 32]));
        // The free slot first, then the oldest snapshot's.
        assert_eq!(s.acquire(), Some(c));
        assert_eq!(s.acquire(), Some(a));
        assert!(!s.has(&[1; 32]));
        // Read (pinned): kept, and not given up while pinned.
        assert_eq!(s.read(&[2; 32]), Some(b));
        assert_eq!((s.snapshots(), s.available()), (1, 0));
        assert_eq!(s.acquire(), None);
        s.unpin(b);
        assert_eq!(s.acquire(), Some(b));
        assert_eq!((s.snapshots(), s.available()), (0, 0));
    }
}
