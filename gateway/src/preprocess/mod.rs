//! The preprocess stage: the OpenAI layer shared with the worker turns a body
//! into token ids (chat template + tokenizer of the served model), then the
//! gateway adds who is asking (tenant, session, priority), the cache policy's
//! hints, and the prompt's KV block hashes: everything admission and routing
//! look at, computed once per request.

use sluice_backend::kv::hash::block_hashes;
use sluice_backend::server::openai::Prepared;

use crate::policy::{CachePolicy, Hop, RequestView};

/// Who sent a request, from its headers and API key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Caller {
    /// From the API key; 0 = anonymous.
    pub tenant_id: u32,
    /// `X-Session-Id`, else the body's `user`.
    pub session: Option<String>,
    /// `X-Priority`; 0 = normal.
    pub priority: i32,
}

/// A request ready for admission and routing.
#[derive(Debug)]
pub struct Preprocessed {
    pub prepared: Prepared,
    pub view: RequestView,
    /// Sequence hashes of the prompt's whole blocks (salted per the cache policy).
    pub hashes: Vec<u64>,
}

/// A session id's hash as policies see it; 0 means "no session".
pub fn session_hash(session: Option<&str>) -> u64 {
    session
        .filter(|s| !s.is_empty())
        .map_or(0, |s| xxhash_rust::xxh3::xxh3_64(s.as_bytes()).max(1))
}

/// Builds the request's view, asks the cache policy for its hints, and hashes
/// the prompt's blocks the way the workers do.
pub fn preprocess(
    mut prepared: Prepared,
    caller: &Caller,
    block_size: u32,
    cache: &dyn CachePolicy,
) -> Preprocessed {
    let prompt_tokens = prepared.generate.prompt.len() as u32;
    let session = caller.session.as_deref().or(prepared.user.as_deref());
    let view = RequestView {
        prompt_tokens,
        prompt_blocks: prompt_tokens / block_size,
        block_size,
        max_tokens: prepared.generate.max_tokens,
        session_hash: session_hash(session),
        tenant_id: caller.tenant_id,
        priority: caller.priority,
        hop: Hop::Aggregated,
    };
    let hints = cache.hints(&view);
    let generate = &mut prepared.generate;
    generate.cache_salt = hints.salt;
    generate.cache_priority = hints.retention_priority;
    generate.tenant_id = caller.tenant_id;
    let hashes = block_hashes(&generate.prompt, block_size as usize, hints.salt);
    Preprocessed {
        prepared,
        view,
        hashes,
    }
}

#[cfg(test)]
mod tests {
    use sluice_backend::engine::GenerateRequest;
    use sluice_backend::server::openai::{Kind, Reply};

    use super::*;
    use crate::policy::LruCache;

    fn prepared(prompt: Vec<u32>, user: Option<&str>) -> Prepared {
        Prepared {
            generate: GenerateRequest::new(prompt, 8),
            reply: Reply {
                kind: Kind::Chat,
                stream: false,
                include_usage: false,
                logprobs: false,
            },
            user: user.map(Into::into),
        }
    }

    #[test]
    fn view_hashes_and_salt_follow_the_caller() {
        let prompt: Vec<u32> = (0..40).collect();
        let anon = preprocess(
            prepared(prompt.clone(), None),
            &Caller::default(),
            16,
            &LruCache,
        );
        assert_eq!(anon.view.prompt_blocks, 2);
        assert_eq!(anon.hashes, block_hashes(&prompt, 16, 0));
        assert_eq!(anon.view.session_hash, 0);
        let caller = Caller {
            tenant_id: 3,
            session: None,
            priority: 2,
        };
        let tenant = preprocess(prepared(prompt.clone(), Some("u1")), &caller, 16, &LruCache);
        assert_ne!(
            tenant.hashes, anon.hashes,
            "tenants do not share cache entries"
        );
        assert_eq!(
            tenant.prepared.generate.cache_salt,
            crate::policy::tenant_salt(3)
        );
        assert_eq!(
            tenant.view.session_hash,
            session_hash(Some("u1")),
            "user is the fallback session"
        );
        let header = Caller {
            session: Some("s9".into()),
            ..caller
        };
        let by_header = preprocess(prepared(prompt, Some("u1")), &header, 16, &LruCache);
        assert_eq!(by_header.view.session_hash, session_hash(Some("s9")));
        assert_eq!(by_header.view.priority, 2);
    }
}
