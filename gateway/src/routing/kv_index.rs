//! The KV index: which worker holds which prompt block, fed by the workers'
//! KV events, asked for each worker's cached-prefix overlap with a prompt.
//! A pure data structure (no tokio, no locks), tested on its own.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// Block hashes are XXH3 outputs already: hashing them again is wasted work.
#[derive(Default)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed here; fold anything else in.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type BlockMap<V> = HashMap<u64, V, BuildHasherDefault<PassThroughHasher>>;

/// Which workers hold each block (by sequence hash), and each worker's blocks.
#[derive(Debug, Default)]
pub struct KvIndex {
    /// Block hash -> the workers holding it (a handful at most).
    holders: BlockMap<Vec<u32>>,
    /// Worker -> its blocks, for removal and resync.
    by_worker: HashMap<u32, HashSet<u64, BuildHasherDefault<PassThroughHasher>>>,
}

impl KvIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// `worker` now holds `hashes`.
    pub fn store(&mut self, worker: u32, hashes: &[u64]) {
        let own = self.by_worker.entry(worker).or_default();
        for &h in hashes {
            if own.insert(h) {
                self.holders.entry(h).or_default().push(worker);
            }
        }
    }

    /// `worker` dropped `hashes`.
    pub fn remove(&mut self, worker: u32, hashes: &[u64]) {
        let Some(own) = self.by_worker.get_mut(&worker) else {
            return;
        };
        for h in hashes {
            if own.remove(h) {
                Self::unhold(&mut self.holders, *h, worker);
            }
        }
    }

    /// `worker` holds nothing (it cleared its cache, died, or left).
    pub fn clear_worker(&mut self, worker: u32) {
        if let Some(own) = self.by_worker.remove(&worker) {
            for h in own {
                Self::unhold(&mut self.holders, h, worker);
            }
        }
    }

    /// `worker` holds exactly `hashes` (a resync from its snapshot).
    pub fn replace_worker(&mut self, worker: u32, hashes: &[u64]) {
        self.clear_worker(worker);
        self.store(worker, hashes);
    }

    fn unhold(holders: &mut BlockMap<Vec<u32>>, hash: u64, worker: u32) {
        if let Some(workers) = holders.get_mut(&hash) {
            workers.retain(|&w| w != worker);
            if workers.is_empty() {
                holders.remove(&hash);
            }
        }
    }

    /// Blocks `worker` holds.
    pub fn blocks_of(&self, worker: u32) -> usize {
        self.by_worker.get(&worker).map_or(0, HashSet::len)
    }

    /// The blocks `worker` holds, in no order.
    pub fn hashes_of(&self, worker: u32) -> Vec<u64> {
        self.by_worker
            .get(&worker)
            .map_or_else(Vec::new, |own| own.iter().copied().collect())
    }

    /// Every block known, on any worker.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Calls `found(worker, blocks)` for each worker holding a prefix of
    /// `prompt` (the prompt's block hashes, in order): `blocks` leading blocks
    /// are cached there. Workers holding none are not reported. Stops early once
    /// no worker holds the next block.
    pub fn overlaps(&self, prompt: &[u64], mut found: impl FnMut(u32, u32)) {
        let Some(first) = prompt.first().and_then(|h| self.holders.get(h)) else {
            return;
        };
        let mut alive: Vec<u32> = first.clone();
        let mut depth = 1u32;
        for h in &prompt[1..] {
            let holders = self.holders.get(h).map_or(&[][..], Vec::as_slice);
            alive.retain(|w| {
                let keeps = holders.contains(w);
                if !keeps {
                    found(*w, depth);
                }
                keeps
            });
            if alive.is_empty() {
                return;
            }
            depth += 1;
        }
        for w in alive {
            found(w, depth);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overlaps(index: &KvIndex, prompt: &[u64]) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        index.overlaps(prompt, |w, n| out.push((w, n)));
        out.sort_unstable();
        out
    }

    #[test]
    fn overlap_is_the_leading_run_per_worker() {
        let mut index = KvIndex::new();
        index.store(1, &[10, 11, 12]);
        index.store(2, &[10, 11]);
        index.store(3, &[11, 12]); // no first block: no prefix
        assert_eq!(overlaps(&index, &[10, 11, 12, 13]), [(1, 3), (2, 2)]);
        assert_eq!(overlaps(&index, &[10]), [(1, 1), (2, 1)]);
        assert_eq!(overlaps(&index, &[99, 10]), []);
        assert_eq!(overlaps(&index, &[]), []);
    }

    #[test]
    fn a_hole_ends_the_prefix() {
        let mut index = KvIndex::new();
        index.store(1, &[10, 12]);
        assert_eq!(overlaps(&index, &[10, 11, 12]), [(1, 1)]);
    }

    #[test]
    fn remove_clear_and_replace() {
        let mut index = KvIndex::new();
        index.store(1, &[10, 11, 12]);
        index.store(2, &[10, 11]);
        index.remove(1, &[11]);
        assert_eq!(overlaps(&index, &[10, 11, 12]), [(1, 1), (2, 2)]);
        index.clear_worker(2);
        assert_eq!(overlaps(&index, &[10, 11]), [(1, 1)]);
        assert_eq!(index.blocks_of(2), 0);
        index.replace_worker(1, &[20, 21]);
        assert_eq!(overlaps(&index, &[10]), []);
        assert_eq!(overlaps(&index, &[20, 21]), [(1, 2)]);
        assert_eq!(index.len(), 2, "no block is left without a holder");
    }

    #[test]
    fn storing_twice_and_removing_unknown_blocks_are_harmless() {
        let mut index = KvIndex::new();
        index.store(1, &[10, 10]);
        index.store(1, &[10]);
        index.remove(1, &[77]);
        index.remove(9, &[10]);
        assert_eq!(overlaps(&index, &[10]), [(1, 1)]);
        index.remove(1, &[10]);
        assert!(index.is_empty());
    }

    /// Random operations against a naive model of the same index.
    #[test]
    fn agrees_with_a_naive_model() {
        let mut index = KvIndex::new();
        let mut model: HashMap<u32, HashSet<u64>> = HashMap::new();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for _ in 0..5000 {
            let worker = next(4) as u32;
            let hashes: Vec<u64> = (0..next(4) + 1).map(|_| next(12)).collect();
            match next(10) {
                0..=5 => {
                    index.store(worker, &hashes);
                    model.entry(worker).or_default().extend(&hashes);
                }
                6..=8 => {
                    index.remove(worker, &hashes);
                    if let Some(set) = model.get_mut(&worker) {
                        for h in &hashes {
                            set.remove(h);
                        }
                    }
                }
                _ => {
                    index.clear_worker(worker);
                    model.remove(&worker);
                }
            }
            let prompt: Vec<u64> = (0..next(6)).map(|_| next(12)).collect();
            let mut expected: Vec<(u32, u32)> = model
                .iter()
                .map(|(&w, set)| {
                    (
                        w,
                        prompt.iter().take_while(|h| set.contains(h)).count() as u32,
                    )
                })
                .filter(|&(_, n)| n > 0)
                .collect();
            expected.sort_unstable();
            assert_eq!(overlaps(&index, &prompt), expected, "prompt {prompt:?}");
        }
    }
}
