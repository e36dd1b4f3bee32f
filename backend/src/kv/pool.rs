//! The block allocator: reference-counted KV blocks, a prefix cache keyed by
//! block sequence hashes, and eviction of unreferenced cached blocks in LRU
//! order (or in the order a cache policy scores them). Every change to the set
//! of cached blocks is recorded as a [`KvEvent`] for the gateway's KV index.

use std::collections::{BTreeSet, HashMap, VecDeque};

/// A change to the set of cached blocks, in the order it happened.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEvent {
    /// Blocks became reusable by later requests; `parent` is the sequence hash
    /// of the block before the first one (`None` at the start of a prompt).
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
    },
    /// Blocks were evicted.
    Removed { hashes: Vec<u64> },
    /// Every cached block was dropped.
    AllCleared,
}

/// Facts about a block that a cache policy can score for eviction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionCandidate {
    pub block: u32,
    pub age_ms: u32,
    pub hits: u32,
    pub priority: u8,
    pub tenant_id: u32,
}

/// Chooses which unreferenced cached block to evict among the oldest few.
pub trait EvictionScorer: Send {
    /// One score per candidate; the highest is evicted.
    fn score(&mut self, candidates: &[EvictionCandidate]) -> Vec<f32>;
}

/// Plain LRU: the oldest goes first.
#[derive(Debug, Default)]
pub struct Lru;

impl EvictionScorer for Lru {
    fn score(&mut self, candidates: &[EvictionCandidate]) -> Vec<f32> {
        candidates.iter().map(|c| c.age_ms as f32).collect()
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Block {
    refs: u32,
    /// Sequence hash, once the block is full and registered in the cache.
    hash: Option<u64>,
    /// Parent sequence hash (for events).
    parent: Option<u64>,
    /// Tick of the last use (allocation or release): the LRU order.
    last_used: u64,
    /// The pool's clock at the last use, for ages shown to a scorer.
    last_used_ms: u64,
    hits: u32,
    priority: u8,
    tenant_id: u32,
}

/// Blocks handed to a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Block ids in position order.
    pub blocks: Vec<u32>,
    /// How many leading blocks came from the prefix cache (already computed).
    pub cached_blocks: usize,
}

/// How full the pool is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolUsage {
    /// Blocks referenced by running requests.
    pub used: u32,
    /// Unreferenced blocks kept for prefix reuse (evictable).
    pub cached: u32,
    pub total: u32,
}

/// The allocator of one worker's KV blocks.
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Never-hashed (or evicted) blocks with no references.
    free: VecDeque<u32>,
    /// Sequence hash -> the block that holds it.
    cached: HashMap<u64, u32>,
    /// Unreferenced cached blocks by (last use, id): eviction candidates.
    evictable: BTreeSet<(u64, u32)>,
    /// Candidates shown to the scorer per eviction.
    candidates_per_eviction: usize,
    scorer: Box<dyn EvictionScorer>,
    tick: u64,
    /// Milliseconds, set by the engine each step (ages for the scorer).
    now_ms: u64,
    events: Vec<KvEvent>,
}

impl std::fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockPool")
            .field("usage", &self.usage())
            .finish()
    }
}

impl BlockPool {
    pub fn new(n_blocks: u32) -> Self {
        Self {
            blocks: vec![Block::default(); n_blocks as usize],
            free: (0..n_blocks).collect(),
            cached: HashMap::new(),
            evictable: BTreeSet::new(),
            candidates_per_eviction: 16,
            scorer: Box::new(Lru),
            tick: 0,
            now_ms: 0,
            events: Vec::new(),
        }
    }

    /// Replaces the eviction order (a cache policy's scores).
    pub fn set_scorer(&mut self, scorer: Box<dyn EvictionScorer>) {
        self.scorer = scorer;
    }

    /// Advances the pool's clock (ages for the scorer).
    pub fn set_now_ms(&mut self, now_ms: u64) {
        self.now_ms = now_ms;
    }

    pub fn usage(&self) -> PoolUsage {
        let total = self.blocks.len() as u32;
        let cached = self.evictable.len() as u32;
        PoolUsage {
            used: total - cached - self.free.len() as u32,
            cached,
            total,
        }
    }

    /// Blocks that an allocation could get now (free + evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// How many leading `hashes` are cached.
    pub fn cached_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Every cached block's sequence hash (a snapshot for resyncs).
    pub fn cached_hashes(&self) -> Vec<u64> {
        let mut hashes: Vec<u64> = self.cached.keys().copied().collect();
        hashes.sort_unstable();
        hashes
    }

    /// Takes the events recorded since the last call.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn touch(&mut self, id: u32) {
        self.tick += 1;
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 && b.hash.is_some() {
            self.evictable.remove(&(b.last_used, id));
        }
        b.last_used = self.tick;
        b.last_used_ms = self.now_ms;
        b.refs += 1;
    }

    /// A block with no references and no cached content, evicting if needed.
    fn take_free(&mut self) -> Option<u32> {
        if let Some(id) = self.free.pop_front() {
            return Some(id);
        }
        let oldest: Vec<(u64, u32)> = self
            .evictable
            .iter()
            .take(self.candidates_per_eviction)
            .copied()
            .collect();
        if oldest.is_empty() {
            return None;
        }
        let candidates: Vec<EvictionCandidate> = oldest
            .iter()
            .map(|&(_, id)| {
                let b = &self.blocks[id as usize];
                EvictionCandidate {
                    block: id,
                    age_ms: self
                        .now_ms
                        .saturating_sub(b.last_used_ms)
                        .min(u64::from(u32::MAX)) as u32,
                    hits: b.hits,
                    priority: b.priority,
                    tenant_id: b.tenant_id,
                }
            })
            .collect();
        let scores = self.scorer.score(&candidates);
        let pick = if scores.len() == candidates.len() {
            scores
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                .map_or(0, |(i, _)| i)
        } else {
            0 // a scorer that answers wrongly gets LRU
        };
        let (last_used, id) = oldest[pick];
        self.evictable.remove(&(last_used, id));
        let b = &mut self.blocks[id as usize];
        if let Some(h) = b.hash.take() {
            self.cached.remove(&h);
            self.events.push(KvEvent::Removed { hashes: vec![h] });
        }
        *b = Block::default();
        Some(id)
    }

    /// Blocks for a prompt of `n_blocks` blocks whose full blocks have `hashes`:
    /// leading cached blocks are shared, the rest are fresh. All or nothing:
    /// `None` when the pool cannot supply them (nothing is changed then).
    pub fn allocate(&mut self, hashes: &[u64], n_blocks: usize) -> Option<Allocation> {
        let hit = self.cached_prefix(hashes).min(n_blocks);
        let reuse: Vec<u32> = hashes[..hit].iter().map(|h| self.cached[h]).collect();
        // Cached blocks that are themselves evictable do not count as available.
        let reused_evictable = reuse
            .iter()
            .filter(|&&id| self.blocks[id as usize].refs == 0)
            .count();
        if self.available() - reused_evictable < n_blocks - hit {
            return None;
        }
        let mut blocks = Vec::with_capacity(n_blocks);
        for id in reuse {
            self.touch(id);
            self.blocks[id as usize].hits += 1;
            blocks.push(id);
        }
        for _ in hit..n_blocks {
            let id = self.take_free().expect("availability checked");
            self.touch(id);
            blocks.push(id);
        }
        Some(Allocation {
            blocks,
            cached_blocks: hit,
        })
    }

    /// One more block for a growing sequence.
    pub fn append(&mut self) -> Option<u32> {
        let id = self.take_free()?;
        self.touch(id);
        Some(id)
    }

    /// Registers a full, computed block under its sequence hash so later
    /// requests can reuse it. If another block already holds that hash, this
    /// one stays private (and is freed on release).
    pub fn commit(
        &mut self,
        id: u32,
        hash: u64,
        parent: Option<u64>,
        priority: u8,
        tenant_id: u32,
    ) {
        if self.cached.contains_key(&hash) || self.blocks[id as usize].hash.is_some() {
            return;
        }
        self.cached.insert(hash, id);
        let b = &mut self.blocks[id as usize];
        (b.hash, b.parent, b.priority, b.tenant_id) = (Some(hash), parent, priority, tenant_id);
        match self.events.last_mut() {
            // Consecutive blocks of one prompt go out as one event.
            Some(KvEvent::Stored { hashes, .. }) if hashes.last() == parent.as_ref() => {
                hashes.push(hash)
            }
            _ => self.events.push(KvEvent::Stored {
                hashes: vec![hash],
                parent,
            }),
        }
    }

    /// Drops one reference to each block; unreferenced cached blocks stay
    /// reusable until evicted, the others are free at once.
    pub fn release(&mut self, blocks: &[u32]) {
        for &id in blocks {
            self.tick += 1;
            let b = &mut self.blocks[id as usize];
            assert!(b.refs > 0, "block {id} released more often than taken");
            b.refs -= 1;
            b.last_used = self.tick;
            b.last_used_ms = self.now_ms;
            if b.refs == 0 {
                if b.hash.is_some() {
                    self.evictable.insert((self.tick, id));
                } else {
                    self.free.push_back(id);
                }
            }
        }
    }

    /// Drops every unreferenced cached block.
    pub fn clear_cache(&mut self) {
        for (_, id) in std::mem::take(&mut self.evictable) {
            let b = &mut self.blocks[id as usize];
            if let Some(h) = b.hash.take() {
                self.cached.remove(&h);
            }
            *b = Block::default();
            self.free.push_back(id);
        }
        self.events.push(KvEvent::AllCleared);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_reused_and_counted() {
        let mut pool = BlockPool::new(8);
        let a = pool.allocate(&[1, 2, 3], 4).unwrap();
        assert_eq!(a.cached_blocks, 0);
        pool.commit(a.blocks[0], 1, None, 0, 0);
        pool.commit(a.blocks[1], 2, Some(1), 0, 0);
        assert_eq!(
            pool.drain_events(),
            vec![KvEvent::Stored {
                hashes: vec![1, 2],
                parent: None
            }]
        );
        // A second prompt sharing blocks 1-2 while the first still runs.
        let b = pool.allocate(&[1, 2, 9], 3).unwrap();
        assert_eq!(b.cached_blocks, 2);
        assert_eq!(b.blocks[..2], a.blocks[..2]);
        assert_eq!(
            pool.usage(),
            PoolUsage {
                used: 5,
                cached: 0,
                total: 8
            }
        );
        pool.release(&a.blocks);
        pool.release(&b.blocks);
        // Blocks 1 and 2 stay cached; the rest are free.
        assert_eq!(
            pool.usage(),
            PoolUsage {
                used: 0,
                cached: 2,
                total: 8
            }
        );
        assert_eq!(pool.cached_prefix(&[1, 2, 3]), 2);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_and_reports_it() {
        let mut pool = BlockPool::new(2);
        for hash in [10, 20] {
            let a = pool.allocate(&[hash], 1).unwrap();
            pool.commit(a.blocks[0], hash, None, 0, 0);
            pool.release(&a.blocks);
        }
        pool.drain_events();
        // Reuse 10, so 20 is now the older one.
        let again = pool.allocate(&[10], 1).unwrap();
        pool.release(&again.blocks);
        let fresh = pool.allocate(&[], 1).unwrap();
        assert_eq!(
            pool.drain_events(),
            vec![KvEvent::Removed { hashes: vec![20] }]
        );
        assert_eq!(pool.cached_prefix(&[10]), 1);
        assert_eq!(pool.cached_prefix(&[20]), 0);
        assert!(pool.allocate(&[], 1).is_some());
        assert!(pool.allocate(&[], 1).is_none(), "nothing left");
        pool.release(&fresh.blocks);
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut pool = BlockPool::new(3);
        let a = pool.allocate(&[], 2).unwrap();
        assert!(pool.allocate(&[], 2).is_none());
        assert_eq!(pool.usage().used, 2, "a failed allocation takes nothing");
        pool.release(&a.blocks);
        assert_eq!(pool.available(), 3);
    }

    #[test]
    fn a_scorer_chooses_the_victim() {
        struct KeepTenantOne;
        impl EvictionScorer for KeepTenantOne {
            fn score(&mut self, c: &[EvictionCandidate]) -> Vec<f32> {
                c.iter()
                    .map(|c| if c.tenant_id == 1 { 0.0 } else { 1.0 })
                    .collect()
            }
        }
        let mut pool = BlockPool::new(2);
        pool.set_scorer(Box::new(KeepTenantOne));
        for (hash, tenant) in [(1, 1), (2, 2)] {
            let a = pool.allocate(&[hash], 1).unwrap();
            pool.commit(a.blocks[0], hash, None, 0, tenant);
            pool.release(&a.blocks);
        }
        pool.allocate(&[], 1).unwrap();
        assert_eq!(
            pool.cached_prefix(&[1]),
            1,
            "tenant 1's block survived though older"
        );
    }

    #[test]
    fn a_duplicate_hash_stays_private_and_clear_reports() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(&[7], 1).unwrap();
        let b = pool.allocate(&[], 1).unwrap();
        pool.commit(a.blocks[0], 7, None, 0, 0);
        pool.commit(b.blocks[0], 7, None, 0, 0); // computed twice concurrently
        pool.release(&b.blocks);
        assert_eq!(pool.usage().cached, 0, "the duplicate was freed");
        pool.release(&a.blocks);
        pool.clear_cache();
        assert_eq!(pool.cached_prefix(&[7]), 0);
        assert_eq!(pool.drain_events().last(), Some(&KvEvent::AllCleared));
        assert_eq!(pool.available(), 4);
    }
}
