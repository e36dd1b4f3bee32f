//! Token-bucket admission per tenant: each tenant's bucket refills at `rate`
//! tokens per second up to `burst`. A request needs its prompt tokens in the
//! bucket to enter (else 429; a prompt larger than the burst needs a full
//! bucket), and pays them on entry; its output tokens are paid when it
//! completes, so a tenant that generates a lot goes into debt and waits.
//!
//! A bucket is one number in the slot's shared entries
//! (`sluice_plugin_sdk::shared`), so the gateway's instances running side by
//! side draw on the same bucket (a bucket per instance let a tenant through
//! at up to the rate times the number of instances). The number is the
//! generic cell rate algorithm's theoretical arrival time: the moment the
//! bucket will be full again. At `now` the bucket holds
//! `burst - (tat - now) * rate` tokens (negative in debt); paying `n` tokens
//! moves `tat` on by `n / rate`. The entry lives until `tat`, so a tenant
//! with no entry has a full bucket. Updates are compare-and-swap.
//!
//! Config: `rate=10000, burst=4*rate`.

use sluice_plugin_sdk::{
    Admission, AdmitDecision, Completion, Config, FleetSaturation, Rejection, RequestView,
    counter_add, export_admission, now_ns, shared,
};

pub struct TokenBucket {
    ns_per_token: f64,
    burst: f64,
}

impl Default for TokenBucket {
    fn default() -> Self {
        Self {
            ns_per_token: 1e9 / 10_000.0,
            burst: 40_000.0,
        }
    }
}

/// Compare-and-swap attempts before giving up on recording a payment (only
/// instances paying for the same tenant at the same moment make one fail).
const ATTEMPTS: usize = 16;

impl TokenBucket {
    /// Pays `tokens` from `tenant`'s bucket; with `need`, only if the bucket
    /// holds at least that many now, else answers how many it lacks.
    fn pay(&self, tenant: u32, tokens: f64, need: Option<f64>) -> Result<(), f64> {
        let key = u64::from(tenant);
        for _ in 0..ATTEMPTS {
            let now = now_ns();
            let stored = shared::get(key);
            let tat = stored.unwrap_or(now).max(now);
            let held = self.burst - (tat - now) as f64 / self.ns_per_token;
            if let Some(need) = need
                && held < need
            {
                return Err(need - held);
            }
            let next = tat.saturating_add((tokens * self.ns_per_token) as u64);
            let ttl_ms = ((next - now) / 1_000_000 + 1).min(u64::from(u32::MAX)) as u32;
            if shared::compare_and_swap(key, stored, next, ttl_ms) {
                return Ok(());
            }
        }
        // Not recorded (a store full of other tenants, or a storm of
        // payments for this one): let the request through, and say so.
        counter_add("unrecorded", 1);
        Ok(())
    }
}

impl Admission for TokenBucket {
    fn configure(&mut self, config: &str) -> Result<(), String> {
        let mut c = Config::parse(config)?;
        let rate: f64 = c.get("rate", 10_000.0)?;
        self.burst = c.get("burst", rate * 4.0)?;
        c.finish()?;
        if !(rate > 0.0 && rate.is_finite()) {
            return Err(format!("rate must be > 0, got {rate}"));
        }
        if !(self.burst >= 1.0 && self.burst.is_finite()) {
            return Err(format!("burst must be >= 1, got {}", self.burst));
        }
        self.ns_per_token = 1e9 / rate;
        Ok(())
    }

    fn admit(&mut self, request: &RequestView, _saturation: &FleetSaturation) -> AdmitDecision {
        let need = f64::from(request.prompt_tokens);
        match self.pay(request.tenant_id, need, Some(need.min(self.burst))) {
            Ok(()) => AdmitDecision::Admit,
            Err(short) => {
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
    }

    fn on_complete(&mut self, done: &Completion) {
        let _ = self.pay(done.tenant_id, f64::from(done.output_tokens), None);
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
    fn instances_side_by_side_draw_on_one_bucket() {
        testing::set_now_ns(0);
        testing::clear_shared();
        let mut a = AdmissionHarness::<TokenBucket>::new("rate=100, burst=300").unwrap();
        let mut b = AdmissionHarness::<TokenBucket>::new("rate=100, burst=300").unwrap();
        let s = saturation();
        assert_eq!(a.admit(&tenant_request(1, 200), &s), AdmitDecision::Admit);
        assert!(
            matches!(
                b.admit(&tenant_request(1, 200), &s),
                AdmitDecision::Reject(_)
            ),
            "the other instance sees the 100 tokens left"
        );
        b.on_complete(&done(1, 100)); // 0 left
        testing::advance_ms(500); // +50
        assert!(matches!(
            a.admit(&tenant_request(1, 60), &s),
            AdmitDecision::Reject(_)
        ));
        assert_eq!(a.admit(&tenant_request(1, 50), &s), AdmitDecision::Admit);
    }

    #[test]
    fn an_idle_tenant_refills_to_the_burst_and_no_further() {
        testing::set_now_ns(0);
        testing::clear_shared();
        let mut tb = AdmissionHarness::<TokenBucket>::new("rate=100, burst=300").unwrap();
        let s = saturation();
        assert_eq!(tb.admit(&tenant_request(4, 300), &s), AdmitDecision::Admit);
        testing::advance_ms(60_000); // far more than the 3 s to refill
        assert_eq!(tb.admit(&tenant_request(4, 300), &s), AdmitDecision::Admit);
        assert!(matches!(
            tb.admit(&tenant_request(4, 1), &s),
            AdmitDecision::Reject(_)
        ));
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
