//! Where K and V live on the CPU: per layer, `n_blocks` blocks of `block_size`
//! token slots of `kv_dim` floats each. A sequence owns a block table (block ids
//! in position order); position `p` lives in block `table[p / block_size]`, slot
//! `p % block_size`.

#[derive(Debug)]
pub struct KvStorage {
    pub n_layers: usize,
    pub n_blocks: usize,
    pub block_size: usize,
    pub kv_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvStorage {
    pub fn new(n_layers: usize, n_blocks: usize, block_size: usize, kv_dim: usize) -> Self {
        let len = n_layers * n_blocks * block_size * kv_dim;
        Self {
            n_layers,
            n_blocks,
            block_size,
            kv_dim,
            k: vec![0.0; len],
            v: vec![0.0; len],
        }
    }

    /// Offset of (layer, position) for a sequence with `table`.
    fn at(&self, layer: usize, table: &[u32], pos: usize) -> usize {
        let block = table[pos / self.block_size] as usize;
        debug_assert!(block < self.n_blocks, "block {block} out of range");
        ((layer * self.n_blocks + block) * self.block_size + pos % self.block_size) * self.kv_dim
    }

    pub fn write(&mut self, layer: usize, table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let at = self.at(layer, table, pos);
        self.k[at..at + self.kv_dim].copy_from_slice(k);
        self.v[at..at + self.kv_dim].copy_from_slice(v);
    }

    /// K and V of one position.
    pub fn read(&self, layer: usize, table: &[u32], pos: usize) -> (&[f32], &[f32]) {
        let at = self.at(layer, table, pos);
        (&self.k[at..at + self.kv_dim], &self.v[at..at + self.kv_dim])
    }

    /// K and V of one block of one layer (`block_size * kv_dim` each).
    pub fn block(&self, layer: usize, block: u32) -> (&[f32], &[f32]) {
        let span = self.block_size * self.kv_dim;
        let at = (layer * self.n_blocks + block as usize) * span;
        (&self.k[at..at + span], &self.v[at..at + span])
    }

    pub fn block_mut(&mut self, layer: usize, block: u32) -> (&mut [f32], &mut [f32]) {
        let span = self.block_size * self.kv_dim;
        let at = (layer * self.n_blocks + block as usize) * span;
        (&mut self.k[at..at + span], &mut self.v[at..at + span])
    }

    /// Copies block `from` into block `to` in every layer (copy-on-write of a
    /// shared partial block).
    pub fn copy_block(&mut self, from: u32, to: u32) {
        let span = self.block_size * self.kv_dim;
        for layer in 0..self.n_layers {
            let src = (layer * self.n_blocks + from as usize) * span;
            let dst = (layer * self.n_blocks + to as usize) * span;
            self.k.copy_within(src..src + span, dst);
            self.v.copy_within(src..src + span, dst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_follow_the_block_table() {
        let mut s = KvStorage::new(2, 4, 2, 3);
        let table = [3, 1]; // positions 0-1 in block 3, 2-3 in block 1
        for pos in 0..4 {
            let x = pos as f32;
            s.write(1, &table, pos, &[x; 3], &[-x; 3]);
        }
        assert_eq!(s.read(1, &table, 2), (&[2.0; 3][..], &[-2.0; 3][..]));
        assert_eq!(s.read(0, &table, 2).0, &[0.0; 3], "layers are separate");
        // Another table over the same blocks sees the same data.
        assert_eq!(s.read(1, &[1], 1).0, &[3.0; 3]);
        s.copy_block(3, 0);
        assert_eq!(s.read(1, &[0], 1).0, &[1.0; 3]);
    }
}
