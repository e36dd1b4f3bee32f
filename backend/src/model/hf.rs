//! Hugging Face model folders: `config.json`, `*.safetensors` (F32, F16 or
//! BF16), `tokenizer.json`, and the chat template from `tokenizer_config.json`.

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use super::config::LlamaConfig;
use super::llama::{Llama, Naming, TensorSource};
use crate::compute::cpu::Weight;
use crate::compute::fp4::{Fp4Format, Fp4Matrix};

/// The fields of a Llama-family `config.json` that the forward pass needs.
#[derive(Debug, Deserialize)]
struct HfConfig {
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: usize,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    #[serde(default = "default_eps")]
    rms_norm_eps: f32,
    #[serde(default)]
    architectures: Vec<String>,
}

fn default_theta() -> f32 {
    10_000.0
}
fn default_eps() -> f32 {
    1e-6
}

impl HfConfig {
    fn llama(&self) -> LlamaConfig {
        LlamaConfig {
            n_layers: self.num_hidden_layers,
            hidden: self.hidden_size,
            ffn: self.intermediate_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads.max(1)),
            vocab: self.vocab_size,
            context: self.max_position_embeddings,
            rope_theta: self.rope_theta,
            rms_eps: self.rms_norm_eps,
        }
    }
}

/// Every tensor of a folder's safetensors files, dequantized on request.
struct Shards {
    /// (file bytes, tensor names in that file)
    files: Vec<Vec<u8>>,
    index: HashMap<String, usize>,
}

impl TensorSource for Shards {
    fn tensor(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), String> {
        let &file = self.index.get(name).ok_or("missing")?;
        let st = SafeTensors::deserialize(&self.files[file]).map_err(|e| e.to_string())?;
        let view = st.tensor(name).map_err(|e| e.to_string())?;
        let bytes = view.data();
        let data = match view.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(format!(
                    "dtype {other:?} is not supported (F32, F16, BF16 are)"
                ));
            }
        };
        Ok((data, view.shape().to_vec()))
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Pre-quantized FP4: NVIDIA ModelOpt's NVFP4 (`<name>`, `<name>_scale`,
    /// `<name>_scale_2`) or gpt-oss's MXFP4 (`<base>_blocks`, `<base>_scales`
    /// for `<base>.weight`).
    fn quantized(&self, name: &str, rows: usize, cols: usize) -> Option<Result<Weight, String>> {
        if self.has(&format!("{name}_scale")) {
            return Some(self.nvfp4(name, rows, cols).map(Weight::Fp4));
        }
        let base = name.strip_suffix(".weight")?;
        if self.has(&format!("{base}_blocks")) {
            return Some(self.mxfp4(base, rows, cols).map(Weight::Fp4));
        }
        None
    }
}

impl Shards {
    /// A tensor's dtype, shape and bytes.
    fn raw(&self, name: &str) -> Result<(Dtype, Vec<usize>, Vec<u8>), String> {
        let &file = self
            .index
            .get(name)
            .ok_or_else(|| format!("{name}: missing"))?;
        let st = SafeTensors::deserialize(&self.files[file]).map_err(|e| e.to_string())?;
        let view = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
        Ok((view.dtype(), view.shape().to_vec(), view.data().to_vec()))
    }

    /// `name` (U8 [rows, cols/2]), `name_scale` (F8_E4M3 [rows, cols/16]) and
    /// `name_scale_2` (F32, one value), as ModelOpt writes NVFP4.
    fn nvfp4(&self, name: &str, rows: usize, cols: usize) -> Result<Fp4Matrix, String> {
        let expect = |what: &str, got: (Dtype, Vec<usize>), want: (Dtype, &[usize])| {
            if got.0 != want.0 || got.1 != want.1 {
                return Err(format!(
                    "{what}: {:?} {:?}, expected {:?} {:?}",
                    got.0, got.1, want.0, want.1
                ));
            }
            Ok(())
        };
        let (dt, shape, codes) = self.raw(name)?;
        expect(name, (dt, shape), (Dtype::U8, &[rows, cols / 2]))?;
        let scale_name = format!("{name}_scale");
        let (dt, shape, scales) = self.raw(&scale_name)?;
        expect(
            &scale_name,
            (dt, shape),
            (Dtype::F8_E4M3, &[rows, cols / 16]),
        )?;
        let global_name = format!("{name}_scale_2");
        let (dt, _, global) = self.raw(&global_name)?;
        if dt != Dtype::F32 || global.len() != 4 {
            return Err(format!("{global_name}: expected one F32"));
        }
        let fp4 = Fp4Matrix {
            rows,
            cols,
            format: Fp4Format::Nvfp4,
            codes,
            scales,
            tensor_scale: f32::from_le_bytes([global[0], global[1], global[2], global[3]]),
        };
        if !cols.is_multiple_of(16) {
            return Err(format!("{name}: {cols} columns are not whole blocks of 16"));
        }
        Ok(fp4)
    }

    /// `base_blocks` (U8 [rows, cols/32, 16]) and `base_scales` (E8M0 as U8
    /// [rows, cols/32]), as gpt-oss writes MXFP4.
    fn mxfp4(&self, base: &str, rows: usize, cols: usize) -> Result<Fp4Matrix, String> {
        let blocks_name = format!("{base}_blocks");
        let (dt, shape, codes) = self.raw(&blocks_name)?;
        if dt != Dtype::U8 || shape != [rows, cols / 32, 16] || !cols.is_multiple_of(32) {
            return Err(format!(
                "{blocks_name}: {dt:?} {shape:?}, expected U8 [{rows}, {}, 16]",
                cols / 32
            ));
        }
        let scales_name = format!("{base}_scales");
        let (dt, shape, scales) = self.raw(&scales_name)?;
        if dt != Dtype::U8 || shape != [rows, cols / 32] {
            return Err(format!(
                "{scales_name}: {dt:?} {shape:?}, expected U8 [{rows}, {}]",
                cols / 32
            ));
        }
        Ok(Fp4Matrix {
            rows,
            cols,
            format: Fp4Format::Mxfp4,
            codes,
            scales,
            tensor_scale: 1.0,
        })
    }
}

/// Loads the weights of a Hugging Face Llama-family folder.
pub fn load_llama(dir: &Path) -> Result<Llama, String> {
    let read = |name: &str| {
        std::fs::read(dir.join(name)).map_err(|e| format!("{}: {e}", dir.join(name).display()))
    };
    let config: HfConfig =
        serde_json::from_slice(&read("config.json")?).map_err(|e| format!("config.json: {e}"))?;
    if let Some(arch) = config.architectures.first()
        && !arch.contains("Llama")
        && !arch.contains("Mistral")
    {
        return Err(format!("architecture {arch} is not a Llama-family model"));
    }
    let mut files = Vec::new();
    let mut index = HashMap::new();
    let mut paths: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(format!("no .safetensors files in {}", dir.display()));
    }
    for path in paths {
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let names: Vec<String> = SafeTensors::deserialize(&bytes)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .names()
            .into_iter()
            .map(str::to_string)
            .collect();
        for n in names {
            index.insert(n, files.len());
        }
        files.push(bytes);
    }
    Llama::from_source(
        config.llama(),
        &Shards { files, index },
        Naming::HuggingFace,
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use safetensors::tensor::TensorView;

    use super::*;
    use crate::kv::KvStorage;
    use crate::model::gguf::{Gguf, tests::build};
    use crate::model::{Logits, SeqChunk, Tokenizer};

    /// A made-up weight: (HF name, GGUF name, shape, values, is Q or K).
    type Weight = (String, String, Vec<usize>, Vec<f32>, bool);

    fn weights() -> Vec<Weight> {
        let (h, kv, ffn, vocab) = (8, 4, 16, 32);
        let mut seed = 1u64;
        let mut values = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.8
                })
                .collect()
        };
        let mut w = vec![
            (
                "model.embed_tokens.weight".into(),
                "token_embd.weight".into(),
                vec![vocab, h],
                values(vocab * h),
                false,
            ),
            (
                "model.norm.weight".into(),
                "output_norm.weight".into(),
                vec![h],
                values(h),
                false,
            ),
        ];
        for i in 0..2 {
            for (hf, gg, shape, qk) in [
                ("input_layernorm", "attn_norm", vec![h], false),
                ("self_attn.q_proj", "attn_q", vec![h, h], true),
                ("self_attn.k_proj", "attn_k", vec![kv, h], true),
                ("self_attn.v_proj", "attn_v", vec![kv, h], false),
                ("self_attn.o_proj", "attn_output", vec![h, h], false),
                ("post_attention_layernorm", "ffn_norm", vec![h], false),
                ("mlp.gate_proj", "ffn_gate", vec![ffn, h], false),
                ("mlp.up_proj", "ffn_up", vec![ffn, h], false),
                ("mlp.down_proj", "ffn_down", vec![h, ffn], false),
            ] {
                let n = shape.iter().product();
                w.push((
                    format!("model.layers.{i}.{hf}.weight"),
                    format!("blk.{i}.{gg}.weight"),
                    shape,
                    values(n),
                    qk,
                ));
            }
        }
        w
    }

    /// The inverse of the loader's reordering: adjacent pairs to rotate-half.
    fn to_rotate_half(data: &[f32], rows: usize, cols: usize, head_dim: usize) -> Vec<f32> {
        let mut out = vec![0.0; data.len()];
        let half = head_dim / 2;
        for r in 0..rows {
            let (head, within) = (r / head_dim, r % head_dim);
            let from = head * head_dim
                + if within < half {
                    2 * within
                } else {
                    2 * (within - half) + 1
                };
            out[r * cols..(r + 1) * cols].copy_from_slice(&data[from * cols..(from + 1) * cols]);
        }
        out
    }

    fn write_hf(dir: &Path) {
        let weights = weights();
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = weights
            .iter()
            .map(|(hf, _, shape, v, qk)| {
                let v = if *qk {
                    to_rotate_half(v, shape[0], shape[1], 4)
                } else {
                    v.clone()
                };
                (
                    hf.clone(),
                    shape.clone(),
                    v.iter().flat_map(|f| f.to_le_bytes()).collect(),
                )
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = bytes
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
                )
            })
            .collect();
        std::fs::write(
            dir.join("model.safetensors"),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 32, "max_position_embeddings": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        });
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let vocab: HashMap<String, u32> = (0..32u32)
            .map(|i| match i {
                30 => ("<s>".to_string(), i),
                31 => ("</s>".to_string(), i),
                _ => (format!("t{i}"), i),
            })
            .collect();
        let model = tokenizers::models::wordlevel::WordLevel::builder()
            .vocab(vocab.into_iter().collect())
            .unk_token("t0".into())
            .build()
            .unwrap();
        let mut tok = tokenizers::Tokenizer::new(model);
        tok.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace));
        tok.save(dir.join("tokenizer.json"), false).unwrap();
        let tc = serde_json::json!({"bos_token": "<s>", "eos_token": {"content": "</s>"},
            "chat_template": "{% for m in messages %}{{ m.content }} {% endfor %}"});
        std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    }

    fn gguf_of_same_weights() -> Gguf {
        let u32v = |v: u32| v.to_le_bytes().to_vec();
        let f32v = |v: f32| v.to_le_bytes().to_vec();
        let mut arch = Vec::new();
        arch.extend(5u64.to_le_bytes());
        arch.extend(b"llama");
        let meta = vec![
            ("general.architecture", 8, arch),
            ("llama.block_count", 4, u32v(2)),
            ("llama.embedding_length", 4, u32v(8)),
            ("llama.feed_forward_length", 4, u32v(16)),
            ("llama.attention.head_count", 4, u32v(2)),
            ("llama.attention.head_count_kv", 4, u32v(1)),
            ("llama.context_length", 4, u32v(64)),
            ("llama.vocab_size", 4, u32v(32)),
            ("llama.rope.freq_base", 6, f32v(10000.0)),
            ("llama.attention.layer_norm_rms_epsilon", 6, f32v(1e-5)),
        ];
        let weights = weights();
        let tensors: Vec<(String, Vec<u64>, Vec<u8>)> = weights
            .iter()
            .map(|(_, gg, shape, v, _)| {
                let dims = shape.iter().rev().map(|&d| d as u64).collect();
                (
                    gg.clone(),
                    dims,
                    v.iter().flat_map(|f| f.to_le_bytes()).collect(),
                )
            })
            .collect();
        let refs: Vec<(&str, &[u64], u32, Vec<u8>)> = tensors
            .iter()
            .map(|(n, d, b)| (n.as_str(), d.as_slice(), 0, b.clone()))
            .collect();
        Gguf::parse(build(&meta, &refs)).unwrap()
    }

    #[test]
    fn a_hugging_face_folder_gives_the_same_logits_as_the_gguf() {
        let dir = std::env::temp_dir().join(format!("sluice-hf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_hf(&dir);
        let hf = load_llama(&dir).unwrap();
        let gguf = Llama::from_gguf(&gguf_of_same_weights()).unwrap();
        assert_eq!(hf.config, gguf.config);
        let tokens = [3u32, 17, 5, 9, 28, 1];
        let run = |m: &Llama| {
            let mut kv = KvStorage::new(2, 1, 16, m.config.kv_dim());
            m.forward(
                &mut kv,
                &[SeqChunk {
                    tokens: &tokens,
                    start: 0,
                    block_table: &[0],
                    logits: Logits::All,
                }],
            )
            .remove(0)
        };
        let (a, b) = (run(&hf), run(&gguf));
        assert_eq!(a.len(), tokens.len() * 32);
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(diff < 1e-5, "HF and GGUF logits differ by {diff}");

        let tok = Tokenizer::from_hf_dir(&dir).unwrap();
        assert_eq!((tok.bos, tok.eos), (Some(30), 31));
        assert_eq!(tok.encode("t3 t17").unwrap(), vec![3, 17]);
        let loaded = crate::model::load(&dir).unwrap();
        assert!(loaded.name.starts_with("sluice-hf-"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn pre_quantized_fp4_tensors_load_as_written() {
        let (rows, cols) = (4, 64);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
            .collect();
        let nv = Fp4Matrix::quantize(Fp4Format::Nvfp4, rows, cols, &values).unwrap();
        let mx = Fp4Matrix::quantize(Fp4Format::Mxfp4, rows, cols, &values).unwrap();
        let global = nv.tensor_scale.to_le_bytes();
        let tensors: Vec<(&str, Dtype, Vec<usize>, &[u8])> = vec![
            ("a.weight", Dtype::U8, vec![rows, cols / 2], &nv.codes),
            (
                "a.weight_scale",
                Dtype::F8_E4M3,
                vec![rows, cols / 16],
                &nv.scales,
            ),
            ("a.weight_scale_2", Dtype::F32, vec![], &global),
            ("b_blocks", Dtype::U8, vec![rows, cols / 32, 16], &mx.codes),
            ("b_scales", Dtype::U8, vec![rows, cols / 32], &mx.scales),
        ];
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, dt, shape, bytes)| {
                (
                    n.to_string(),
                    TensorView::new(*dt, shape.clone(), bytes).unwrap(),
                )
            })
            .collect();
        let shards = Shards {
            files: vec![safetensors::serialize(views, None).unwrap()],
            index: tensors.iter().map(|t| (t.0.to_string(), 0)).collect(),
        };
        assert_eq!(
            shards.quantized("a.weight", rows, cols),
            Some(Ok(crate::compute::cpu::Weight::Fp4(nv)))
        );
        assert_eq!(
            shards.quantized("b.weight", rows, cols),
            Some(Ok(crate::compute::cpu::Weight::Fp4(mx)))
        );
        // The wrong shape is refused with the tensor's name; plain tensors are
        // not FP4.
        let err = shards.quantized("a.weight", rows, 32).unwrap().unwrap_err();
        assert!(err.contains("a.weight"), "{err}");
        assert!(shards.quantized("b.weight", 2, cols).unwrap().is_err());
        assert_eq!(shards.quantized("c.weight", rows, cols), None);
    }

    #[test]
    fn a_folder_without_weights_is_refused_clearly() {
        let dir = std::env::temp_dir().join(format!("sluice-hf-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 4, "max_position_embeddings": 8}"#).unwrap();
        assert!(load_llama(&dir).unwrap_err().contains("no .safetensors"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
