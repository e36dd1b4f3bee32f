//! The paged KV cache: block hashes (Dynamo-compatible), the block allocator
//! with prefix reuse and eviction, and the storage of K and V.

pub mod hash;
mod pool;
mod storage;

pub use pool::{Allocation, BlockPool, EvictionCandidate, EvictionScorer, KvEvent, Lru, PoolUsage};
pub use storage::KvStorage;
