//! A bounded two-generation cache: entries go into the current generation;
//! when it is full (by entries or by bytes) it becomes the old one and the
//! generation before is dropped; a hit in the old generation moves the entry
//! back into the current one. Nothing is ever scanned or sorted, so a hit
//! costs a hash lookup or two and a full cache one map swap.

use std::borrow::Borrow;
use std::hash::Hash;

use rustc_hash::FxHashMap;

#[derive(Debug)]
pub struct Generations<K, V> {
    current: FxHashMap<K, V>,
    /// Bytes held by `current`, as the callers counted them at insertion.
    current_bytes: usize,
    old: FxHashMap<K, V>,
    max_entries: usize,
    max_bytes: usize,
    /// An entry's footprint in bytes, for the byte bound.
    size: fn(&K, &V) -> usize,
}

impl<K: Hash + Eq, V> Generations<K, V> {
    /// At most `max_entries` and `max_bytes` (entries measured by `size`) per
    /// generation; twice that is kept.
    pub fn new(max_entries: usize, max_bytes: usize, size: fn(&K, &V) -> usize) -> Self {
        Self {
            current: FxHashMap::default(),
            current_bytes: 0,
            old: FxHashMap::default(),
            max_entries,
            max_bytes,
            size,
        }
    }

    /// `read` of the value of `key`, which moves into the current generation
    /// if it was old. (A closure rather than a returned `&V`: returning the
    /// borrow of one lookup conditionally would not pass the borrow checker,
    /// and a second lookup costs a hash on every hit.)
    pub fn get_with<Q, R>(&mut self, key: &Q, read: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if let Some(value) = self.current.get(key) {
            return Some(read(value));
        }
        let (key, value) = self.old.remove_entry(key)?;
        Some(read(self.insert(key, value)))
    }

    /// Adds an entry, starting a new generation when the current one is
    /// full; returns the value as stored (an entry already there is kept).
    pub fn insert(&mut self, key: K, value: V) -> &V {
        let bytes = (self.size)(&key, &value);
        if self.current.len() >= self.max_entries || self.current_bytes + bytes > self.max_bytes {
            self.old = std::mem::take(&mut self.current);
            self.current_bytes = 0;
        }
        self.current_bytes += bytes;
        self.current.entry(key).or_insert(value)
    }

    /// Entries held, both generations.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.current.len() + self.old.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_generation_becomes_old_and_the_one_before_is_dropped() {
        let mut cache: Generations<String, u32> = Generations::new(2, usize::MAX, |_, _| 1);
        cache.insert("a".into(), 1);
        cache.insert("b".into(), 2);
        // Full: a and b become old.
        cache.insert("c".into(), 3);
        assert_eq!(cache.len(), 3);
        assert_eq!(
            cache.get_with("a", |v| *v),
            Some(1),
            "old entries are still found"
        );
        // a moved back next to c; the current generation (c, a) is full now.
        cache.insert("d".into(), 4);
        // (c, a) became old and b, never used again, is gone.
        assert_eq!(cache.get_with("b", |v| *v), None);
        assert_eq!(cache.get_with("a", |v| *v), Some(1));
        assert_eq!(cache.get_with("d", |v| *v), Some(4));
    }

    #[test]
    fn the_byte_bound_starts_a_new_generation() {
        let mut cache: Generations<u32, u32> = Generations::new(100, 10, |_, _| 6);
        cache.insert(1, 1);
        cache.insert(2, 2);
        cache.insert(3, 3);
        // 1 was dropped with the first generation; 2 is old, 3 current.
        assert_eq!(cache.get_with(&1, |v| *v), None);
        assert_eq!(cache.get_with(&3, |v| *v), Some(3));
        assert_eq!(cache.get_with(&2, |v| *v), Some(2));
    }
}
