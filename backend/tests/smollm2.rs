//! The real model: SmolLM2-135M-Instruct from its GGUF (fetched by `make model`),
//! tokenized, templated and run greedily on the CPU.

mod common;

use sluice_backend::kv::KvStorage;
use sluice_backend::model::{ChatMessage, Gguf, Llama, Logits, SeqChunk, Tokenizer};

fn load() -> (Llama, Tokenizer) {
    let path = common::model_path();
    let gguf = Gguf::open(&path)
        .unwrap_or_else(|e| panic!("{e}. Fetch the model with `make model` (or set SLUICE_MODEL)"));
    (
        Llama::from_gguf(&gguf).unwrap(),
        Tokenizer::from_gguf(&gguf).unwrap(),
    )
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding, one token at a time after a whole-prompt prefill.
fn greedy(model: &Llama, prompt: &[u32], max_new: usize, stop: &[u32]) -> Vec<u32> {
    let block_size = 16;
    let blocks = (prompt.len() + max_new).div_ceil(block_size);
    let mut kv = KvStorage::new(
        model.config.n_layers,
        blocks,
        block_size,
        model.config.kv_dim(),
    );
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut logits = model.forward(
        &mut kv,
        &[SeqChunk {
            tokens: prompt,
            start: 0,
            block_table: &table,
            logits: Logits::Last,
        }],
    );
    let mut out = Vec::new();
    for _ in 0..max_new {
        let next = argmax(&logits[0]);
        if stop.contains(&next) {
            break;
        }
        out.push(next);
        let pos = prompt.len() + out.len() - 1;
        logits = model.forward(
            &mut kv,
            &[SeqChunk {
                tokens: &[next],
                start: pos,
                block_table: &table,
                logits: Logits::Last,
            }],
        );
    }
    out
}

#[test]
fn config_tokenizer_and_template_match_the_model_card() {
    let (model, tok) = load();
    let c = &model.config;
    assert_eq!((c.n_layers, c.hidden, c.ffn), (30, 576, 1536));
    assert_eq!(
        (c.n_heads, c.n_kv_heads, c.head_dim, c.vocab),
        (9, 3, 64, 49152)
    );
    assert_eq!((c.rope_theta, c.context), (100_000.0, 8192));
    assert_eq!((tok.bos, tok.eos, tok.add_bos), (Some(1), 2, false));
    // Digits are split one by one; control tokens are single ids.
    let ids = tok.encode("<|im_start|>2024").unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.len(), 5, "{ids:?}");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>2024");
    let text = tok
        .apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            }],
            true,
        )
        .unwrap();
    assert!(text.starts_with("<|im_start|>system\n"), "{text}");
    assert!(
        text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{text}"
    );
    // The model's template is rendered natively, with minijinja's output.
    assert!(tok.renders_template_natively());
    let conversation = [
        ("system", "Be brief."),
        ("user", "Hi {{ there }}"),
        ("assistant", "Hello!\n"),
        ("user", "é漢🙂"),
    ]
    .map(|(role, content)| ChatMessage {
        role: role.into(),
        content: content.into(),
    });
    for n in 0..=conversation.len() {
        for generation in [false, true] {
            assert_eq!(
                tok.apply_chat_template(&conversation[..n], generation)
                    .unwrap(),
                tok.render_with_minijinja(&conversation[..n], generation)
                    .unwrap()
            );
        }
    }
}

#[test]
fn token_ids_match_llama_cpp_and_round_trip() {
    let (_, tok) = load();
    // Reference ids from llama.cpp's tokenizer on the same GGUF
    // (llama-cpp-python: tokenize(text, add_bos=False, special=True)).
    let cases: [(&str, &[u32]); 4] = [
        ("Hello, world!", &[19556, 28, 905, 17]),
        (
            "In 2024, 365 days",
            &[788, 216, 34, 32, 34, 36, 28, 216, 35, 38, 37, 2009],
        ),
        (
            "naïve café — 東京",
            &[3546, 46494, 37366, 1841, 17097, 247, 126, 16736, 122],
        ),
        ("<|im_start|>user\nHi<|im_end|>", &[1, 4093, 198, 26843, 2]),
    ];
    for (text, ids) in cases {
        assert_eq!(tok.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(tok.decode(ids, false).unwrap(), text, "{text:?} round trip");
    }
}

#[test]
fn greedy_answer_to_the_capital_of_france() {
    let (model, tok) = load();
    let prompt = tok
        .apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: "What is the capital of France?".into(),
            }],
            true,
        )
        .unwrap();
    let ids = tok.encode(&prompt).unwrap();
    let out = greedy(&model, &ids, 24, &tok.stop_ids);
    assert_eq!(
        tok.decode(&out, true).unwrap(),
        "The capital of France is Paris."
    );
}

#[test]
fn chunked_prefill_and_batching_give_the_same_logits() {
    let (model, tok) = load();
    let ids = tok
        .encode("The quick brown fox jumps over the lazy dog because")
        .unwrap();
    let (c, bs) = (&model.config, 4);
    let blocks = ids.len().div_ceil(bs);
    // One sequence, whole prompt at once.
    let mut kv = KvStorage::new(c.n_layers, 2 * blocks, bs, c.kv_dim());
    let t1: Vec<u32> = (0..blocks as u32).collect();
    let whole = model.forward(
        &mut kv,
        &[SeqChunk {
            tokens: &ids,
            start: 0,
            block_table: &t1,
            logits: Logits::Last,
        }],
    );
    // The same prompt in two chunks, the second batched with another sequence.
    let t2: Vec<u32> = (blocks as u32..2 * blocks as u32).rev().collect();
    let split = 5;
    model.forward(
        &mut kv,
        &[SeqChunk {
            tokens: &ids[..split],
            start: 0,
            block_table: &t2,
            logits: Logits::None,
        }],
    );
    // (The other sequence reuses the first table's blocks: `whole` is done.)
    let other = [42u32, 43, 44];
    let both = model.forward(
        &mut kv,
        &[
            SeqChunk {
                tokens: &other,
                start: 0,
                block_table: &t1,
                logits: Logits::All,
            },
            SeqChunk {
                tokens: &ids[split..],
                start: split,
                block_table: &t2,
                logits: Logits::Last,
            },
        ],
    );
    assert_eq!(both[0].len(), 3 * c.vocab);
    let max_diff = whole[0]
        .iter()
        .zip(&both[1])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        max_diff < 1e-3,
        "chunked + batched logits differ by {max_diff}"
    );
    assert_eq!(argmax(&whole[0]), argmax(&both[1]));
}

/// Segment-wise encoding with its cache gives exactly the ids `tokenizers`
/// gives for the whole text: chat prompts (control tokens inside), repeated
/// and near-repeated segments, digits, whitespace runs, unicode, and text
/// that looks like a control token but is not one.
#[test]
fn segment_encoding_equals_whole_text_encoding() {
    let (_, tok) = load();
    let system =
        "You are a helpful assistant named SmolLM, trained by Hugging Face. Answer briefly.";
    let mut texts: Vec<String> = vec![
        String::new(),
        "<|im_start|>".into(),
        "<|im_start|><|im_end|>".into(),
        "<|im_start <|im_end|>x".into(),
        "  leading and trailing spaces   ".into(),
        "tabs\tand\nnewlines\n\n\nend".into(),
        "numbers 1234567890 and 3.14159, 2026-11-30".into(),
        "unicode: héllo wörld — 日本語のテキスト 🚲🚲 ok".into(),
        "<|endoftext|>after the end token".into(),
    ];
    for turn in 0..6 {
        let mut messages = vec![ChatMessage {
            role: "system".into(),
            content: system.into(),
        }];
        for t in 0..=turn {
            messages.push(ChatMessage {
                role: "user".into(),
                content: format!("Question {t}: how do I fix a flat tyre on wheel {}?", t * 7),
            });
            messages.push(ChatMessage {
                role: "assistant".into(),
                content: format!("Answer {t}: take the wheel off, find the hole and patch it.  "),
            });
        }
        texts.push(tok.apply_chat_template(&messages, true).unwrap());
    }
    // Twice: the second pass is served from the cache.
    for pass in 0..2 {
        for text in &texts {
            assert_eq!(
                tok.encode(text).unwrap(),
                tok.encode_uncached(text).unwrap(),
                "pass {pass}: {text:?}"
            );
        }
    }
}

/// Random text from an alphabet chosen to hit every branch of the GPT-2
/// split (contractions, space runs before words and symbols, newlines, other
/// Unicode spaces, letters with combining marks, non-ASCII digits and
/// numerals, emoji): the fast encoder agrees with `tokenizers` on all of it.
#[test]
fn fast_byte_level_encoding_equals_tokenizers_on_random_text() {
    let (_, tok) = load();
    let alphabet: Vec<&str> = vec![
        " ", " ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "a", "b", "z", "Q", "the", " word", "0",
        "7", "42", "'s", "'re", "'ll", "'", "'S", "!", "?", ".", ",", "-", "(", ")", "\"", "é",
        "ß", "日本", "e\u{301}", "🚲", "\u{a0}", "\u{3000}", "Ⅻ", "²", "٣", "<", "|", ">",
        "im_start", "_", "$", "€", "\u{200b}",
    ];
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    for case in 0..3000 {
        let len = next(24);
        let text: String = (0..len).map(|_| alphabet[next(alphabet.len())]).collect();
        assert_eq!(
            tok.encode(&text).unwrap(),
            tok.encode_uncached(&text).unwrap(),
            "case {case}: {text:?}"
        );
    }
}

/// `bench/gguf_without_tensors.py` keeps what a gateway reads of the model
/// (config, tokenizer, chat template) and drops the weights: the copy
/// describes the same model and tokenizes and templates as the original.
#[test]
fn a_gguf_without_its_tensors_serves_the_same_tokenizer() {
    let path = common::model_path();
    let out = std::env::temp_dir().join(format!("sluice-no-tensors-{}.gguf", std::process::id()));
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../bench/gguf_without_tensors.py"
    );
    let status = std::process::Command::new("python3")
        .arg(script)
        .arg(&path)
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("python3 runs");
    assert!(status.success(), "{script} failed");
    let small = std::fs::metadata(&out).unwrap().len();
    let stripped = sluice_backend::model::describe(&out);
    std::fs::remove_file(&out).unwrap();
    let stripped = stripped.unwrap();
    assert!(small < 4 << 20, "{small} bytes");
    // The original's config and tokenizer, from one read of it (no weights built).
    let gguf = Gguf::open(&path).unwrap();
    assert!(gguf.tensors.len() > 200);
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    assert_eq!(
        stripped.config,
        sluice_backend::model::LlamaConfig::from_gguf(&gguf).unwrap()
    );
    let texts = ["<|im_start|>2024", "Hello, world! ¿Qué tal? 漢字 🙂\n\n  x"];
    for text in texts {
        assert_eq!(
            stripped.tokenizer.encode(text).unwrap(),
            tok.encode(text).unwrap(),
            "{text}"
        );
    }
    let messages = [ChatMessage {
        role: "user".into(),
        content: "Hi".into(),
    }];
    assert_eq!(
        stripped
            .tokenizer
            .apply_chat_template(&messages, true)
            .unwrap(),
        tok.apply_chat_template(&messages, true).unwrap()
    );
}
