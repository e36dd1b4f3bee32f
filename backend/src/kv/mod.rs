//! The paged KV cache: fixed-size blocks of K and V for every layer, addressed
//! through a sequence's block table.

mod storage;

pub use storage::KvStorage;
