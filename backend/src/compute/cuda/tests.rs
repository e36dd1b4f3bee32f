//! Each CUDA kernel against the CPU reference on the same inputs, on the
//! device. Skipped (with a line on stderr) where there is no GPU.
//!
//! Tolerances: a kernel that writes BF16 is allowed one BF16 rounding of the
//! f32 reference (relative 2^-8, plus a small absolute term for values near 0);
//! attention, which reads BF16 K and V and writes BF16, is held to 1e-2
//! absolute on outputs of magnitude about 1.

use std::sync::Arc;

use half::bf16;

use super::device::Gpu;
use super::layers;
use super::model::{CudaKvCache, Numerics, Workspace, launch_attention};
use super::plan::{SplitPolicy, StepPlan};
use crate::compute::cpu::{Matrix, Weight, dot, rms_norm, rope, rope_table, silu, softmax};
use crate::model::{LlamaConfig, Logits, SeqChunk};

fn gpu() -> Option<Arc<Gpu>> {
    if !super::cuda_available() {
        eprintln!("skipped: no CUDA GPU");
        return None;
    }
    Some(Gpu::open(0).expect("open GPU 0"))
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn to_bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
}

fn from_bf16(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&b| bf16::from_bits(b).to_f32()).collect()
}

/// Within one BF16 rounding of `want`.
fn assert_bf16_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = w.abs() / 256.0 + 1e-6;
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn dequantization_matches_the_cpu_rows() {
    let Some(gpu) = gpu() else { return };
    let (rows, cols) = (8, 64);
    // Q4_1 blocks: f16 scale, f16 min, 16 bytes; Q8_0: f16 scale, 32 bytes.
    let mut q4 = Vec::new();
    let mut q8 = Vec::new();
    for b in 0..rows * cols / 32 {
        q4.extend(half::f16::from_f32(0.01 * (b as f32 + 1.0)).to_le_bytes());
        q4.extend(half::f16::from_f32(-0.05 * b as f32).to_le_bytes());
        q4.extend((0..16).map(|j| (b * 16 + j * 7) as u8));
        q8.extend(half::f16::from_f32(0.003 * (b as f32 + 1.0)).to_le_bytes());
        q8.extend((0..32).map(|j| (b as i32 * 5 + j * 11 - 128) as u8));
    }
    // Also with an RMSNorm's weights folded into the columns.
    let g: Vec<f32> = values(cols, 3).iter().map(|v| 1.0 + 0.5 * v).collect();
    let dg = gpu.upload(&g).expect("upload");
    let rows_f32 = |w: &Weight| -> Vec<f32> { (0..rows).flat_map(|r| w.row_f32(r)).collect() };
    let f32_weight = Weight::F32(Matrix {
        rows,
        cols,
        data: values(rows * cols, 4),
    });
    let blocks = |bytes: &[u8], q4_1| Weight::from_blocks(rows, cols, q4_1, bytes).expect("blocks");
    for (w, what) in [
        (blocks(&q4, true), "q4_1"),
        (blocks(&q8, false), "q8_0"),
        (f32_weight, "f32"),
    ] {
        for folded in [false, true] {
            let out = gpu.alloc::<u16>(rows * cols).expect("alloc");
            let scale = if folded { gpu.ptr(&dg, 0) } else { 0 };
            super::model::put_weight_for_test(&gpu, &w, gpu.ptr(&out, 0), scale);
            let got = from_bf16(&gpu.download(&out, rows * cols).expect("download"));
            let mut want = rows_f32(&w);
            if folded {
                for (i, v) in want.iter_mut().enumerate() {
                    *v *= g[i % cols];
                }
            }
            assert_bf16_close(&got, &want, &format!("{what}, folded {folded}"));
        }
    }
}

#[test]
fn rms_norm_silu_and_argmax_match_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let n = 5;
    // 576: SmolLM2's hidden, a part of one float4 a thread; 8,200: three
    // float4s a thread, the last part-filled.
    for h in [576, 8200] {
        let x = values(n * h, 1);
        let w = values(h, 2);
        let (dx, dw) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap());
        let out = gpu.alloc::<u16>(n * h).unwrap();
        // Rows 4 and 1 only, through the row list.
        let rows = gpu.upload(&[4i32, 1]).unwrap();
        let eps = 1e-5f32;
        layers::rms_norm(
            &gpu,
            gpu.ptr(&dx, 0),
            gpu.ptr(&rows, 0),
            gpu.ptr(&dw, 0),
            gpu.ptr(&out, 0),
            2,
            h,
            eps,
        )
        .unwrap();
        let got = from_bf16(&gpu.download(&out, 2 * h).unwrap());
        let mut want = rms_norm(&x[4 * h..5 * h], &w, eps);
        want.extend(rms_norm(&x[h..2 * h], &w, eps));
        assert_bf16_close(&got, &want, "rms_norm");
    }

    let ffn = 300;
    let gate_up: Vec<f32> = values(n * 2 * ffn, 3).iter().map(|v| v * 6.0).collect();
    let dg = gpu.upload(&gate_up).unwrap();
    let act = gpu.alloc::<u16>(n * ffn).unwrap();
    // [gate | up], and gate and up in alternate runs of 4 (FP4's order).
    for run in [0, 4] {
        layers::silu_mul(&gpu, gpu.ptr(&dg, 0), gpu.ptr(&act, 0), n, ffn, run).unwrap();
        let got = from_bf16(&gpu.download(&act, n * ffn).unwrap());
        let want: Vec<f32> = (0..n * ffn)
            .map(|i| {
                let (row, j) = (&gate_up[i / ffn * 2 * ffn..], i % ffn);
                match run {
                    0 => silu(row[j]) * row[ffn + j],
                    _ => {
                        silu(row[j / run * 2 * run + j % run])
                            * row[j / run * 2 * run + run + j % run]
                    }
                }
            })
            .collect();
        assert_bf16_close(&got, &want, &format!("silu_mul, runs of {run}"));
    }

    let vocab = 49_152;
    let mut logits = values(3 * vocab, 4);
    logits[vocab + 777] = 5.0;
    logits[vocab + 40_000] = 5.0; // a tie: the lower index wins
    logits[2 * vocab + 49_151] = 9.0;
    let dl = gpu.upload(&logits).unwrap();
    let picked = gpu.alloc::<i32>(3).unwrap();
    layers::argmax_rows(&gpu, gpu.ptr(&dl, 0), gpu.ptr(&picked, 0), 3, vocab).unwrap();
    let want0 = (0..vocab).fold(0, |best, i| if logits[i] > logits[best] { i } else { best });
    assert_eq!(
        gpu.download(&picked, 3).unwrap(),
        [want0 as i32, 777, 49_151]
    );
}

#[test]
fn gemv_and_the_tiled_gemm_match_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let (rows, cols) = (100, 264);
    let tile = super::device::GEMM_ROW_TILE;
    let w = from_bf16(&to_bf16(&values(rows * cols, 21)));
    let dw = gpu.upload(&to_bf16(&w)).unwrap();
    for n in [1usize, 3, 8, 12, 130] {
        // Buffers of whole tiles of rows, as the workspace has.
        let padded = n.next_multiple_of(tile);
        let x = from_bf16(&to_bf16(&values(padded * cols, 22 + n as u64)));
        let dx = gpu.upload(&to_bf16(&x)).unwrap();
        let start = values(padded * rows, 30);
        let expected: Vec<f32> = (0..n * rows)
            .map(|i| {
                let (j, r) = (i / rows, i % rows);
                start[i] + dot(&w[r * cols..(r + 1) * cols], &x[j * cols..(j + 1) * cols])
            })
            .collect();
        let check = |got: &[f32], what: &str| {
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    (g - e).abs() <= 1e-3 * e.abs().max(1.0),
                    "{what} n={n} [{i}]: {g} vs {e}"
                );
            }
        };
        // Accumulate onto `start`: y = start + x . w^T.
        let y = gpu.upload(&start).unwrap();
        gpu.gemm_bf16(
            gpu.ptr(&dw, 0),
            gpu.ptr(&dx, 0),
            gpu.ptr(&y, 0),
            n,
            rows,
            cols,
            true,
        )
        .unwrap();
        let tiled = gpu.download(&y, n * rows).unwrap();
        check(&tiled, "cuBLAS");
        if n <= 8 {
            let y = gpu.upload(&start).unwrap();
            gpu.gemv_bf16(
                gpu.ptr(&dw, 0),
                gpu.ptr(&dx, 0),
                gpu.ptr(&y, 0),
                n,
                rows,
                cols,
                true,
            )
            .unwrap();
            check(&gpu.download(&y, n * rows).unwrap(), "GEMV");
        }
        // Batch invariance: token 0 beside other tokens gives the bits it
        // gave in the batch.
        let mut other = from_bf16(&to_bf16(&values(tile * cols, 99)));
        other[..cols].copy_from_slice(&x[..cols]);
        let dother = gpu.upload(&to_bf16(&other)).unwrap();
        let y1 = gpu.upload(&start).unwrap();
        gpu.gemm_bf16(
            gpu.ptr(&dw, 0),
            gpu.ptr(&dother, 0),
            gpu.ptr(&y1, 0),
            1,
            rows,
            cols,
            true,
        )
        .unwrap();
        assert_eq!(
            gpu.download(&y1, rows).unwrap(),
            tiled[..rows],
            "n={n}: row 0 alone"
        );
    }
}

fn tiny_config(head_dim: usize, n_heads: usize, n_kv_heads: usize) -> LlamaConfig {
    LlamaConfig {
        n_layers: 1,
        hidden: n_heads * head_dim,
        ffn: 64,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab: 32,
        context: 4096,
        rope_theta: 10_000.0,
        rms_eps: 1e-5,
    }
}

#[test]
fn rope_and_the_cache_write_match_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let c = tiny_config(64, 6, 2);
    let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
    let block_size = 16;
    let kv = CudaKvCache::new(&gpu, &c, 8, block_size).unwrap();
    let positions_used = [0i32, 17, 40];
    let table = [5u32, 2, 7];
    let slots: Vec<i32> = positions_used
        .iter()
        .map(|&p| {
            (table[p as usize / block_size] as usize * block_size + p as usize % block_size) as i32
        })
        .collect();
    let n = positions_used.len();
    let qkv = values(n * (q_dim + 2 * kv_dim), 5);
    let (dqkv, dpos, dslots) = (
        gpu.upload(&qkv).unwrap(),
        gpu.upload(&positions_used).unwrap(),
        gpu.upload(&slots).unwrap(),
    );
    let q_out = gpu.alloc::<u16>(n * q_dim).unwrap();
    let (k_cache, v_cache) = kv.layer(&gpu, 0);
    layers::rope_store_kv(
        &gpu,
        &c,
        gpu.ptr(&dqkv, 0),
        gpu.ptr(&dpos, 0),
        gpu.ptr(&dslots, 0),
        gpu.ptr(&q_out, 0),
        k_cache,
        v_cache,
        n,
    )
    .unwrap();
    let got_q = from_bf16(&gpu.download(&q_out, n * q_dim).unwrap());
    let (k_all, v_all) = kv.read_layer(&gpu, 0).unwrap();
    let width = q_dim + 2 * kv_dim;
    for (t, &pos) in positions_used.iter().enumerate() {
        let row = &qkv[t * width..(t + 1) * width];
        let table_cos_sin = rope_table(pos as usize, c.head_dim, c.rope_theta);
        let mut q = row[..q_dim].to_vec();
        let mut k = row[q_dim..q_dim + kv_dim].to_vec();
        rope(&mut q, c.head_dim, &table_cos_sin);
        rope(&mut k, c.head_dim, &table_cos_sin);
        assert_bf16_close(&got_q[t * q_dim..(t + 1) * q_dim], &q, "q");
        let at = slots[t] as usize * kv_dim;
        assert_bf16_close(&k_all[at..at + kv_dim], &k, "k");
        assert_bf16_close(&v_all[at..at + kv_dim], &row[q_dim + kv_dim..], "v");
    }
}

/// What the one-token fused input projections wrote: Q, the layer's K and V
/// caches, and SwiGLU's output.
struct FusedOutputs {
    q: Vec<u16>,
    kv: (Vec<f32>, Vec<f32>),
    act: Vec<u16>,
}

/// A fused one-token kernel set's outputs (`fused`) against the separate
/// kernels' (`separate`), each called with a residual x and norm weights g:
/// the same bits where x = +-2 (1 / rms = 0.5 exactly, eps 0) and g is a
/// power of two; for any x and g, within a few BF16 roundings (1/64) of the
/// largest value. K and V must have been written at `kv_at`.
fn assert_fused_equals_separate(
    hidden: usize,
    kv_at: std::ops::Range<usize>,
    what: &str,
    separate: impl Fn(&[f32], &[f32]) -> FusedOutputs,
    fused: impl Fn(&[f32], &[f32]) -> FusedOutputs,
) {
    let twos: Vec<f32> = values(hidden, 41)
        .iter()
        .map(|v| if *v < 0.0 { -2.0 } else { 2.0 })
        .collect();
    let powers_of_two: Vec<f32> = (0..hidden).map(|i| [0.5, 1.0, 2.0][i % 3]).collect();
    let (a, b) = (
        separate(&twos, &powers_of_two),
        fused(&twos, &powers_of_two),
    );
    assert_eq!(b.q, a.q, "{what}: q");
    assert_eq!(b.kv, a.kv, "{what}: the caches");
    // Written: the caches start as zeros. (Not every value: with x = +-2 a
    // sum over 2,048 columns can come out exactly 0.)
    let mostly_nonzero = |v: &[f32]| v.iter().filter(|v| **v == 0.0).count() * 16 <= v.len();
    assert!(
        mostly_nonzero(&a.kv.0[kv_at.clone()]),
        "{what}: K was written"
    );
    assert!(mostly_nonzero(&a.kv.1[kv_at]), "{what}: V was written");
    assert_eq!(b.act, a.act, "{what}: act");
    assert!(a.act.iter().any(|&v| v != 0), "{what}: act was written");

    let x = from_bf16(&to_bf16(&values(hidden, 45)));
    let g: Vec<f32> = values(hidden, 42).iter().map(|v| 1.0 + 0.5 * v).collect();
    let (a, b) = (separate(&x, &g), fused(&x, &g));
    let close = |got: &[f32], want: &[f32], part: &str| {
        let most = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= most / 64.0,
                "{what}: {part}[{i}]: {g} vs {w}"
            );
        }
    };
    close(&from_bf16(&b.q), &from_bf16(&a.q), "q");
    close(&b.kv.0, &a.kv.0, "k");
    close(&b.kv.1, &a.kv.1, "v");
    close(&from_bf16(&b.act), &from_bf16(&a.act), "act");
}

/// The one-token fused GEMVs (RMSNorm, then QKV with RoPE and the KV write,
/// or gate/up with SwiGLU; the norm's weights g folded into the weights'
/// columns) against the separate kernels they stand for (g applied by
/// `rms_norm`, the weights unfolded), which the tests above hold to the CPU.
/// Where x / rms(x) is exact in BF16 (x = +-2, so 1 / rms = 0.5 exactly with
/// eps 0) and g is a power of two (so that bf16(W g) = bf16(W) g) the two
/// give the same bits: each product twice the other's, summed in the same
/// order, then halved. Elsewhere they differ only in where BF16 rounds.
#[test]
fn fused_one_token_gemvs_equal_the_separate_kernels() {
    let Some(gpu) = gpu() else { return };
    // 384: less than one 1,024-column step a block; 5,000: two rounds of
    // loads, the last part-filled.
    for hidden in [384, 5000] {
        let c = LlamaConfig {
            hidden,
            ffn: 300,
            rms_eps: 0.0,
            ..tiny_config(64, 6, 2)
        };
        let (q_dim, kv_dim, ffn) = (c.q_dim(), c.kv_dim(), c.ffn);
        let qkv_rows = q_dim + 2 * kv_dim;
        let block_size = 16;
        let (pos, slot) = (37i32, 5 * block_size as i32 + 37 % block_size as i32);
        let w_qkv = from_bf16(&to_bf16(&values(qkv_rows * hidden, 43)));
        let w_gate_up = from_bf16(&to_bf16(&values(2 * ffn * hidden, 44)));
        let (dpos, dslot) = (gpu.upload(&[pos]).unwrap(), gpu.upload(&[slot]).unwrap());
        let (pos_p, slot_p) = (gpu.ptr(&dpos, 0), gpu.ptr(&dslot, 0));

        // The separate kernels on the f32 residual `x`, norm weights `g`.
        let separate = |x: &[f32], g: &[f32]| {
            let (dx, dg) = (gpu.upload(x).unwrap(), gpu.upload(g).unwrap());
            let xn = gpu.alloc::<u16>(hidden).unwrap();
            let xn_p = gpu.ptr(&xn, 0);
            layers::rms_norm(
                &gpu,
                gpu.ptr(&dx, 0),
                0,
                gpu.ptr(&dg, 0),
                xn_p,
                1,
                hidden,
                c.rms_eps,
            )
            .unwrap();
            let dw = gpu.upload(&to_bf16(&w_qkv)).unwrap();
            let qkv = gpu.alloc::<f32>(qkv_rows).unwrap();
            let qkv_p = gpu.ptr(&qkv, 0);
            gpu.gemv_bf16(gpu.ptr(&dw, 0), xn_p, qkv_p, 1, qkv_rows, hidden, false)
                .unwrap();
            let kv = CudaKvCache::new(&gpu, &c, 8, block_size).unwrap();
            let (k, v) = kv.layer(&gpu, 0);
            let q = gpu.alloc::<u16>(q_dim).unwrap();
            layers::rope_store_kv(&gpu, &c, qkv_p, pos_p, slot_p, gpu.ptr(&q, 0), k, v, 1).unwrap();
            let dw = gpu.upload(&to_bf16(&w_gate_up)).unwrap();
            let gate_up = gpu.alloc::<f32>(2 * ffn).unwrap();
            let gate_up_p = gpu.ptr(&gate_up, 0);
            gpu.gemv_bf16(gpu.ptr(&dw, 0), xn_p, gate_up_p, 1, 2 * ffn, hidden, false)
                .unwrap();
            let act = gpu.alloc::<u16>(ffn).unwrap();
            layers::silu_mul(&gpu, gate_up_p, gpu.ptr(&act, 0), 1, ffn, 0).unwrap();
            FusedOutputs {
                q: gpu.download(&q, q_dim).unwrap(),
                kv: kv.read_layer(&gpu, 0).unwrap(),
                act: gpu.download(&act, ffn).unwrap(),
            }
        };
        // The fused kernels on bf16(x) (x is BF16 here), g folded into the
        // weights' columns as the model does at load.
        let fused = |x: &[f32], g: &[f32]| {
            let fold = |w: &[f32]| {
                let folded: Vec<f32> = w
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * g[i % hidden])
                    .collect();
                gpu.upload(&to_bf16(&folded)).unwrap()
            };
            let (dqkv, dgate_up) = (fold(&w_qkv), fold(&w_gate_up));
            let dx = gpu.upload(&to_bf16(x)).unwrap();
            let x_p = gpu.ptr(&dx, 0);
            let kv = CudaKvCache::new(&gpu, &c, 8, block_size).unwrap();
            let (k, v) = kv.layer(&gpu, 0);
            let q = gpu.alloc::<u16>(q_dim).unwrap();
            layers::gemv_norm_rope(
                &gpu,
                &c,
                gpu.ptr(&dqkv, 0),
                x_p,
                pos_p,
                slot_p,
                gpu.ptr(&q, 0),
                k,
                v,
            )
            .unwrap();
            let act = gpu.alloc::<u16>(ffn).unwrap();
            layers::gemv_norm_swiglu(&gpu, &c, gpu.ptr(&dgate_up, 0), x_p, gpu.ptr(&act, 0))
                .unwrap();
            FusedOutputs {
                q: gpu.download(&q, q_dim).unwrap(),
                kv: kv.read_layer(&gpu, 0).unwrap(),
                act: gpu.download(&act, ffn).unwrap(),
            }
        };

        let at = slot as usize * kv_dim..(slot as usize + 1) * kv_dim;
        assert_fused_equals_separate(hidden, at, &format!("hidden {hidden}"), separate, fused);
    }
}

/// Sums of squares of `x` by 16 elements (what the fused FP4 GEMVs' RMS
/// reads).
fn sumsq_tiles(x: &[f32]) -> Vec<f32> {
    x.chunks(16)
        .map(|c| c.iter().map(|v| v * v).sum())
        .collect()
}

/// The FP4 one-token fused GEMVs (`fp4.cu`, FP4_NORM_ROPE and kin) against
/// the separate kernels they stand for: RMSNorm with weights g, the FP4
/// GEMV, RoPE with the KV write or SwiGLU; and the output projection's form
/// against the GEMV with accumulate. The fused input projections take x g
/// as BF16 and the f32 residual's sums of squares by 16 elements, which the
/// output projection's form writes. Where x = +-2 (1 / rms = 0.5 exactly,
/// eps 0) and g is a power of two, both multiply the same codes by x g / 2
/// and x g summed in the same order, so they give the same bits; elsewhere
/// they differ in where BF16 rounds.
#[test]
fn fused_fp4_one_token_gemvs_equal_the_separate_kernels() {
    use super::fp4::{Fp4Weights, SumOrder};
    use crate::compute::fp4::{Fp4Format, Fp4Matrix};
    let Some(gpu) = gpu() else { return };
    // 512 columns: whole 128-column chunks; 576 (SmolLM2's): a partial last
    // chunk (x's loads bounded). FFN 3,200: 400 tiles of gate/up, more than
    // the grid's blocks on an H200, so blocks walk several. Hidden 2,048
    // with FFN 8,192 and 128 heads (64 for KV): QKV and gate/up of 16,384 x
    // 2,048, several chunks a warp.
    for (hidden, ffn, heads, kv_heads) in
        [(512, 320, 6, 2), (576, 3200, 6, 2), (2048, 8192, 128, 64)]
    {
        let c = LlamaConfig {
            hidden,
            ffn,
            rms_eps: 0.0,
            ..tiny_config(64, heads, kv_heads)
        };
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let qkv_rows = q_dim + 2 * kv_dim;
        let block_size = 16;
        let (pos, slot) = (37i32, 5 * block_size as i32 + 37 % block_size as i32);
        let (dpos, dslot) = (gpu.upload(&[pos]).unwrap(), gpu.upload(&[slot]).unwrap());
        let (pos_p, slot_p) = (gpu.ptr(&dpos, 0), gpu.ptr(&dslot, 0));
        for format in [Fp4Format::Mxfp4, Fp4Format::Nvfp4] {
            let quantized = |rows: usize, cols: usize, seed: u64| {
                let w = values(rows * cols, seed);
                let m = Fp4Matrix::quantize(format, rows, cols, &w).unwrap();
                Fp4Weights::upload(&gpu, &m).unwrap()
            };
            let (w_qkv, w_gate_up) = (
                quantized(qkv_rows, hidden, 61),
                quantized(2 * ffn, hidden, 62),
            );
            let w_o = quantized(hidden, q_dim, 63);

            let separate = |x: &[f32], g: &[f32]| {
                let (dx, dg) = (gpu.upload(x).unwrap(), gpu.upload(g).unwrap());
                let xn = gpu.alloc::<u16>(hidden).unwrap();
                let xn_p = gpu.ptr(&xn, 0);
                let (dx_p, dg_p) = (gpu.ptr(&dx, 0), gpu.ptr(&dg, 0));
                layers::rms_norm(&gpu, dx_p, 0, dg_p, xn_p, 1, hidden, c.rms_eps).unwrap();
                let qkv = gpu.alloc::<f32>(qkv_rows).unwrap();
                let qkv_p = gpu.ptr(&qkv, 0);
                w_qkv
                    .gemv(&gpu, xn_p, qkv_p, 1, false, SumOrder::AsGemv)
                    .unwrap();
                let kv = CudaKvCache::new(&gpu, &c, 8, block_size).unwrap();
                let (k, v) = kv.layer(&gpu, 0);
                let q = gpu.alloc::<u16>(q_dim).unwrap();
                layers::rope_store_kv(&gpu, &c, qkv_p, pos_p, slot_p, gpu.ptr(&q, 0), k, v, 1)
                    .unwrap();
                let gate_up = gpu.alloc::<f32>(2 * ffn).unwrap();
                let gate_up_p = gpu.ptr(&gate_up, 0);
                w_gate_up
                    .gemv(&gpu, xn_p, gate_up_p, 1, false, SumOrder::AsGemv)
                    .unwrap();
                let act = gpu.alloc::<u16>(ffn).unwrap();
                // FP4 gate/up rows alternate in runs of 8 (GATE_UP_RUN).
                layers::silu_mul(&gpu, gate_up_p, gpu.ptr(&act, 0), 1, ffn, 8).unwrap();
                FusedOutputs {
                    q: gpu.download(&q, q_dim).unwrap(),
                    kv: kv.read_layer(&gpu, 0).unwrap(),
                    act: gpu.download(&act, ffn).unwrap(),
                }
            };
            let fused = |x: &[f32], g: &[f32]| {
                let xg: Vec<f32> = x.iter().zip(g).map(|(x, g)| x * g).collect();
                let dxg = gpu.upload(&to_bf16(&xg)).unwrap();
                let dss = gpu.upload(&sumsq_tiles(x)).unwrap();
                let (ss_p, xg_p) = (gpu.ptr(&dss, 0), gpu.ptr(&dxg, 0));
                let kv = CudaKvCache::new(&gpu, &c, 8, block_size).unwrap();
                let (k, v) = kv.layer(&gpu, 0);
                let q = gpu.alloc::<u16>(q_dim).unwrap();
                let q_p = gpu.ptr(&q, 0);
                layers::fp4_gemv_norm_rope(&gpu, &c, &w_qkv, xg_p, ss_p, pos_p, slot_p, q_p, k, v)
                    .unwrap();
                let act = gpu.alloc::<u16>(ffn).unwrap();
                layers::fp4_gemv_norm_swiglu(&gpu, &c, &w_gate_up, xg_p, ss_p, gpu.ptr(&act, 0))
                    .unwrap();
                FusedOutputs {
                    q: gpu.download(&q, q_dim).unwrap(),
                    kv: kv.read_layer(&gpu, 0).unwrap(),
                    act: gpu.download(&act, ffn).unwrap(),
                }
            };
            let what = format!("{format:?}, hidden {hidden}");

            let at = slot as usize * kv_dim..(slot as usize + 1) * kv_dim;
            assert_fused_equals_separate(hidden, at, &what, separate, fused);
            let g: Vec<f32> = values(hidden, 42).iter().map(|v| 1.0 + 0.5 * v).collect();

            // The output projection: y += W x as the GEMV adds it, and
            // bf16(y g_next) for the next norm's input.
            let attn = gpu.upload(&to_bf16(&values(q_dim, 46))).unwrap();
            let attn_p = gpu.ptr(&attn, 0);
            let y0 = values(hidden, 47);
            let ya = gpu.upload(&y0).unwrap();
            w_o.gemv(&gpu, attn_p, gpu.ptr(&ya, 0), 1, true, SumOrder::AsGemv)
                .unwrap();
            let want = gpu.download(&ya, hidden).unwrap();
            let yb = gpu.upload(&y0).unwrap();
            let dg = gpu.upload(&g).unwrap();
            let y_bf16 = gpu.alloc::<u16>(hidden).unwrap();
            let y_bf16_p = gpu.ptr(&y_bf16, 0);
            let ss = gpu.alloc::<f32>(hidden / 16).unwrap();
            let (yb_p, dg_p, ss_p) = (gpu.ptr(&yb, 0), gpu.ptr(&dg, 0), gpu.ptr(&ss, 0));
            layers::fp4_gemv_residual(&gpu, &w_o, attn_p, yb_p, y_bf16_p, dg_p, ss_p).unwrap();
            let got = gpu.download(&yb, hidden).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "{what}: y[{i}]: {g} vs {w}"
                );
            }
            assert_ne!(got, y0, "{what}: y was added to");
            let next: Vec<f32> = got.iter().zip(&g).map(|(y, g)| y * g).collect();
            assert_eq!(
                gpu.download(&y_bf16, hidden).unwrap(),
                to_bf16(&next),
                "{what}: y g as BF16"
            );
            let got_ss = gpu.download(&ss, hidden / 16).unwrap();
            for (i, (g, w)) in got_ss.iter().zip(sumsq_tiles(&got)).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * w,
                    "{what}: sum of squares {i}: {g} vs {w}"
                );
            }
            // Without a next norm (the last layer), y alone.
            let yc = gpu.upload(&y0).unwrap();
            layers::fp4_gemv_residual(&gpu, &w_o, attn_p, gpu.ptr(&yc, 0), 0, 0, 0).unwrap();
            assert_eq!(
                gpu.download(&yc, hidden).unwrap(),
                got,
                "{what}: y without y g"
            );
        }
    }
}

/// The one-token output projection's fused form adds the same sums as the
/// GEMV with accumulate, and writes the new residual as BF16.
#[test]
fn gemv_residual_adds_what_the_gemv_adds_and_writes_the_bf16_residual() {
    let Some(gpu) = gpu() else { return };
    for (rows, cols) in [(384, 384), (1001, 5000)] {
        let w = gpu.upload(&to_bf16(&values(rows * cols, 51))).unwrap();
        let x = gpu.upload(&to_bf16(&values(cols, 52))).unwrap();
        let y0 = values(rows, 53);
        let (w_p, x_p) = (gpu.ptr(&w, 0), gpu.ptr(&x, 0));
        let ya = gpu.upload(&y0).unwrap();
        gpu.gemv_bf16(w_p, x_p, gpu.ptr(&ya, 0), 1, rows, cols, true)
            .unwrap();
        let want = gpu.download(&ya, rows).unwrap();
        assert_ne!(want, y0, "{rows} x {cols}: y was added to");
        let yb = gpu.upload(&y0).unwrap();
        let y_bf16 = gpu.alloc::<u16>(rows).unwrap();
        layers::gemv_residual(
            &gpu,
            w_p,
            x_p,
            gpu.ptr(&yb, 0),
            rows,
            cols,
            gpu.ptr(&y_bf16, 0),
        )
        .unwrap();
        assert_eq!(gpu.download(&yb, rows).unwrap(), want, "{rows} x {cols}: y");
        assert_eq!(
            gpu.download(&y_bf16, rows).unwrap(),
            to_bf16(&want),
            "{rows} x {cols}: y as BF16"
        );
    }
}

/// Causal attention of one query row over keys 0..=pos of a paged cache (f32).
fn reference_attention(
    c: &LlamaConfig,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    table: &[u32],
    block_size: usize,
    pos: usize,
) -> Vec<f32> {
    let (hd, kv_dim) = (c.head_dim, c.kv_dim());
    let group = c.n_heads / c.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let at = |p: usize| (table[p / block_size] as usize * block_size + p % block_size) * kv_dim;
    let mut out = vec![0.0; c.q_dim()];
    for head in 0..c.n_heads {
        let kvh = (head / group) * hd;
        let qh = &q[head * hd..(head + 1) * hd];
        let mut scores: Vec<f32> = (0..=pos)
            .map(|p| dot(qh, &k[at(p) + kvh..at(p) + kvh + hd]) * scale)
            .collect();
        softmax(&mut scores);
        for (p, w) in scores.iter().enumerate() {
            for d in 0..hd {
                out[head * hd + d] += w * v[at(p) + kvh + d];
            }
        }
    }
    out
}

#[test]
fn paged_attention_matches_the_cpu_for_decode_and_prefill() {
    let Some(gpu) = gpu() else { return };
    for (head_dim, n_heads, n_kv_heads) in [(64, 9, 3), (128, 8, 2), (128, 8, 1)] {
        let c = tiny_config(head_dim, n_heads, n_kv_heads);
        let block_size = 16;
        let n_blocks = 160;
        let mut kv = CudaKvCache::new(&gpu, &c, n_blocks, block_size).unwrap();
        // Fill the whole cache with values, K and V.
        let len = n_blocks * block_size * c.kv_dim();
        let (k_host, v_host) = (
            from_bf16(&to_bf16(&values(len, 11))),
            from_bf16(&to_bf16(&values(len, 12))),
        );
        gpu.upload_into(&to_bf16(&k_host), &mut kv.k).unwrap();
        gpu.upload_into(&to_bf16(&v_host), &mut kv.v).unwrap();
        // Tables: sequence 0 uses blocks in reverse, sequence 1 every other one.
        let t0: Vec<u32> = (0..80).rev().collect();
        let t1: Vec<u32> = (0..80).map(|i| 80 + (i * 7) % 80).collect();
        // A sequence longer than the cache, its table reusing blocks: 17,001
        // keys are 67 splits, more than the combine takes at once at hd64.
        let t_long: Vec<u32> = (0..1064).map(|i| (i * 13) % 160).collect();
        // A 70-token prefill chunk at 100 (several items, a partial tile), a
        // decode at 1200 (split across blocks), a decode at 3 (one split with
        // keys, the rest empty) and a decode at 17,000.
        let prefill_tokens = vec![0u32; 70];
        let chunks = [
            SeqChunk {
                tokens: &prefill_tokens,
                start: 100,
                block_table: &t0,
                logits: Logits::Last,
            },
            SeqChunk {
                tokens: &[0],
                start: 1200,
                block_table: &t1,
                logits: Logits::Last,
            },
            SeqChunk {
                tokens: &[0],
                start: 3,
                block_table: &t0,
                logits: Logits::Last,
            },
            SeqChunk {
                tokens: &[0],
                start: 17_000,
                block_table: &t_long,
                logits: Logits::Last,
            },
        ];
        let group = n_heads / n_kv_heads;
        let plan = StepPlan::new(&chunks, block_size, group, SplitPolicy::Fixed);
        assert_eq!(
            plan.decode_splits, 67,
            "the decode at 17,000 in 256-key splits"
        );
        check_attention(
            &gpu,
            &c,
            &kv,
            &plan,
            &[&t0, &t1, &t0, &t_long],
            &k_host,
            &v_host,
        );
        // Without it: 5 splits of 256 keys (Fixed), merged by
        // attention_combine, and, filling the GPU, 19 of 64, also merged by
        // the combine; the decode at 1200 alone (one decode token), 10 of
        // 128 that merge inside clusters where the GPU has them (19 of 64
        // where not).
        let fill = SplitPolicy::for_numerics(Numerics::Fast, &gpu, n_kv_heads);
        let clusters = gpu.has_clusters();
        let fill_splits = if clusters { 10 } else { 19 };
        for (policy, count, split) in [
            (SplitPolicy::Fixed, 3, (5, false)),
            (fill, 3, (19, false)),
            (fill, 2, (fill_splits, clusters)),
        ] {
            let plan = StepPlan::new(&chunks[..count], block_size, group, policy);
            assert_eq!(
                (plan.decode_splits, plan.decode_in_clusters),
                split,
                "{policy:?}, {count} chunks"
            );
            let tables: [&[u32]; 3] = [&t0, &t1, &t0];
            check_attention(&gpu, &c, &kv, &plan, &tables[..count], &k_host, &v_host);
        }
    }
}

/// `launch_attention` of `plan` (its chunks' block tables in `tables`, one
/// per chunk; K and V of layer 0 as `k_host`, `v_host`) against
/// `reference_attention`, within 1e-2.
fn check_attention(
    gpu: &Arc<Gpu>,
    c: &LlamaConfig,
    kv: &CudaKvCache,
    plan: &StepPlan,
    tables: &[&[u32]],
    k_host: &[f32],
    v_host: &[f32],
) {
    let (head_dim, block_size) = (c.head_dim, kv.block_size);
    let n = plan.tokens.len();
    let q_host = from_bf16(&to_bf16(&values(n * c.q_dim(), 13)));
    let dq = gpu.upload(&to_bf16(&q_host)).unwrap();
    let out = gpu.alloc::<u16>(n * c.q_dim()).unwrap();
    let mut ws = Workspace::new(gpu).unwrap();
    ws.reserve(gpu, c, n, 1, plan.decode_splits).unwrap();
    let mut meta_buf = gpu.alloc::<i32>(1).unwrap();
    let meta = plan.upload(gpu, &mut meta_buf).unwrap();
    let (k_cache, v_cache) = kv.layer(gpu, 0);
    launch_attention(
        gpu,
        c,
        &ws,
        plan,
        &meta,
        gpu.ptr(&dq, 0),
        k_cache,
        v_cache,
        gpu.ptr(&out, 0),
    )
    .unwrap();
    let got = from_bf16(&gpu.download(&out, n * c.q_dim()).unwrap());
    // The first chunk is a prefill, the others one decode token each.
    let prefill_len = n - (tables.len() - 1);
    let mut worst = 0.0f32;
    for t in 0..n {
        let pos = plan.positions[t] as usize;
        let table = tables[if t < prefill_len {
            0
        } else {
            t + 1 - prefill_len
        }];
        let q_row = &q_host[t * c.q_dim()..(t + 1) * c.q_dim()];
        let want = reference_attention(c, q_row, k_host, v_host, table, block_size, pos);
        for (g, w) in got[t * c.q_dim()..(t + 1) * c.q_dim()].iter().zip(&want) {
            worst = worst.max((g - w).abs());
        }
    }
    let (n_heads, n_kv_heads, splits) = (c.n_heads, c.n_kv_heads, plan.decode_splits);
    eprintln!(
        "attention hd{head_dim} {n_heads}/{n_kv_heads}, {splits} splits: max abs error {worst:e}"
    );
    assert!(
        worst < 1e-2,
        "attention hd{head_dim}, {splits} splits: max abs error {worst}"
    );
}

/// `sluice bench fp4 --gemv`'s sweep times every kernel a decode step runs
/// on each matrix of a layer: the plain GEMV and GEMM at each token count
/// and, at one token, the fused kernel batch 1 runs, each with a figure.
#[test]
fn fp4_sweep_times_the_fused_one_token_kernels_too() {
    use super::fp4::{FP4_GEMV_MAX_TOKENS, FP4_SWEEP_TOKENS, fp4_sweep};
    let Some(gpu) = gpu() else { return };
    let c = LlamaConfig::preset("llama-3.2-1b").unwrap();
    // One copy of each matrix: the figures' worth is not the point here.
    let figures = fp4_sweep(&gpu, &c, 1).unwrap();
    for format in ["mxfp4", "nvfp4"] {
        for matrix in ["qkv", "o", "gate_up", "down"] {
            let of: Vec<_> = figures
                .iter()
                .filter(|f| f.format == format && f.matrix == matrix)
                .map(|f| (f.tokens, f.kernel))
                .collect();
            let plain = |n| {
                if n <= FP4_GEMV_MAX_TOKENS {
                    "gemv"
                } else {
                    "gemm"
                }
            };
            let mut want: Vec<_> = FP4_SWEEP_TOKENS.iter().map(|&n| (n, plain(n))).collect();
            want.push((1, "fused"));
            assert_eq!(of, want, "{format} {matrix}");
        }
    }
    for f in &figures {
        assert!(f.us > 0.0 && f.gb_s.is_finite() && f.gb_s > 0.0, "{f:?}");
    }
}

/// The FP4 GEMV (MXFP4 and NVFP4) against the CPU reference's dequantized
/// weights times BF16 x: within 1e-3 relative (f32 sums in another order).
/// Rows not a multiple of the 16-row tile, chunks not a multiple of the 8
/// warps, a partial last chunk (96 and 608 columns), rows of different
/// magnitudes (different scales), two matrices stacked (each its own tensor
/// scale), matrices taller than the GEMV's grid, 1 to 64 tokens (several
/// token blocks), into y and added to it; the same through the tiled GEMM (1
/// to 100 tokens, one column split and many; a partial last chunk too), and
/// the GEMM in the GEMV's order (64 tokens a launch past 64) equal to the
/// GEMV bit for bit. And the
/// dequantization to BF16: each weight within one BF16 rounding.
#[test]
fn fp4_gemv_matches_the_cpu_reference() {
    use crate::compute::fp4::{Fp4Format, Fp4Matrix};
    let Some(gpu) = gpu() else { return };
    // More 16-row tiles than the GEMV's grid has blocks (each block walks
    // several, its cp.async pipeline running on from one tile to the next),
    // with warps that have no chunk (256 columns: two), one that has two
    // while the rest have one (1,152), and a partial last chunk (1,088
    // columns); these run the GEMV's token counts only. The
    // tiled layout pads rows to 16 and columns to 128 (24 x 96, 8 x 608, 40
    // rows, 1,088 columns); x's loads are bounded only where the last chunk
    // is partial. The 16-token GEMV takes row tiles in groups: pairs on
    // small matrices, where an odd number of tiles (40 and 8 rows) leaves the
    // last pair without a second; threes on tall ones (4 x SMs + 3, + 4 and +
    // 5 tiles: one of each remainder by 3 on any GPU). Rows of 8,320 columns
    // (65 chunks: 9 for warp 0, 8 for the others) take the 16-token pairs
    // in rotated orders in the fastest order (fp4.rs, gemv_rotates), 21
    // tiles of them a last pair without a second; 8,288 columns the same
    // with a partial last chunk, which the rotation reads mid-order.
    let tall = 16 * 4 * gpu.sm_count as usize + 40;
    let whole_tall = tall - 40;
    for (rows, cols) in [
        (40, 640),
        (16, 128),
        (24, 96),
        (8, 608),
        (tall, 256),
        (tall, 1152),
        (tall, 1088),
        (tall + 16, 1152),
        (tall + 32, 1088),
        (whole_tall, 256),
        (whole_tall, 1152),
        (328, 8320),
        (328, 8288),
    ] {
        let w: Vec<f32> = values(rows * cols, 41)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi((i / cols % 7) as i32 - 3))
            .collect();
        for format in [Fp4Format::Mxfp4, Fp4Format::Nvfp4] {
            // The first half of the rows and the rest, quantized apart
            // (NVFP4: two tensor scales), run as one.
            let half = rows / 2;
            let top = Fp4Matrix::quantize(format, half, cols, &w[..half * cols]).unwrap();
            let bottom = Fp4Matrix::quantize(format, rows - half, cols, &w[half * cols..]).unwrap();
            let mut reference = top.dequantize();
            reference.extend(bottom.dequantize());
            let dw = super::fp4::Fp4Weights::stack(&gpu, &[&top, &bottom]).unwrap();
            use super::fp4::SumOrder::{AsGemv, Fastest};
            #[derive(Clone, Copy, Debug, PartialEq)]
            enum Path {
                Gemv(super::fp4::SumOrder),
                Gemm(super::fp4::SumOrder),
            }
            let paths = [
                Path::Gemv(AsGemv),
                Path::Gemv(Fastest),
                Path::Gemm(Fastest),
                Path::Gemm(AsGemv),
            ];
            for (n, path) in [1usize, 5, 8, 11, 16, 17, 40, 64]
                .into_iter()
                .flat_map(|n| paths.map(|p| (n, p)))
                .chain([(100, Path::Gemm(Fastest)), (100, Path::Gemm(AsGemv))])
            {
                if (rows >= whole_tall || cols > 2048) && n > 17 {
                    continue;
                }
                let x = from_bf16(&to_bf16(&values(n * cols, 50 + n as u64)));
                let dx = gpu.upload(&to_bf16(&x)).unwrap();
                let before = values(n * rows, 7);
                let mut y = gpu.upload(&before).unwrap();
                let accumulate = n % 2 == 1;
                let (xp, yp) = (gpu.ptr(&dx, 0), gpu.ptr(&y, 0));
                let mut run = |path: Path| {
                    gpu.upload_into(&before, &mut y).unwrap();
                    match path {
                        Path::Gemm(order) => {
                            let scratch = dw.gemm_scratch(n, gpu.sm_count, order);
                            let part = gpu.alloc::<f32>(scratch.max(1)).unwrap();
                            let pp = gpu.ptr(&part, 0);
                            dw.gemm(&gpu, xp, yp, pp, n, accumulate, order).unwrap();
                        }
                        Path::Gemv(order) => dw.gemv(&gpu, xp, yp, n, accumulate, order).unwrap(),
                    }
                    gpu.download(&y, n * rows).unwrap()
                };
                if path == Path::Gemm(AsGemv) {
                    // The GEMM in the GEMV's order: the same bits.
                    let gemv = run(Path::Gemv(AsGemv));
                    assert_eq!(run(path), gemv, "{format:?} {rows}x{cols} n={n}");
                    continue;
                }
                let got = run(path);
                // Whatever the order, the same bits from run to run.
                assert_eq!(
                    run(path),
                    got,
                    "{format:?} {rows}x{cols} n={n} {path:?} again"
                );
                for (i, g) in got.iter().enumerate() {
                    let (j, r) = (i / rows, i % rows);
                    let mut e = dot(
                        &reference[r * cols..(r + 1) * cols],
                        &x[j * cols..(j + 1) * cols],
                    );
                    if accumulate {
                        e += before[i];
                    }
                    let scale = 2f32.powi((r % 7) as i32 - 3);
                    assert!(
                        (g - e).abs() <= 1e-3 * e.abs().max(scale).max(1.0),
                        "{format:?} {rows}x{cols} n={n} {path:?} [{j}, {r}]: {g} vs {e}"
                    );
                }
            }
            let out = gpu.alloc::<u16>(rows * cols).unwrap();
            dw.dequantize_into(&gpu, gpu.ptr(&out, 0)).unwrap();
            let got = from_bf16(&gpu.download(&out, rows * cols).unwrap());
            for (i, (g, e)) in got.iter().zip(&reference).enumerate() {
                assert!(
                    (g - e).abs() <= e.abs() / 256.0,
                    "{format:?} dequantized [{i}]: {g} vs {e}"
                );
            }
        }
    }
    // Columns that are not whole 32-column groups are refused, not misread.
    let m = Fp4Matrix::quantize(Fp4Format::Nvfp4, 2, 48, &values(96, 3)).unwrap();
    assert!(super::fp4::Fp4Weights::upload(&gpu, &m).is_err());
}

/// The activation quantizer of the Blackwell path (`fp4_quantize_act_*`,
/// which runs on any GPU) gives, token by token, what the CPU quantizer gives
/// for that token's row alone: the same codes (+-0 aside), scale bytes and
/// tensor scale, on rows of mixed magnitudes with exact block maxima, ties
/// between grid points and an all-zero block.
#[test]
fn activation_quantizer_matches_the_cpu_quantizer() {
    use super::fp4_blackwell::{ActivationLayout, quantize_activations};
    use crate::compute::fp4::{Fp4Format, Fp4Matrix};
    let Some(gpu) = gpu() else { return };
    let (n, cols) = (5, 512);
    let mut x: Vec<f32> = values(n * cols, 91)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi((i / 32 % 9) as i32 - 4))
        .collect();
    // Token 1: values on the grid's midpoints under a block max of 6 (ties),
    // and a zero block; token 2: one huge and many tiny values.
    for (k, v) in x[cols..cols + 32].iter_mut().enumerate() {
        *v = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5][k % 10];
    }
    x[cols + 32..cols + 64].fill(0.0);
    x[2 * cols] = 3.0e4;
    let x = from_bf16(&to_bf16(&x));
    let dx = gpu.upload(&to_bf16(&x)).unwrap();
    for format in [Fp4Format::Mxfp4, Fp4Format::Nvfp4] {
        let at = ActivationLayout::new(format, n, cols);
        let scratch = gpu.alloc::<f32>(at.floats).unwrap();
        quantize_activations(&gpu, format, gpu.ptr(&dx, 0), n, cols, gpu.ptr(&scratch, 0)).unwrap();
        let bytes: Vec<u8> = gpu
            .download(&scratch, at.floats)
            .unwrap()
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        for t in 0..n {
            let cpu = Fp4Matrix::quantize(format, 1, cols, &x[t * cols..(t + 1) * cols]).unwrap();
            let tensor = f32::from_le_bytes(bytes[4 * t..4 * t + 4].try_into().unwrap());
            assert_eq!(
                tensor, cpu.tensor_scale,
                "{format:?} token {t}: tensor scale"
            );
            let per_row = cols / format.block();
            let scales = &bytes[at.scales + t * per_row..at.scales + (t + 1) * per_row];
            assert_eq!(scales, &cpu.scales[..], "{format:?} token {t}: scales");
            let codes = &bytes[at.codes + t * cols / 2..at.codes + (t + 1) * cols / 2];
            for (i, (&g, &c)) in codes.iter().zip(&cpu.codes).enumerate() {
                // Code 8 (-0) equals code 0.
                let same = |a: u8, b: u8| a == b || (a | b) == 8;
                assert!(
                    same(g & 15, c & 15) && same(g >> 4, c >> 4),
                    "{format:?} token {t} byte {i}: {g:#04x} vs {c:#04x}"
                );
            }
        }
    }
}

/// `Gpu::shared_for_at_most` caps how many blocks of a kernel an SM holds
/// (the early-launched FP4 GEMVs' spread, device.rs), and leaves a kernel
/// already within the cap as it is.
#[test]
fn shared_for_at_most_caps_the_blocks_an_sm() {
    let Some(gpu) = gpu() else { return };
    // 8 warps; a one-token block's two stages of 1,152 bytes a warp, a
    // 16-token block's pairs of tiles twice that (fp4.rs, gemv_smem).
    for (name, shared) in [
        ("fp4_gemv_mx_residual_n1", 8 * 2 * 1152),
        ("fp4_gemv_nv_n16", 2 * 8 * 2 * 1152),
    ] {
        let full = gpu.blocks_per_sm(name, 256, shared).unwrap();
        assert!(full >= 2, "{name}: {full} blocks an SM");
        for most in 1..=full {
            let s = gpu.shared_for_at_most(name, 256, shared, most).unwrap();
            let held = gpu.blocks_per_sm(name, 256, s).unwrap();
            assert!(
                s >= shared && held <= most && held >= 1,
                "{name}: at most {most} an SM: {s} bytes hold {held}"
            );
            if most == full {
                assert_eq!(s, shared, "{name}: already within {most}");
            }
        }
    }
}
