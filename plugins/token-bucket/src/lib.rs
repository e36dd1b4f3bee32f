//! Token-bucket admission per tenant: each tenant's bucket refills at `rate`
//! tokens per second up to `burst`. A request needs its prompt tokens in the
//! bucket to enter (else 429), and pays them on entry; its output tokens are paid
//! when it completes, so a tenant that generates a lot goes into debt and waits.
//!
//! Config: `rate=10000, burst=40000, max_tenants=10000`.

use sluice_plugin_sdk::collections::HashMap;
use sluice_plugin_sdk::{
    Admission, AdmitDecision, Completion, Config, FleetSaturation, Rejection, RequestView,
    counter_add, export_admission, now_ns,
};

pub struct TokenBucket {
    rate_per_ns: f64,
    burst: f64,
    max_tenants: usize,
    /// tenant -> (tokens, last refill ns).
    buckets: HashMap<u32, (f64, u64)>,
}

impl Default for TokenBucket {
    fn default() -> Self {
        Self {
            rate_per_ns: 10_000.0 / 1e9,
            burst: 40_000.0,
            max_tenants: 10_000,
            buckets: HashMap::default(),
        }
    }
}

impl TokenBucket {
    /// The tenant's bucket, refilled to now.
    fn bucket(&mut self, tenant: u32) -> &mut f64 {
        let now = now_ns();
        if !self.buckets.contains_key(&tenant) && self.buckets.len() >= self.max_tenants {
            // Forget full buckets first: they behave like new ones.
            let burst = self.burst;
            self.buckets.retain(|_, (tokens, _)| *tokens < burst);
        }
        let (rate, burst) = (self.rate_per_ns, self.burst);
        let (tokens, last) = self.buckets.entry(tenant).or_insert((burst, now));
        *tokens = (*tokens + now.saturating_sub(*last) as f64 * rate).min(burst);
        *last = now;
        tokens
    }
}

impl Admission for TokenBucket {
    fn configure(&mut self, config: &str) -> Result<(), String> {
        let mut c = Config::parse(config)?;
        let rate: f64 = c.get("rate", 10_000.0)?;
        self.burst = c.get("burst", rate * 4.0)?;
        self.max_tenants = c.get("max_tenants", 10_000)?;
        c.finish()?;
        if !(rate > 0.0 && rate.is_finite()) {
            return Err(format!("rate must be > 0, got {rate}"));
        }
        if !(self.burst >= 1.0 && self.burst.is_finite()) {
            return Err(format!("burst must be >= 1, got {}", self.burst));
        }
        self.rate_per_ns = rate / 1e9;
        Ok(())
    }

    fn admit(&mut self, request: &RequestView, _saturation: &FleetSaturation) -> AdmitDecision {
        let need = f64::from(request.prompt_tokens);
        let burst = self.burst;
        let tokens = self.bucket(request.tenant_id);
        if *tokens >= need.min(burst) {
            *tokens -= need;
            AdmitDecision::Admit
        } else {
            let short = need.min(burst) - *tokens;
            counter_add("rejected", 1);
            AdmitDecision::Reject(Rejection {
                status: 429,
                message: format!(
                    "tenant {} is over its token rate: {short:.0} more tokens needed",
                    request.tenant_id
                ),
            })
        }
    }

    fn on_complete(&mut self, done: &Completion) {
        *self.bucket(done.tenant_id) -= f64::from(done.output_tokens);
    }
}

export_admission!(TokenBucket);

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_plugin_sdk::Outcome;
    use sluice_plugin_sdk::testing::{self, AdmissionHarness, request, saturation};

    fn tenant_request(tenant: u32, tokens: u32) -> RequestView {
        let mut r = request(tokens);
        r.tenant_id = tenant;
        r
    }

    fn done(tenant: u32, output_tokens: u32) -> Completion {
        Completion {
            tenant_id: tenant,
            session_hash: 0,
            priority: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            output_tokens,
            outcome: Outcome::Success,
            duration_us: 0,
        }
    }

    #[test]
    fn a_tenant_is_limited_without_touching_the_others() {
        testing::set_now_ns(0);
        let mut tb = AdmissionHarness::<TokenBucket>::new("rate=100, burst=300").unwrap();
        let s = saturation();
        assert_eq!(tb.admit(&tenant_request(1, 200), &s), AdmitDecision::Admit);
        let AdmitDecision::Reject(r) = tb.admit(&tenant_request(1, 200), &s) else {
            panic!("tenant 1 has only 100 tokens left")
        };
        assert_eq!(r.status, 429);
        assert_eq!(tb.admit(&tenant_request(2, 200), &s), AdmitDecision::Admit);
        testing::advance_ms(1000); // +100 tokens
        assert_eq!(tb.admit(&tenant_request(1, 200), &s), AdmitDecision::Admit);
    }

    #[test]
    fn output_tokens_are_paid_on_completion() {
        testing::set_now_ns(0);
        let mut tb = AdmissionHarness::<TokenBucket>::new("rate=100, burst=300").unwrap();
        let s = saturation();
        assert_eq!(tb.admit(&tenant_request(1, 100), &s), AdmitDecision::Admit);
        tb.on_complete(&done(1, 250)); // 300 - 100 - 250 = -50
        testing::advance_ms(1000); // +100 -> 50
        assert!(matches!(
            tb.admit(&tenant_request(1, 60), &s),
            AdmitDecision::Reject(_)
        ));
        assert_eq!(tb.admit(&tenant_request(1, 50), &s), AdmitDecision::Admit);
    }

    #[test]
    fn a_prompt_larger_than_the_burst_enters_on_a_full_bucket() {
        testing::set_now_ns(0);
        let mut tb = AdmissionHarness::<TokenBucket>::new("rate=10, burst=100").unwrap();
        assert_eq!(
            tb.admit(&tenant_request(3, 5000), &saturation()),
            AdmitDecision::Admit
        );
        assert!(AdmissionHarness::<TokenBucket>::new("rate=0").is_err());
    }
}
