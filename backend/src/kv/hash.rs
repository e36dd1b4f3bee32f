//! Block hashes, compatible with NVIDIA Dynamo's KV router: a prompt is cut into
//! blocks of `block_size` tokens; a block's local hash is XXH3-64 (seed 1337) of
//! its token ids as u32 little-endian; its sequence hash chains the previous
//! block's sequence hash with its local hash, so equal hashes mean equal
//! prefixes. The gateway and the workers compute the same values.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed Dynamo uses for block hashes.
pub const SEED: u64 = 1337;

/// XXH3-64 of one block's token ids.
pub fn local_hash(tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, SEED)
}

/// The sequence hash of a block whose predecessor's sequence hash is `parent`.
pub fn chain(parent: u64, local: u64) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.to_le_bytes());
    bytes[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&bytes, SEED)
}

/// Sequence hashes of every full block of `tokens`. A non-zero `salt` (a
/// tenant's cache salt) is chained in front of the first block, so salted and
/// unsalted prompts never share blocks; with salt 0 the first block's sequence
/// hash is its local hash, as in Dynamo.
pub fn block_hashes(tokens: &[u32], block_size: usize, salt: u64) -> Vec<u64> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent: Option<u64> = (salt != 0).then_some(salt);
    for block in tokens.chunks_exact(block_size.max(1)) {
        let local = local_hash(block);
        let seq = match parent {
            None => local,
            Some(p) => chain(p, local),
        };
        hashes.push(seq);
        parent = Some(seq);
    }
    hashes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_so_equal_hashes_mean_equal_prefixes() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[20] = 999; // differs in block 1 (of 16)
        let (ha, hb) = (block_hashes(&a, 16, 0), block_hashes(&b, 16, 0));
        assert_eq!(ha.len(), 4);
        assert_eq!(ha[0], hb[0]);
        assert!(
            ha[1..].iter().zip(&hb[1..]).all(|(x, y)| x != y),
            "later blocks differ too"
        );
        assert_eq!(ha[0], local_hash(&a[..16]), "first block: its local hash");
        assert_eq!(ha[1], chain(ha[0], local_hash(&a[16..32])));
        assert_eq!(
            block_hashes(&a[..40], 16, 0),
            ha[..2].to_vec(),
            "partial block not hashed"
        );
    }

    #[test]
    fn a_salt_separates_tenants() {
        let t: Vec<u32> = (0..32).collect();
        let (plain, s1, s2) = (
            block_hashes(&t, 16, 0),
            block_hashes(&t, 16, 1),
            block_hashes(&t, 16, 2),
        );
        assert!(plain[0] != s1[0] && s1[0] != s2[0]);
    }

    #[test]
    fn local_hash_is_xxh3_of_little_endian_ids() {
        // Pinned so that a change of scheme is noticed (the gateway and workers
        // must agree, and so must Dynamo-compatible peers).
        let bytes: Vec<u8> = [1u32, 2, 3].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(local_hash(&[1, 2, 3]), xxh3_64_with_seed(&bytes, 1337));
    }
}
