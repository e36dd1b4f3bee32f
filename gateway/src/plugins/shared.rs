//! The memory a plugin slot's instances share (`shared-get`, `shared-set`,
//! `shared-compare-and-swap`, `shared-remove` in `sluice:policy/host`): u64
//! values under u64 keys, each with a time to live, bounded in entries. The
//! host runs several instances of a plugin side by side and may drop any of
//! them, so what must be the same for every call (a session's worker, a
//! tenant's budget) lives here. Sharded by key so that calls on different
//! threads rarely wait on one another.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const SHARDS: usize = 16;

/// A full shard drops its expired entries at most this often (a sweep walks
/// the whole shard; a plugin that keeps a full store full must not make
/// every `set` pay for one).
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);

/// The shard of `key`: keys are often hashes already, but not always (a
/// tenant id), so they are mixed first.
fn shard_index(key: u64) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % SHARDS
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    value: u64,
    /// Nanoseconds since the store's origin; `u64::MAX` = never.
    expires: u64,
}

#[derive(Debug, Default)]
struct Shard {
    entries: HashMap<u64, Entry>,
    /// When (ns since the origin) the shard last dropped its expired entries.
    swept: u64,
}

/// One slot's shared entries.
#[derive(Debug)]
pub struct SharedStore {
    shards: [Mutex<Shard>; SHARDS],
    /// Entries one shard may hold.
    per_shard: usize,
    origin: Instant,
    /// Stores refused because the key's shard was full.
    pub refused: AtomicU64,
}

impl SharedStore {
    /// A store of at most `max_entries` entries (rounded up to a multiple of
    /// the shard count).
    pub fn new(max_entries: usize) -> Self {
        Self {
            shards: std::array::from_fn(|_| Mutex::new(Shard::default())),
            per_shard: max_entries.div_ceil(SHARDS).max(1),
            origin: Instant::now(),
            refused: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    fn shard(&self, key: u64) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[shard_index(key)]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn expiry(&self, now: u64, ttl_ms: u32) -> u64 {
        match ttl_ms {
            0 => u64::MAX,
            ms => now.saturating_add(u64::from(ms) * 1_000_000),
        }
    }

    /// The live value under `key`.
    pub fn get(&self, key: u64) -> Option<u64> {
        let now = self.now();
        let shard = self.shard(key);
        shard
            .entries
            .get(&key)
            .filter(|e| e.expires > now)
            .map(|e| e.value)
    }

    /// Stores `value` under `key` for `ttl_ms` (0 = until removed); false
    /// when the key is new and its shard is full of live entries.
    pub fn set(&self, key: u64, value: u64, ttl_ms: u32) -> bool {
        let now = self.now();
        let expires = self.expiry(now, ttl_ms);
        let mut shard = self.shard(key);
        if !self.room_for(&mut shard, key, now) {
            return false;
        }
        shard.entries.insert(key, Entry { value, expires });
        true
    }

    /// Stores `new` under `key` if its live value is `expected` (`None`:
    /// absent or expired); true when it stored.
    pub fn compare_and_swap(&self, key: u64, expected: Option<u64>, new: u64, ttl_ms: u32) -> bool {
        let now = self.now();
        let expires = self.expiry(now, ttl_ms);
        let mut shard = self.shard(key);
        let current = shard
            .entries
            .get(&key)
            .filter(|e| e.expires > now)
            .map(|e| e.value);
        if current != expected || !self.room_for(&mut shard, key, now) {
            return false;
        }
        shard.entries.insert(
            key,
            Entry {
                value: new,
                expires,
            },
        );
        true
    }

    pub fn remove(&self, key: u64) {
        self.shard(key).entries.remove(&key);
    }

    /// Entries held now (expired ones not yet dropped included).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).entries.len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `key` may be stored in `shard`: it is there already, or there
    /// is room (after dropping expired entries, when a sweep is due).
    fn room_for(&self, shard: &mut Shard, key: u64, now: u64) -> bool {
        if shard.entries.len() < self.per_shard || shard.entries.contains_key(&key) {
            return true;
        }
        if now.saturating_sub(shard.swept) >= SWEEP_INTERVAL.as_nanos() as u64 || shard.swept == 0 {
            shard.entries.retain(|_, e| e.expires > now);
            shard.swept = now;
        }
        let room = shard.entries.len() < self.per_shard;
        if !room {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        room
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_remove_and_compare_and_swap() {
        let store = SharedStore::new(64);
        assert_eq!(store.get(7), None);
        assert!(store.set(7, 70, 0));
        assert_eq!(store.get(7), Some(70));
        assert!(
            !store.compare_and_swap(7, Some(1), 2, 0),
            "wrong expectation"
        );
        assert_eq!(store.get(7), Some(70));
        assert!(store.compare_and_swap(7, Some(70), 71, 0));
        assert_eq!(store.get(7), Some(71));
        assert!(!store.compare_and_swap(8, Some(0), 1, 0), "absent is not 0");
        assert!(store.compare_and_swap(8, None, 80, 0));
        store.remove(7);
        assert_eq!(store.get(7), None);
        assert_eq!(store.get(8), Some(80));
    }

    #[test]
    fn entries_expire_and_expired_ones_make_room() {
        let store = SharedStore::new(SHARDS); // one entry a shard
        assert!(store.set(1, 10, 1));
        std::thread::sleep(Duration::from_millis(3));
        assert_eq!(store.get(1), None, "expired after its ttl");
        assert!(
            store.compare_and_swap(1, None, 11, 0),
            "an expired entry counts as absent"
        );
        // Key 1's shard is full with a live entry: another key of it is refused.
        let same_shard = (2u64..)
            .find(|&k| shard_index(k) == shard_index(1))
            .unwrap();
        assert!(!store.set(same_shard, 1, 0), "the shard is full");
        assert_eq!(store.refused.load(Ordering::Relaxed), 1);
        assert!(store.set(1, 12, 0), "a key already there may be replaced");
        store.remove(1);
        assert!(store.set(same_shard, 1, 0));
    }

    #[test]
    fn threads_counting_with_compare_and_swap_lose_no_update() {
        let store = std::sync::Arc::new(SharedStore::new(64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        loop {
                            let now = store.get(5);
                            if store.compare_and_swap(5, now, now.unwrap_or(0) + 1, 0) {
                                break;
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(store.get(5), Some(4000));
    }
}
