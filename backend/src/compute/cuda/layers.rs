//! Launches of the per-token kernels around the GEMMs (`kernels/layers.cu`):
//! RMSNorm, RoPE with the KV cache write, SwiGLU and greedy sampling, each
//! with the grid its kernel is written for; and the one-token GEMVs that fuse
//! them with a layer's input projections (`kernels/gemv.cu`, and their FP4
//! kin in `kernels/fp4.cu`). The model and
//! the kernel tests both launch through here.

use super::device::{DevPtr, Gpu, GpuError, KernelArg, elementwise, grid};
use super::fp4::Fp4Weights;
use crate::model::LlamaConfig;

/// RMSNorm's block size and float4s per thread (`RMS_THREADS`, `RMS_VEC`).
const RMS_THREADS: u32 = 1024;
const RMS_VEC: usize = 4;
/// The widest row RMSNorm holds: a float4 of it per thread and RMS_VEC.
const RMS_MAX_HIDDEN: usize = RMS_THREADS as usize * RMS_VEC * 4;
/// Heads a RoPE block takes (`ROPE_HEADS`).
const ROPE_HEADS: usize = 4;

/// The shapes these kernels take, checked when a model is built.
pub fn check_shape(config: &LlamaConfig) -> Result<(), GpuError> {
    if !config.hidden.is_multiple_of(4) || config.hidden > RMS_MAX_HIDDEN {
        return Err(GpuError::Other(format!(
            "the RMSNorm kernel takes a hidden size that is a multiple of 4, up to \
             {RMS_MAX_HIDDEN}, not {}",
            config.hidden
        )));
    }
    if !config.vocab.is_multiple_of(4) {
        return Err(GpuError::Other(format!(
            "the sampling kernel takes a vocabulary that is a multiple of 4, not {}",
            config.vocab
        )));
    }
    Ok(())
}

/// `out[b] = bf16(x[r] / rms(x[r]) * w)` for `count` rows: r = `rows[b]`, or
/// b where `rows` is 0. x f32 rows of `hidden`, out BF16.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    x: DevPtr,
    rows: DevPtr,
    w: DevPtr,
    out: DevPtr,
    count: usize,
    hidden: usize,
    eps: f32,
) -> Result<(), GpuError> {
    // SAFETY (kernel): x holds every row named, w and out `hidden` floats
    // and `count` rows; hidden was checked by `check_shape`.
    gpu.launch(
        "rms_norm",
        grid((count as u32, 1, 1), RMS_THREADS, 0),
        &[&x, &rows, &w, &out, &(hidden as i32), &eps],
    )
}

/// RoPE on Q and K of `n` tokens' QKV rows (f32), Q to `q_out` (BF16), K and
/// V into this layer's cache at `slots[t]`, position `positions[t]`.
#[allow(clippy::too_many_arguments)]
pub fn rope_store_kv(
    gpu: &Gpu,
    c: &LlamaConfig,
    qkv: DevPtr,
    positions: DevPtr,
    slots: DevPtr,
    q_out: DevPtr,
    k_cache: DevPtr,
    v_cache: DevPtr,
    n: usize,
) -> Result<(), GpuError> {
    // SAFETY (kernel): qkv holds n rows of q_dim + 2 kv_dim, positions and
    // slots n entries, q_out n rows of q_dim; every slot is in the cache.
    let out = RopeKvOut::new(c, positions, slots, q_out, k_cache, v_cache);
    let mut args: Vec<&dyn KernelArg> = vec![&qkv];
    args.extend(out.args());
    gpu.launch(
        "rope_store_kv",
        grid(
            (
                n as u32,
                (c.n_heads + c.n_kv_heads).div_ceil(ROPE_HEADS) as u32,
                1,
            ),
            (ROPE_HEADS * c.head_dim / 2) as u32,
            0,
        ),
        &args,
    )
}

/// Where RoPE's outputs go and its shape: the trailing parameters of
/// `rope_store_kv` and `gemv_norm_rope_n1` (`RopeKvOut` in common.cuh).
struct RopeKvOut {
    positions: DevPtr,
    slots: DevPtr,
    q_out: DevPtr,
    k_cache: DevPtr,
    v_cache: DevPtr,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    theta: f32,
}

impl RopeKvOut {
    fn new(
        c: &LlamaConfig,
        positions: DevPtr,
        slots: DevPtr,
        q_out: DevPtr,
        k_cache: DevPtr,
        v_cache: DevPtr,
    ) -> RopeKvOut {
        RopeKvOut {
            positions,
            slots,
            q_out,
            k_cache,
            v_cache,
            n_heads: c.n_heads as i32,
            n_kv_heads: c.n_kv_heads as i32,
            head_dim: c.head_dim as i32,
            theta: c.rope_theta,
        }
    }

    /// For the kernels that take these parameters and write no RoPE.
    fn none() -> RopeKvOut {
        RopeKvOut {
            positions: 0,
            slots: 0,
            q_out: 0,
            k_cache: 0,
            v_cache: 0,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim: 0,
            theta: 0.0,
        }
    }

    fn args(&self) -> [&dyn KernelArg; 9] {
        [
            &self.positions,
            &self.slots,
            &self.q_out,
            &self.k_cache,
            &self.v_cache,
            &self.n_heads,
            &self.n_kv_heads,
            &self.head_dim,
            &self.theta,
        ]
    }
}

/// Whether the fused one-token GEMVs take this shape: whole 16-byte groups
/// of the hidden row (as the GEMV reads them; `gemv_residual`'s columns, q_dim
/// and ffn, too).
pub fn fuses(c: &LlamaConfig) -> bool {
    [c.hidden, c.q_dim(), c.ffn]
        .iter()
        .all(|d| d.is_multiple_of(8))
}

/// One token's QKV projection at batch 1 with what comes before and after
/// it, in one launch: RMSNorm of `x` (the residual as BF16, `hidden`, which
/// `embed_rows` or `gemv_residual` wrote), times `w` (BF16, q_dim + 2 kv_dim
/// rows of `hidden`, the norm's weights folded into its columns), RoPE, Q to
/// `q_out` and K and V into this layer's cache at `slots[0]` (position
/// `positions[0]`): the values `rms_norm` (weights g), the GEMV with the
/// unfolded weights and `rope_store_kv` give, up to rounding (here W g and x
/// are rounded to BF16, there W and x / rms(x) * g).
#[allow(clippy::too_many_arguments)]
pub fn gemv_norm_rope(
    gpu: &Gpu,
    c: &LlamaConfig,
    w: DevPtr,
    x: DevPtr,
    positions: DevPtr,
    slots: DevPtr,
    q_out: DevPtr,
    k_cache: DevPtr,
    v_cache: DevPtr,
) -> Result<(), GpuError> {
    let rows = c.q_dim() + 2 * c.kv_dim();
    // SAFETY (kernel): w holds rows x hidden BF16, x `hidden` (a multiple of
    // 8: `fuses`), positions and slots one entry, q_out q_dim; the slot is
    // in the cache. A block a row pair.
    let out = RopeKvOut::new(c, positions, slots, q_out, k_cache, v_cache);
    let (rows32, hidden) = (rows as i32, c.hidden as i32);
    let mut args: Vec<&dyn KernelArg> = vec![&w, &x, &c.rms_eps, &rows32, &hidden];
    args.extend(out.args());
    gpu.launch(
        "gemv_norm_rope_n1",
        grid(((rows / 2) as u32, 1, 1), GEMV_THREADS, 0),
        &args,
    )
}

/// One token's gate and up projections at batch 1 with the RMSNorm in front
/// (as in `gemv_norm_rope`: `x` the residual as BF16, the norm's weights
/// folded into `w`) and SwiGLU after, in one launch: the stacked [gate | up]
/// weights `w` (2 ffn rows of `hidden`) times the normalized `x`,
/// `act = bf16(silu(gate) * up)`.
pub fn gemv_norm_swiglu(
    gpu: &Gpu,
    c: &LlamaConfig,
    w: DevPtr,
    x: DevPtr,
    act: DevPtr,
) -> Result<(), GpuError> {
    // SAFETY (kernel): w holds 2 ffn x hidden BF16, x `hidden` (a multiple
    // of 8: `fuses`), act ffn BF16. A block a gate row and its up row.
    gpu.launch(
        "gemv_norm_swiglu_n1",
        grid((c.ffn as u32, 1, 1), GEMV_THREADS, 0),
        &[
            &w,
            &x,
            &c.rms_eps,
            &(c.ffn as i32),
            &(c.hidden as i32),
            &act,
        ],
    )
}

/// One token's output projection at batch 1: `y += w x` (y f32, `rows`;
/// `w` BF16 rows of `cols`, a multiple of 8), writing the new y as BF16 to
/// `y_bf16` for the fused input projection after it. y is what `gemv_bf16`
/// with accumulate gives.
pub fn gemv_residual(
    gpu: &Gpu,
    w: DevPtr,
    x: DevPtr,
    y: DevPtr,
    rows: usize,
    cols: usize,
    y_bf16: DevPtr,
) -> Result<(), GpuError> {
    // SAFETY (kernel): w holds rows x cols BF16, x cols BF16, y rows f32,
    // y_bf16 rows BF16. A block a row pair.
    gpu.launch(
        "gemv_residual_n1",
        grid((rows.div_ceil(2) as u32, 1, 1), GEMV_THREADS, 0),
        &[&w, &x, &y, &(rows as i32), &(cols as i32), &y_bf16],
    )
}

/// `gemv_norm_rope` with FP4 weights `w` (`fp4.cu`, FP4_NORM_ROPE): `x` is
/// the residual times the norm's weights g as BF16 (FP4 codes cannot take g
/// folded in) and `sumsq_tiles` the sums of the f32 residual's squares by 16
/// elements, whose total gives the RMS that scales the sums (the embedding
/// or the output projection before writes both).
#[allow(clippy::too_many_arguments)]
pub fn fp4_gemv_norm_rope(
    gpu: &Gpu,
    c: &LlamaConfig,
    w: &Fp4Weights,
    x: DevPtr,
    sumsq_tiles: DevPtr,
    positions: DevPtr,
    slots: DevPtr,
    q_out: DevPtr,
    k_cache: DevPtr,
    v_cache: DevPtr,
) -> Result<(), GpuError> {
    fp4_check(w, c.q_dim() + 2 * c.kv_dim(), c.hidden)?;
    let rope = RopeKvOut::new(c, positions, slots, q_out, k_cache, v_cache);
    // SAFETY (kernel, with Fp4Weights::gemv_one_token's): x holds `hidden`
    // values and sumsq_tiles hidden / 16, positions and slots one entry,
    // q_out q_dim; the slot is in the cache.
    let epilogue = Fp4Epilogue {
        sumsq_tiles,
        eps: c.rms_eps,
        out: 0,
        g_next: 0,
        rope,
    };
    epilogue.launch(gpu, w, "norm_rope", x, 0, false)
}

/// `gemv_norm_swiglu` with FP4 weights `w` (FP4_NORM_SWIGLU): gate and up
/// rows in alternate runs of 8 (model.rs, `GATE_UP_RUN`) times x (as in
/// `fp4_gemv_norm_rope`), `act = bf16(silu(gate) * up)`.
pub fn fp4_gemv_norm_swiglu(
    gpu: &Gpu,
    c: &LlamaConfig,
    w: &Fp4Weights,
    x: DevPtr,
    sumsq_tiles: DevPtr,
    act: DevPtr,
) -> Result<(), GpuError> {
    fp4_check(w, 2 * c.ffn, c.hidden)?;
    // SAFETY (kernel): x holds `hidden` values, sumsq_tiles hidden / 16, act
    // ffn BF16.
    let epilogue = Fp4Epilogue {
        sumsq_tiles,
        eps: c.rms_eps,
        out: act,
        g_next: 0,
        rope: RopeKvOut::none(),
    };
    epilogue.launch(gpu, w, "norm_swiglu", x, 0, false)
}

/// `gemv_residual` with FP4 weights `w` (FP4_RESIDUAL): `y += w x`, and
/// for the next norm's input projection `bf16(y * g_next)` to `y_bf16` and
/// the sums of y's squares by 16 rows to `sumsq_tiles` (neither where
/// `y_bf16` is 0).
pub fn fp4_gemv_residual(
    gpu: &Gpu,
    w: &Fp4Weights,
    x: DevPtr,
    y: DevPtr,
    y_bf16: DevPtr,
    g_next: DevPtr,
    sumsq_tiles: DevPtr,
) -> Result<(), GpuError> {
    // SAFETY (kernel): x holds `cols` BF16 values, y `rows` f32; where y_bf16
    // is not 0, it and g_next hold `rows` values and sumsq_tiles rows / 16.
    let epilogue = Fp4Epilogue {
        sumsq_tiles,
        eps: 0.0,
        out: y_bf16,
        g_next,
        rope: RopeKvOut::none(),
    };
    epilogue.launch(gpu, w, "residual", x, y, true)
}

/// The fused FP4 kernels' parameters after the GEMV's (`fp4.cu`,
/// FP4_FUSED_ARGS; those a kernel does not use 0).
struct Fp4Epilogue {
    sumsq_tiles: DevPtr,
    eps: f32,
    out: DevPtr,
    g_next: DevPtr,
    rope: RopeKvOut,
}

impl Fp4Epilogue {
    /// Launches `fp4_gemv_*_{kernel}_n1` of `w` for one token.
    fn launch(
        &self,
        gpu: &Gpu,
        w: &Fp4Weights,
        kernel: &str,
        x: DevPtr,
        y: DevPtr,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        let mut args: Vec<&dyn KernelArg> =
            vec![&self.sumsq_tiles, &self.eps, &self.out, &self.g_next];
        args.extend(self.rope.args());
        w.gemv_one_token(gpu, kernel, x, y, accumulate, &args)
    }
}

/// A fused FP4 GEMV's matrix against the shape its epilogue writes.
fn fp4_check(w: &Fp4Weights, rows: usize, cols: usize) -> Result<(), GpuError> {
    if (w.rows, w.cols) != (rows, cols) {
        return Err(GpuError::Other(format!(
            "a fused FP4 GEMV of {} x {} where the layer wants {rows} x {cols}",
            w.rows, w.cols
        )));
    }
    Ok(())
}

/// The fused GEMVs' block (`GEMV_THREADS` in gemv.cu).
const GEMV_THREADS: u32 = 128;

/// `act = bf16(silu(gate) * up)` for `n` rows of gate and up (f32, 2 ffn):
/// `[gate | up]` where `run` is 0, else alternate runs of `run` gate and
/// `run` up values (FP4 weights' order, model.rs `GATE_UP_RUN`).
pub fn silu_mul(
    gpu: &Gpu,
    gate_up: DevPtr,
    act: DevPtr,
    n: usize,
    ffn: usize,
    run: usize,
) -> Result<(), GpuError> {
    if run != 0 && !ffn.is_multiple_of(run) {
        return Err(GpuError::Other(format!(
            "gate and up in runs of {run} need an FFN size that is a multiple of it, not {ffn}"
        )));
    }
    // SAFETY (kernel): gate_up holds n rows of 2 ffn, act n rows of ffn.
    gpu.launch(
        "silu_mul",
        elementwise(n * ffn),
        &[&gate_up, &act, &(ffn as i32), &(run as i32), &(n as u64)],
    )
}

/// `out[b]` = the index of row b's largest logit (the lowest among ties),
/// for `count` rows of `vocab` (a multiple of 4).
pub fn argmax_rows(
    gpu: &Gpu,
    logits: DevPtr,
    out: DevPtr,
    count: usize,
    vocab: usize,
) -> Result<(), GpuError> {
    // SAFETY (kernel): logits holds count rows of vocab, out count ints.
    gpu.launch(
        "argmax_rows",
        grid((count as u32, 1, 1), 1024, 0),
        &[&logits, &(vocab as i32), &out],
    )
}
