//! A step's batch laid out for the kernels, on the host: every token's id,
//! position and KV slot, the chunks' block tables, the attention work items
//! (decode tokens; prefill runs of query tokens), the decode split, the rows
//! whose logits are wanted; and their upload, in one copy, to the device.

use cudarc::driver::CudaSlice;

use super::device::{DevPtr, Gpu, GpuError};
use super::model::Numerics;
use crate::model::{Logits, SeqChunk};

/// Query heads per KV head the decode kernels take (more go through the
/// prefill kernel).
pub(crate) const DECODE_GROUP_MAX: usize = 8;
/// Rows (query tokens x query heads of a KV head) of one prefill block.
pub(crate) const PREFILL_ROWS: usize = 64;
/// Keys of one attention tile, the unit of a decode split.
pub(crate) const KEY_TILE: usize = 64;
/// Keys of one decode split under `SplitPolicy::Fixed`: fixed, so that a
/// sequence's attention is summed in the same order whatever else is in the
/// batch (batch invariance).
pub(crate) const KEYS_PER_SPLIT: usize = 256;
/// Most splits of a decode launch that merge inside one thread block cluster
/// (`attention_decode_cluster_*`; MAX_CLUSTER_SPLITS in attention.cu).
pub(crate) const MAX_CLUSTER_SPLITS: usize = 16;

/// Where each index array of a step landed on the device.
pub(crate) struct MetaPtrs {
    /// Keys per split of the decode launch, and of prefill launches (all).
    pub decode_keys_per_split: DevPtr,
    pub prefill_keys_per_split: DevPtr,
    pub tokens: DevPtr,
    pub positions: DevPtr,
    pub slots: DevPtr,
    pub tables: DevPtr,
    pub decode_items: DevPtr,
    pub decode_rows: DevPtr,
    pub prefill_items: DevPtr,
    pub logit_rows: DevPtr,
    /// The buffer was reallocated (addresses captured in graphs are stale).
    pub grown: bool,
}

/// Where decode attention splits a sequence's keys across blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SplitPolicy {
    /// Every KEYS_PER_SPLIT keys (batch-invariant).
    Fixed,
    /// Into as many splits as fill the GPU for this batch; with
    /// `cluster_splits` (0 for none), a sequence of at most twice that many
    /// tiles into at most that many splits, which merge in one cluster.
    FillGpu {
        sm_count: u32,
        n_kv_heads: usize,
        cluster_splits: usize,
    },
}

impl SplitPolicy {
    /// The policy of `numerics` on `gpu`, for a model of `n_kv_heads`.
    pub(crate) fn for_numerics(numerics: Numerics, gpu: &Gpu, n_kv_heads: usize) -> SplitPolicy {
        match numerics {
            Numerics::BatchInvariant => SplitPolicy::Fixed,
            Numerics::Fast => SplitPolicy::FillGpu {
                sm_count: gpu.sm_count,
                n_kv_heads,
                cluster_splits: if gpu.has_clusters() {
                    MAX_CLUSTER_SPLITS
                } else {
                    0
                },
            },
        }
    }
}

/// Whether a step of `decode_rows` decode tokens merges its splits in
/// clusters of up to `cluster_splits`: one token only. At batch 8 (5 splits
/// a sequence either way) the cluster kernel cost the 8B MXFP4 model 11% of
/// its tokens/s (1,973-1,983 against 2,229-2,246 with the combine) and BF16
/// nothing; at batch 1 it gains BF16 0.4-0.9 points (BENCHMARKS.md).
fn in_clusters(cluster_splits: usize, decode_rows: usize) -> bool {
    cluster_splits > 1 && decode_rows == 1
}

/// A step's batch, laid out for the kernels (host side).
#[derive(Debug, Default, PartialEq)]
pub(crate) struct StepPlan {
    pub tokens: Vec<i32>,
    pub positions: Vec<i32>,
    /// KV cache slot of each token: block * block_size + position % block_size.
    pub slots: Vec<i32>,
    /// One row of `max_blocks` block ids per chunk.
    pub tables: Vec<i32>,
    pub max_blocks: usize,
    pub block_size: usize,
    /// {seq, q_row, n_q, q_pos} per item.
    pub decode_items: Vec<i32>,
    pub decode_rows: Vec<i32>,
    pub prefill_items: Vec<i32>,
    pub decode_splits: usize,
    pub decode_keys_per_split: usize,
    /// The decode splits merge inside thread block clusters (FillGpu with
    /// `cluster_splits`, 2 to that many splits) rather than in
    /// `attention_combine`.
    pub decode_in_clusters: bool,
    /// Token rows whose logits are wanted, in chunk order.
    pub logit_rows: Vec<i32>,
    pub logits_per_chunk: Vec<usize>,
}

impl StepPlan {
    pub(crate) fn new(
        chunks: &[SeqChunk<'_>],
        block_size: usize,
        group: usize,
        splits: SplitPolicy,
    ) -> StepPlan {
        // Table rows padded to a power of two (at least 16), so that steps
        // of one batch size share a layout (and a CUDA graph) for long.
        let longest_table = chunks
            .iter()
            .map(|c| c.block_table.len())
            .max()
            .unwrap_or(0);
        let mut p = StepPlan {
            block_size,
            max_blocks: longest_table.max(16).next_power_of_two(),
            ..StepPlan::default()
        };
        let prefill_tokens = (PREFILL_ROWS / group).max(1);
        let mut longest_decode = 0;
        for (ci, ch) in chunks.iter().enumerate() {
            let first_row = p.tokens.len();
            for (i, &t) in ch.tokens.iter().enumerate() {
                let pos = ch.start + i;
                p.tokens.push(t as i32);
                p.positions.push(pos as i32);
                let block = ch.block_table[pos / block_size] as usize;
                p.slots.push((block * block_size + pos % block_size) as i32);
            }
            p.tables.extend(ch.block_table.iter().map(|&b| b as i32));
            p.tables
                .extend(std::iter::repeat_n(0, p.max_blocks - ch.block_table.len()));
            let len = ch.tokens.len();
            if len == 1 && group <= DECODE_GROUP_MAX {
                p.decode_items
                    .extend([ci as i32, first_row as i32, 1, ch.start as i32]);
                p.decode_rows.push(first_row as i32);
                longest_decode = longest_decode.max(ch.start + 1);
            } else {
                for from in (0..len).step_by(prefill_tokens) {
                    let n_q = prefill_tokens.min(len - from);
                    p.prefill_items.extend([
                        ci as i32,
                        (first_row + from) as i32,
                        n_q as i32,
                        (ch.start + from) as i32,
                    ]);
                }
            }
            let rows = match ch.logits {
                Logits::None => first_row + len..first_row + len,
                Logits::Last => first_row + len.saturating_sub(1)..first_row + len,
                Logits::All => first_row..first_row + len,
            };
            p.logits_per_chunk.push(rows.len());
            p.logit_rows.extend(rows.map(|r| r as i32));
        }
        // Flash-decoding. The kernels read the split size from device memory;
        // the count is the longest sequence's (shorter ones' last splits find
        // no keys). It used to be rounded up to a power of two, so that a
        // graph's shape changed less often, but the empty splits cost blocks
        // and combine reads every step (1,025 keys: 8 splits of 256 launched
        // for 5); the workspace rounds its room up instead.
        let tiles = longest_decode.max(1).div_ceil(KEY_TILE);
        let per_split_tiles = match splits {
            // Fixed points: the same sums whatever the batch.
            SplitPolicy::Fixed => KEYS_PER_SPLIT / KEY_TILE,
            // Enough blocks to fill the GPU twice over.
            SplitPolicy::FillGpu {
                sm_count,
                n_kv_heads,
                cluster_splits,
            } => {
                let blocks = (p.decode_rows.len() * n_kv_heads).max(1);
                let mut wanted = (2 * sm_count as usize).div_ceil(blocks).clamp(1, 32);
                // A short sequence alone: two tiles a block and no combine
                // launch beat one tile a block and a combine (1,088 keys at
                // batch 1 on the H200: 9 splits in clusters against 17 and
                // a combine; BENCHMARKS.md).
                if in_clusters(cluster_splits, p.decode_rows.len()) && tiles <= 2 * cluster_splits {
                    wanted = wanted.min(cluster_splits);
                }
                tiles.div_ceil(wanted)
            }
        };
        p.decode_keys_per_split = per_split_tiles * KEY_TILE;
        p.decode_splits = tiles.div_ceil(per_split_tiles);
        p.decode_in_clusters = matches!(splits, SplitPolicy::FillGpu { cluster_splits, .. }
            if in_clusters(cluster_splits, p.decode_rows.len())
                && (2..=cluster_splits).contains(&p.decode_splits));
        p
    }

    /// Copies every index array to the device in one transfer.
    pub(crate) fn upload(
        &self,
        gpu: &Gpu,
        meta: &mut CudaSlice<i32>,
    ) -> Result<MetaPtrs, GpuError> {
        let params = [self.decode_keys_per_split as i32, i32::MAX, 0, 0];
        let parts: [&[i32]; 9] = [
            &params,
            &self.tokens,
            &self.positions,
            &self.slots,
            &self.tables,
            &self.decode_items,
            &self.decode_rows,
            &self.prefill_items,
            &self.logit_rows,
        ];
        let mut all = Vec::with_capacity(parts.iter().map(|p| p.len() + 4).sum());
        let mut offsets = [0usize; 9];
        for (i, part) in parts.iter().enumerate() {
            offsets[i] = all.len();
            all.extend_from_slice(part);
            // Keep each array 16-byte aligned.
            all.resize(all.len().next_multiple_of(4), 0);
        }
        let mut grown = false;
        if all.len() > meta.len() {
            *meta = gpu.alloc(all.len().next_power_of_two())?;
            grown = true;
        }
        gpu.upload_into(&all, meta)?;
        let at = |i: usize| gpu.ptr(meta, offsets[i]);
        Ok(MetaPtrs {
            decode_keys_per_split: at(0),
            prefill_keys_per_split: at(0) + 4,
            tokens: at(1),
            positions: at(2),
            slots: at(3),
            tables: at(4),
            decode_items: at(5),
            decode_rows: at(6),
            prefill_items: at(7),
            logit_rows: at(8),
            grown,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_lays_out_a_mixed_batch() {
        // A 3-token prefill chunk at position 4 and a decode token at 20.
        let (t1, t2) = ([7u32, 8, 9], [5u32]);
        let chunks = [
            SeqChunk {
                tokens: &t1,
                start: 4,
                block_table: &[3, 1],
                logits: Logits::Last,
            },
            SeqChunk {
                tokens: &t2,
                start: 20,
                block_table: &[0, 2],
                logits: Logits::Last,
            },
        ];
        let p = StepPlan::new(&chunks, 16, 3, SplitPolicy::Fixed);
        assert_eq!(p.tokens, [7, 8, 9, 5]);
        assert_eq!(p.positions, [4, 5, 6, 20]);
        assert_eq!(p.slots, [3 * 16 + 4, 3 * 16 + 5, 3 * 16 + 6, 2 * 16 + 4]);
        // Table rows padded to 16 entries.
        assert_eq!(p.max_blocks, 16);
        assert_eq!(
            (&p.tables[..2], &p.tables[16..18]),
            (&[3, 1][..], &[0, 2][..])
        );
        assert_eq!(p.prefill_items, [0, 0, 3, 4]);
        assert_eq!(p.decode_items, [1, 3, 1, 20]);
        assert_eq!(p.decode_rows, [3]);
        assert_eq!(p.logit_rows, [2, 3]);
        assert_eq!(p.logits_per_chunk, [1, 1]);
        // 21 keys: one split.
        assert_eq!((p.decode_splits, p.decode_keys_per_split), (1, 256));
    }

    #[test]
    fn long_decodes_split_across_blocks_and_prefill_runs_in_tiles() {
        let tokens: Vec<u32> = (0..50).collect();
        let table: Vec<u32> = (0..64).collect();
        let chunks = [
            SeqChunk {
                tokens: &tokens,
                start: 0,
                block_table: &table,
                logits: Logits::All,
            },
            SeqChunk {
                tokens: &[1],
                start: 1000,
                block_table: &table,
                logits: Logits::None,
            },
        ];
        let p = StepPlan::new(&chunks, 16, 4, SplitPolicy::Fixed);
        // 16 query tokens per prefill item (64 rows / 4 heads per KV head).
        assert_eq!(p.prefill_items.len() / 4, 4);
        assert_eq!(&p.prefill_items[12..], [0, 48, 2, 48]);
        // 1001 keys: 4 splits of 256.
        assert_eq!((p.decode_splits, p.decode_keys_per_split), (4, 256));
        assert_eq!(p.logit_rows.len(), 50);
        assert_eq!(p.logits_per_chunk, [50, 0]);
        // The split does not depend on the batch (batch invariance).
        let many: Vec<SeqChunk<'_>> = (0..64).map(|_| chunks[1]).collect();
        let p = StepPlan::new(&many, 16, 4, SplitPolicy::Fixed);
        assert_eq!((p.decode_splits, p.decode_keys_per_split), (4, 256));
        let shorter = [SeqChunk {
            start: 600,
            ..chunks[1]
        }];
        let p = StepPlan::new(&shorter, 16, 4, SplitPolicy::Fixed);
        assert_eq!(p.decode_splits, 3);
        // Filling the GPU instead: one sequence over 8 KV heads takes 16
        // splits of one tile (1,001 keys: 16 tiles); 64 sequences need no
        // split.
        let fill = SplitPolicy::FillGpu {
            sm_count: 132,
            n_kv_heads: 8,
            cluster_splits: 0,
        };
        let p = StepPlan::new(&chunks, 16, 4, fill);
        assert_eq!((p.decode_splits, p.decode_keys_per_split), (16, 64));
        let p = StepPlan::new(&many, 16, 4, fill);
        assert_eq!((p.decode_splits, p.decode_keys_per_split), (1, 1024));
        // 1,089 keys (18 tiles): 18 splits of one tile, or, where splits
        // merge in clusters of 16, 9 of two; 2,113 keys (34 tiles) are past
        // the clusters' reach and keep 32-way splits (of two tiles).
        let long_table: Vec<u32> = (0..160).collect();
        let longer = |start| {
            [SeqChunk {
                start,
                block_table: &long_table,
                ..chunks[1]
            }]
        };
        let clustered = SplitPolicy::FillGpu {
            sm_count: 132,
            n_kv_heads: 8,
            cluster_splits: MAX_CLUSTER_SPLITS,
        };
        let split = |p: StepPlan| {
            (
                p.decode_splits,
                p.decode_keys_per_split,
                p.decode_in_clusters,
            )
        };
        assert_eq!(
            split(StepPlan::new(&longer(1088), 16, 4, fill)),
            (18, 64, false)
        );
        assert_eq!(
            split(StepPlan::new(&longer(1088), 16, 4, clustered)),
            (9, 128, true)
        );
        assert_eq!(
            split(StepPlan::new(&longer(2112), 16, 4, clustered)),
            (17, 128, false)
        );
        assert_eq!(
            split(StepPlan::new(&chunks, 16, 4, clustered)),
            (16, 64, true)
        );
        assert_eq!(
            split(StepPlan::new(&many, 16, 4, clustered)),
            (1, 1024, false)
        );
        // More than one decode token: the combine, whatever the split.
        let eight: Vec<SeqChunk<'_>> = (0..8).map(|_| longer(1088)[0]).collect();
        assert_eq!(
            split(StepPlan::new(&eight, 16, 4, clustered)),
            (5, 256, false)
        );
    }
}
