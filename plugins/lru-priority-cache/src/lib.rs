//! LRU with priority: eviction scores are the block's age divided by
//! `1 + priority_weight * priority` and by `1 + hit_weight * ln(1 + hits)`, so old,
//! low-priority, rarely hit blocks go first. Hints isolate tenants (a per-tenant
//! salt) unless `isolate_tenants=false`, pass the request's priority as the
//! retention priority, and ask for the host-memory tier from `host_tier_priority` up.
//!
//! Config: `isolate_tenants=true, ttl_ms=0, priority_weight=4, hit_weight=1,
//! host_tier_priority=2`.

use sluice_plugin_sdk::{
    CacheHints, CachePolicy, Config, EvictionCandidates, RequestView, export_cache_policy,
};

pub struct LruPriority {
    isolate_tenants: bool,
    ttl_ms: u32,
    priority_weight: f32,
    hit_weight: f32,
    host_tier_priority: i32,
}

impl Default for LruPriority {
    fn default() -> Self {
        Self {
            isolate_tenants: true,
            ttl_ms: 0,
            priority_weight: 4.0,
            hit_weight: 1.0,
            host_tier_priority: 2,
        }
    }
}

/// A per-tenant salt (never 0, which means "shared").
fn tenant_salt(tenant: u32) -> u64 {
    let mut z = u64::from(tenant).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)).max(1)
}

impl CachePolicy for LruPriority {
    fn configure(&mut self, config: &str) -> Result<(), String> {
        let mut c = Config::parse(config)?;
        self.isolate_tenants = c.get("isolate_tenants", true)?;
        self.ttl_ms = c.get("ttl_ms", 0)?;
        self.priority_weight = c.get("priority_weight", 4.0)?;
        self.hit_weight = c.get("hit_weight", 1.0)?;
        self.host_tier_priority = c.get("host_tier_priority", 2)?;
        c.finish()?;
        if !(self.priority_weight >= 0.0 && self.hit_weight >= 0.0) {
            return Err("weights must be >= 0".into());
        }
        Ok(())
    }

    fn hints(&mut self, request: &RequestView) -> CacheHints {
        CacheHints {
            salt: if self.isolate_tenants && request.tenant_id != 0 {
                tenant_salt(request.tenant_id)
            } else {
                0
            },
            retention_priority: request.priority.clamp(0, 255) as u8,
            ttl_ms: self.ttl_ms,
            write_host_tier: request.priority >= self.host_tier_priority,
        }
    }

    fn score_eviction(&mut self, c: &EvictionCandidates) -> Vec<f32> {
        c.age_ms
            .iter()
            .zip(&c.priority)
            .zip(&c.hits)
            .map(|((&age, &priority), &hits)| {
                age as f32
                    / (1.0 + self.priority_weight * f32::from(priority))
                    / (1.0 + self.hit_weight * (1.0 + hits as f32).ln())
            })
            .collect()
    }
}

export_cache_policy!(LruPriority);

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_plugin_sdk::testing::{CachePolicyHarness, request};

    fn candidates(rows: &[(u32, u32, u8)]) -> EvictionCandidates {
        EvictionCandidates {
            age_ms: rows.iter().map(|r| r.0).collect(),
            hits: rows.iter().map(|r| r.1).collect(),
            priority: rows.iter().map(|r| r.2).collect(),
            tenant_id: vec![0; rows.len()],
        }
    }

    #[test]
    fn old_cold_low_priority_blocks_go_first() {
        let mut p = CachePolicyHarness::<LruPriority>::new("").unwrap();
        let s = p.score_eviction(&candidates(&[
            (1000, 0, 0),
            (1000, 0, 3),
            (1000, 20, 0),
            (10, 0, 0),
        ]));
        assert!(s[0] > s[1] && s[0] > s[2] && s[0] > s[3], "{s:?}");
        // Priority outweighs age within its factor: 5x older but priority 3 (13x).
        let s = p.score_eviction(&candidates(&[(5000, 0, 3), (1000, 0, 0)]));
        assert!(s[1] > s[0]);
    }

    #[test]
    fn tenants_get_distinct_salts_unless_shared() {
        let mut p = CachePolicyHarness::<LruPriority>::new("").unwrap();
        let (mut a, mut b) = (request(10), request(10));
        (a.tenant_id, b.tenant_id, b.priority) = (1, 2, 5);
        let (ha, hb) = (p.hints(&a), p.hints(&b));
        assert!(ha.salt != 0 && hb.salt != 0 && ha.salt != hb.salt);
        assert_eq!(p.hints(&request(10)).salt, 0, "anonymous requests share");
        assert!(hb.write_host_tier && !ha.write_host_tier);
        assert_eq!(hb.retention_priority, 5);
        let mut shared =
            CachePolicyHarness::<LruPriority>::new("isolate_tenants=false, ttl_ms=500").unwrap();
        assert_eq!(shared.hints(&a).salt, 0);
        assert_eq!(shared.hints(&a).ttl_ms, 500);
    }
}
