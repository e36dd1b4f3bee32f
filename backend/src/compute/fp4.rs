//! FP4 weights. Both formats hold E2M1 values (1 sign, 2 exponent, 1 mantissa
//! bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two to a byte with
//! element 2i in the low nibble, and a scale per block of a row:
//! - MXFP4 (OCP Microscaling v1.0): blocks of 32, an E8M0 scale (a power of
//!   two, 2^(e - 127)); the scale is 2^(floor(log2(amax)) - 2), 2 being
//!   E2M1's largest exponent, and elements above 6 after scaling saturate.
//! - NVFP4: blocks of 16, an E4M3 scale (bias 7, max 448, no infinities),
//!   times one fp32 scale for the tensor: tensor = amax / (6 * 448), block =
//!   E4M3(amax_block / 6 / tensor), as NVIDIA's ModelOpt writes them
//!   (`weight_scale` and `weight_scale_2`).
//!
//! Elements round to nearest, ties to even, on the E2M1 grid. This module is
//! the quantizer and the CPU reference (dequantize, multiply); GPU kernels
//! must agree with it.

/// The 16 E2M1 codes' values (code bit 3 is the sign).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The E2M1 code of `x`, rounded to nearest even, saturating at ±6 (NaN → 0).
pub fn e2m1_encode(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 8 } else { 0 };
    let a = x.abs();
    // Midpoints between neighbours; at a tie the even code (mantissa 0) wins.
    let code = if a.is_nan() || a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if code == 0 { 0 } else { sign | code }
}

/// An E8M0 scale's value: 2^(e - 127); 255 is NaN.
pub fn e8m0_decode(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        0 => f32::from_bits(0x0040_0000), // 2^-127, a subnormal
        e => f32::from_bits(u32::from(e) << 23),
    }
}

/// An E4M3 (the "fn" variant: no infinities, 0x7f and 0xff are NaN) value.
pub fn e4m3_decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0x0f), f32::from(b & 0x07));
    if e == 15 && m == 7.0 {
        return f32::NAN;
    }
    sign * if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// The E4M3 code of `x` (x >= 0), rounded to nearest even, saturating at 448.
pub fn e4m3_encode_positive(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    // The 127 finite non-negative codes are in increasing order of value.
    let (mut lo, mut hi) = (0u8, 0x7e_u8);
    if x >= e4m3_decode(hi) {
        return hi;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if e4m3_decode(mid) <= x {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (a, b) = (e4m3_decode(lo), e4m3_decode(hi));
    match (x - a).partial_cmp(&(b - x)) {
        Some(std::cmp::Ordering::Less) => lo,
        Some(std::cmp::Ordering::Greater) => hi,
        _ => {
            if lo.is_multiple_of(2) {
                lo
            } else {
                hi
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp4Format {
    Mxfp4,
    Nvfp4,
}

impl Fp4Format {
    /// Its name as `--weights` spells it ("mxfp4", "nvfp4").
    pub fn name(self) -> &'static str {
        match self {
            Fp4Format::Mxfp4 => "mxfp4",
            Fp4Format::Nvfp4 => "nvfp4",
        }
    }

    /// Elements per scale.
    pub fn block(self) -> usize {
        match self {
            Fp4Format::Mxfp4 => 32,
            Fp4Format::Nvfp4 => 16,
        }
    }

    fn scale_value(self, code: u8) -> f32 {
        match self {
            Fp4Format::Mxfp4 => e8m0_decode(code),
            Fp4Format::Nvfp4 => e4m3_decode(code),
        }
    }
}

/// A `rows x cols` weight in FP4.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp4Matrix {
    pub rows: usize,
    pub cols: usize,
    pub format: Fp4Format,
    /// rows * cols / 2 bytes; element 2i in the low nibble of byte i.
    pub codes: Vec<u8>,
    /// One scale code per block, row-major (rows * cols / block).
    pub scales: Vec<u8>,
    /// NVFP4's fp32 tensor scale (1 for MXFP4).
    pub tensor_scale: f32,
}

impl Fp4Matrix {
    /// Quantizes row-major f32 weights.
    pub fn quantize(
        format: Fp4Format,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> Result<Fp4Matrix, String> {
        let block = format.block();
        if !cols.is_multiple_of(block) {
            return Err(format!("{cols} columns are not whole blocks of {block}"));
        }
        if data.len() != rows * cols {
            return Err(format!("{} values for {rows} x {cols}", data.len()));
        }
        if let Some(bad) = data.iter().find(|v| !v.is_finite()) {
            return Err(format!("a weight is {bad}"));
        }
        let tensor_scale = match format {
            Fp4Format::Mxfp4 => 1.0,
            Fp4Format::Nvfp4 => {
                let amax = data.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                if amax > 0.0 {
                    amax / (6.0 * 448.0)
                } else {
                    1.0
                }
            }
        };
        let mut scales = Vec::with_capacity(data.len() / block);
        let mut codes = vec![0u8; data.len() / 2];
        for (b, values) in data.chunks_exact(block).enumerate() {
            let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let scale_code = match format {
                Fp4Format::Mxfp4 => {
                    if amax == 0.0 {
                        0
                    } else {
                        // floor(log2(amax)) - 2, as a biased E8M0 exponent.
                        let exp = amax.log2().floor() as i32 - 2;
                        (exp + 127).clamp(0, 254) as u8
                    }
                }
                Fp4Format::Nvfp4 => e4m3_encode_positive(amax / 6.0 / tensor_scale),
            };
            scales.push(scale_code);
            let step = format.scale_value(scale_code) * tensor_scale;
            for (i, &v) in values.iter().enumerate() {
                let q = if step > 0.0 { e2m1_encode(v / step) } else { 0 };
                let at = b * block + i;
                codes[at / 2] |= q << (4 * (at % 2));
            }
        }
        Ok(Fp4Matrix {
            rows,
            cols,
            format,
            codes,
            scales,
            tensor_scale,
        })
    }

    /// Row `r`, dequantized into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let block = self.format.block();
        let first = r * self.cols;
        for (b, chunk) in out[..self.cols].chunks_exact_mut(block).enumerate() {
            let at = first + b * block;
            let step = self.format.scale_value(self.scales[at / block]) * self.tensor_scale;
            for (i, o) in chunk.iter_mut().enumerate() {
                let byte = self.codes[(at + i) / 2];
                let code = if (at + i).is_multiple_of(2) {
                    byte & 0x0f
                } else {
                    byte >> 4
                };
                *o = E2M1[code as usize] * step;
            }
        }
    }

    /// The whole matrix, dequantized (row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }

    /// The same weight with row `r` moved to row `to(r)` (a permutation):
    /// blocks lie within rows, so codes and scales move whole.
    pub fn permute_rows(&self, to: impl Fn(usize) -> usize) -> Fp4Matrix {
        let (code_row, scale_row) = (self.cols / 2, self.cols / self.format.block());
        let mut out = self.clone();
        for r in 0..self.rows {
            let t = to(r);
            out.codes[t * code_row..(t + 1) * code_row]
                .copy_from_slice(&self.codes[r * code_row..(r + 1) * code_row]);
            out.scales[t * scale_row..(t + 1) * scale_row]
                .copy_from_slice(&self.scales[r * scale_row..(r + 1) * scale_row]);
        }
        out
    }

    /// Rows `start .. start + count` as a matrix of their own (the same
    /// tensor scale).
    pub fn row_range(&self, start: usize, count: usize) -> Fp4Matrix {
        let (code_row, scale_row) = (self.cols / 2, self.cols / self.format.block());
        Fp4Matrix {
            rows: count,
            codes: self.codes[start * code_row..(start + count) * code_row].to_vec(),
            scales: self.scales[start * scale_row..(start + count) * scale_row].to_vec(),
            ..*self
        }
    }

    /// Bytes stored: codes and scales (and the tensor scale).
    pub fn bytes(&self) -> usize {
        self.codes.len() + self.scales.len() + 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_e2m1_code_round_trips() {
        for code in 0..16u8 {
            let v = E2M1[code as usize];
            // -0 encodes as +0.
            let want = if code == 8 { 0 } else { code };
            assert_eq!(e2m1_encode(v), want, "code {code} ({v})");
        }
    }

    #[test]
    fn e2m1_rounds_to_nearest_even_and_saturates() {
        // Ties go to the even code (mantissa 0).
        for (x, want) in [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (0.26, 0.5),
            (2.6, 3.0),
            (5.1, 6.0),
            (7.0, 6.0),
            (1e9, 6.0),
            (-2.5, -2.0),
            (-0.1, 0.0),
        ] {
            assert_eq!(E2M1[e2m1_encode(x) as usize], want, "{x}");
        }
        assert_eq!(e2m1_encode(f32::NAN), 0);
    }

    #[test]
    fn scale_codes_decode() {
        assert_eq!(e8m0_decode(127), 1.0);
        assert_eq!(e8m0_decode(130), 8.0);
        assert_eq!(e8m0_decode(1), 2f32.powi(-126));
        assert_eq!(e8m0_decode(0), 2f32.powi(-127));
        assert!(e8m0_decode(255).is_nan());
        assert_eq!(e4m3_decode(0x38), 1.0); // e = 7, m = 0
        assert_eq!(e4m3_decode(0x7e), 448.0); // largest finite
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_decode(0xb8), -1.0);
        assert!(e4m3_decode(0x7f).is_nan());
        for b in 0..0x7f_u8 {
            assert_eq!(e4m3_encode_positive(e4m3_decode(b)), b, "code {b:#x}");
        }
        assert_eq!(e4m3_encode_positive(1000.0), 0x7e); // saturates
        // 1.0625 is halfway between 1.0 (0x38, even) and 1.125 (0x39).
        assert_eq!(e4m3_encode_positive(1.0625), 0x38);
        assert_eq!(e4m3_encode_positive(1.1875), 0x3a); // 1.125|1.25: 0x3a is even
    }

    #[test]
    fn mxfp4_blocks_by_hand() {
        // amax 5 -> floor(log2 5) - 2 = 0 -> scale 1: the grid itself.
        let mut row = vec![0.0f32; 32];
        row[..8].copy_from_slice(&[0.5, -1.0, 1.4, 5.0, 2.5, -3.2, 0.2, 4.6]);
        let m = Fp4Matrix::quantize(Fp4Format::Mxfp4, 1, 32, &row).unwrap();
        assert_eq!(m.scales, [127]);
        // Element 0 in the low nibble: 0.5 = code 1, -1 = code 10 (0xa).
        assert_eq!(m.codes[0], 0xa1);
        let d = m.dequantize();
        assert_eq!(&d[..8], &[0.5, -1.0, 1.5, 4.0, 2.0, -3.0, 0.0, 4.0]);
        // amax 48 -> 5 - 2 = 3 -> scale 8; 47 / 8 = 5.875 -> 6 -> 48.
        let mut row = vec![1.0f32; 32];
        row[0] = 47.0;
        let m = Fp4Matrix::quantize(Fp4Format::Mxfp4, 1, 32, &row).unwrap();
        assert_eq!(m.scales, [130]);
        assert_eq!(m.dequantize()[..2], [48.0, 0.0]); // 1 / 8 = 0.125 -> 0
        // amax 7.9: floor(log2 7.9) = 2 -> scale 1, and 7.9 saturates to 6
        // (the spec's floor scale clips the top of the block); an all-zero
        // block gets the smallest scale and zeros.
        let mut rows = vec![0.0f32; 64];
        rows[0] = 7.9;
        let m = Fp4Matrix::quantize(Fp4Format::Mxfp4, 2, 32, &rows).unwrap();
        assert_eq!(m.scales, [127, 0]);
        assert_eq!(m.dequantize()[0], 6.0);
        assert!(m.dequantize()[32..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn nvfp4_blocks_by_hand() {
        // amax 6 * 448 = 2688 -> tensor scale 1; block of amax 6 -> E4M3(1).
        let mut data = vec![0.0f32; 32];
        data[0] = 2688.0;
        data[16..20].copy_from_slice(&[6.0, -3.0, 0.7, 1.3]);
        let m = Fp4Matrix::quantize(Fp4Format::Nvfp4, 1, 32, &data).unwrap();
        assert_eq!(m.tensor_scale, 1.0);
        assert_eq!(m.scales, [0x7e, 0x38]); // 448, 1.0
        let d = m.dequantize();
        assert_eq!(d[0], 2688.0);
        assert_eq!(&d[16..20], &[6.0, -3.0, 0.5, 1.5]);
        // Packing: element 16 (6 = code 7) low, element 17 (-3 = 0xd) high.
        assert_eq!(m.codes[8], 0xd7);
    }

    #[test]
    fn permuting_rows_moves_their_values() {
        let data: Vec<f32> = (0..3 * 32).map(|i| i as f32 / 10.0).collect();
        let m = Fp4Matrix::quantize(Fp4Format::Nvfp4, 3, 32, &data).unwrap();
        let p = m.permute_rows(|r| (r + 1) % 3);
        let (a, b) = (m.dequantize(), p.dequantize());
        for r in 0..3 {
            let t = (r + 1) % 3;
            assert_eq!(a[r * 32..(r + 1) * 32], b[t * 32..(t + 1) * 32]);
        }
    }

    #[test]
    fn quantization_error_is_bounded() {
        // Values spread over several magnitudes.
        let data: Vec<f32> = (0..64 * 64)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 + i % 5) as f32)
            .collect();
        for format in [Fp4Format::Mxfp4, Fp4Format::Nvfp4] {
            let m = Fp4Matrix::quantize(format, 64, 64, &data).unwrap();
            let d = m.dequantize();
            let block = format.block();
            for (b, (orig, deq)) in data.chunks(block).zip(d.chunks(block)).enumerate() {
                let amax = orig.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for (o, q) in orig.iter().zip(deq) {
                    // The coarsest E2M1 step (4 -> 6) is a third of 6, so no
                    // element is off by more than amax / 3 (plus the scale's
                    // own rounding for NVFP4).
                    assert!(
                        (o - q).abs() <= amax / 3.0 * 1.07 + 1e-6,
                        "{format:?} block {b}: {o} -> {q}"
                    );
                }
            }
            assert_eq!(m.bytes(), 64 * 64 / 2 + 64 * 64 / block + 4);
        }
        assert!(Fp4Matrix::quantize(Fp4Format::Nvfp4, 1, 24, &[0.0; 24]).is_err());
        assert!(Fp4Matrix::quantize(Fp4Format::Mxfp4, 1, 32, &[f32::NAN; 32]).is_err());
    }
}
