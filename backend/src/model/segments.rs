//! Tokenizing a prompt in segments: the text is cut at added tokens
//! (`<|im_start|>`, ...), which `tokenizers` also does before anything else,
//! so each segment's ids do not depend on its neighbours. Long segments — a
//! chat's system prompt, earlier turns of a conversation — come back request
//! after request, so their ids are kept in a bounded two-generation cache.

use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};

use super::byte_level::ByteLevelEncoder;
use super::generations::Generations;

/// Segments shorter than this are tokenized every time (cheap, and unlikely
/// to repeat usefully).
const MIN_CACHED_BYTES: usize = 32;
/// Entries per generation; at most twice this many are kept.
const GENERATION_ENTRIES: usize = 4096;
/// Bytes (text plus ids) per generation: clients choose what is cached, so
/// the cache is bounded by size too (at most twice this is kept).
const GENERATION_BYTES: usize = 16 << 20;
/// A segment larger than this is not cached at all.
const MAX_CACHED_BYTES: usize = GENERATION_BYTES / 8;

/// Finds added tokens and remembers the ids of long segments.
pub struct SegmentEncoder {
    matcher: AhoCorasick,
    /// Pattern index -> token id.
    ids: Vec<u32>,
    cache: Mutex<Generations<Box<str>, Arc<[u32]>>>,
    /// The byte-level encoder of each segment.
    byte_level: ByteLevelEncoder,
}

impl std::fmt::Debug for SegmentEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentEncoder")
            .field("added_tokens", &self.ids.len())
            .finish()
    }
}

impl SegmentEncoder {
    /// For `inner`, built here as byte-level BPE (`byte_level`), when
    /// segment-wise encoding gives exactly its ids: no normalizer, and added
    /// tokens matched on the raw text as whole strings. Other pre-tokenizers
    /// may depend on where a segment starts (Metaspace's "first" prefix), so
    /// they get no segments.
    pub fn for_tokenizer(
        inner: &tokenizers::Tokenizer,
        byte_level: ByteLevelEncoder,
    ) -> Option<SegmentEncoder> {
        if inner.get_normalizer().is_some() {
            return None;
        }
        let added = inner.get_added_tokens_decoder();
        if added
            .values()
            .any(|t| t.single_word || t.lstrip || t.rstrip || t.normalized)
        {
            return None;
        }
        let (ids, patterns): (Vec<u32>, Vec<String>) =
            added.iter().map(|(id, t)| (*id, t.content.clone())).unzip();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .ok()?;
        Some(SegmentEncoder {
            matcher,
            ids,
            cache: Mutex::new(Generations::new(
                GENERATION_ENTRIES,
                GENERATION_BYTES,
                |text, ids| text.len() + ids.len() * 4,
            )),
            byte_level,
        })
    }

    /// Appends the ids of `text` to `out`.
    pub fn encode(
        &self,
        text: &str,
        inner: &tokenizers::Tokenizer,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let mut at = 0;
        for m in self.matcher.find_iter(text) {
            self.segment(&text[at..m.start()], inner, out)?;
            out.push(self.ids[m.pattern().as_usize()]);
            at = m.end();
        }
        self.segment(&text[at..], inner, out)
    }

    fn segment(
        &self,
        text: &str,
        inner: &tokenizers::Tokenizer,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        if text.len() < MIN_CACHED_BYTES || text.len() > MAX_CACHED_BYTES {
            return self.encode_segment(text, inner, out);
        }
        if let Some(ids) = self.lookup(text) {
            out.extend_from_slice(&ids);
            return Ok(());
        }
        let from = out.len();
        self.encode_segment(text, inner, out)?;
        let ids: Arc<[u32]> = out[from..].into();
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(text.into(), ids);
        Ok(())
    }

    fn encode_segment(
        &self,
        text: &str,
        inner: &tokenizers::Tokenizer,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        self.byte_level.encode(text, inner.get_model(), out)
    }

    /// A cached segment; one found in the old generation moves to the new one.
    fn lookup(&self, text: &str) -> Option<Arc<[u32]>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.get_with(text, Arc::clone)
    }
}
