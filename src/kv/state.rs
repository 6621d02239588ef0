//! Recurrent-state slots (hybrid models' Gated DeltaNet layers): a fixed-size state per running
//! sequence, beside its KV blocks. A sequence takes a slot when it is admitted and gives it back
//! when it finishes or is preempted (recomputed from its tokens later, from a zero state). The
//! GPU side (the state buffers) lives in model::recurrent; this is host-side bookkeeping only.

/// The free slots of `total`.
#[derive(Clone, Debug)]
pub struct StateSlots {
    free: Vec<u32>,
    total: usize,
}

impl StateSlots {
    /// `total` slots (0: the model has no recurrent layers, and sequences need none).
    pub fn new(total: usize) -> StateSlots {
        // Handed out lowest first.
        StateSlots { free: (0..total as u32).rev().collect(), total }
    }

    /// Whether sequences need a slot at all.
    pub fn needed(&self) -> bool {
        self.total > 0
    }

    pub fn available(&self) -> usize {
        self.free.len()
    }

    pub fn in_use(&self) -> usize {
        self.total - self.free.len()
    }

    pub fn acquire(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Gives a slot back (one that is already free, or out of range, is ignored).
    pub fn release(&mut self, slot: u32) {
        if (slot as usize) < self.total && !self.free.contains(&slot) {
            self.free.push(slot);
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
}
