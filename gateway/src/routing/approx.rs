//! Approximate mode: for a worker whose KV events are not heard, the gateway
//! predicts its cache from its own routing. A routed prompt's blocks count as
//! cached there until `ttl` after the last request that used them, at most
//! `max_blocks` per worker (the least recently used go first), as Dynamo's
//! and SGLang's approximate modes do. A pure data structure: the fleet
//! applies what it returns to the KV index.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// One worker's predicted blocks.
#[derive(Debug, Default)]
pub struct Predicted {
    /// Block hash -> when a routed request last used it.
    last_used: HashMap<u64, Instant>,
    /// Uses in time order; an entry is stale when `last_used` is later.
    uses: VecDeque<(Instant, u64)>,
}

impl Predicted {
    /// A request with these blocks was routed here at `now`: returns the
    /// blocks that were not predicted before (to add to the index).
    pub fn touch(&mut self, hashes: &[u64], now: Instant) -> Vec<u64> {
        let mut new = Vec::new();
        for &h in hashes {
            if self.last_used.insert(h, now).is_none() {
                new.push(h);
            }
            self.uses.push_back((now, h));
        }
        new
    }

    /// Forgets blocks unused for `ttl`, then the least recently used beyond
    /// `max_blocks`: returns them (to remove from the index).
    pub fn expire(&mut self, now: Instant, ttl: Duration, max_blocks: usize) -> Vec<u64> {
        let mut gone = Vec::new();
        while let Some(&(at, h)) = self.uses.front() {
            let expired = now.saturating_duration_since(at) >= ttl;
            if !expired && self.last_used.len() <= max_blocks {
                break;
            }
            self.uses.pop_front();
            // Only the block's latest use ends it.
            if self.last_used.get(&h) == Some(&at) {
                self.last_used.remove(&h);
                gone.push(h);
            }
        }
        // Stale uses pile up when the same blocks are routed again and
        // again; compact when they outnumber the live ones.
        if self.uses.len() > 2 * self.last_used.len() + 1024 {
            let last_used = &self.last_used;
            self.uses.retain(|(at, h)| last_used.get(h) == Some(at));
        }
        gone
    }

    /// Forgets everything (the worker's events are heard again, or it left).
    pub fn clear(&mut self) {
        self.last_used.clear();
        self.uses.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_live_until_ttl_after_their_last_use() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        let mut p = Predicted::default();
        assert_eq!(p.touch(&[1, 2, 3], t0), [1, 2, 3]);
        assert_eq!(p.touch(&[1, 2, 4], t0 + Duration::from_secs(5)), [4]);
        assert!(p.expire(t0 + Duration::from_secs(9), ttl, 100).is_empty());
        // 3 was last used at t0; 1, 2, 4 at t0 + 5 s.
        assert_eq!(p.expire(t0 + Duration::from_secs(10), ttl, 100), [3]);
        let mut gone = p.expire(t0 + Duration::from_secs(15), ttl, 100);
        gone.sort_unstable();
        assert_eq!(gone, [1, 2, 4]);
        assert!(p.last_used.is_empty());
    }

    #[test]
    fn the_least_recently_used_go_first_beyond_the_bound() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(60);
        let mut p = Predicted::default();
        for i in 0..10u64 {
            p.touch(&[i], t0 + Duration::from_millis(i));
        }
        p.touch(&[0], t0 + Duration::from_millis(20)); // 0 is used again
        let gone = p.expire(t0 + Duration::from_millis(30), ttl, 7);
        assert_eq!(gone, [1, 2, 3]);
        assert_eq!(p.last_used.len(), 7);
    }

    #[test]
    fn stale_uses_are_compacted() {
        let t0 = Instant::now();
        let mut p = Predicted::default();
        for i in 0..5000u32 {
            p.touch(&[7], t0 + Duration::from_micros(u64::from(i)));
        }
        p.expire(t0, Duration::from_secs(1), 10);
        assert_eq!(p.last_used.len(), 1);
        assert!(p.uses.len() <= 1, "{} uses kept", p.uses.len());
    }
}
