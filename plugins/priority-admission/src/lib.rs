//! Priority admission: while the fleet is not saturated, everything enters. Once
//! it is (KV use at or over `kv_threshold`, or `active_per_worker` running
//! requests per healthy worker, or no healthy worker), requests with priority
//! below `shed_below` are refused with 503 and the rest wait in the gateway's
//! queue, ordered by priority.
//!
//! Config: `kv_threshold=0.9, active_per_worker=32, shed_below=1`.

use sluice_plugin_sdk::{
    Admission, AdmitDecision, Config, FleetSaturation, Rejection, RequestView, counter_add,
    export_admission,
};

pub struct PriorityAdmission {
    kv_threshold: f64,
    active_per_worker: f64,
    shed_below: i32,
}

impl Default for PriorityAdmission {
    fn default() -> Self {
        Self {
            kv_threshold: 0.9,
            active_per_worker: 32.0,
            shed_below: 1,
        }
    }
}

impl PriorityAdmission {
    fn saturated(&self, s: &FleetSaturation) -> bool {
        if s.healthy_workers == 0 {
            return true;
        }
        let kv_use = s.kv_blocks_used as f64 / (s.kv_blocks_total.max(1)) as f64;
        let per_worker = f64::from(s.active_requests) / f64::from(s.healthy_workers);
        kv_use >= self.kv_threshold || per_worker >= self.active_per_worker
    }
}

impl Admission for PriorityAdmission {
    fn configure(&mut self, config: &str) -> Result<(), String> {
        let mut c = Config::parse(config)?;
        self.kv_threshold = c.get("kv_threshold", 0.9)?;
        self.active_per_worker = c.get("active_per_worker", 32.0)?;
        self.shed_below = c.get("shed_below", 1)?;
        c.finish()?;
        if !(0.0..=1.0).contains(&self.kv_threshold) {
            return Err(format!(
                "kv_threshold must be in 0..=1, got {}",
                self.kv_threshold
            ));
        }
        if self.active_per_worker.is_nan() || self.active_per_worker <= 0.0 {
            return Err("active_per_worker must be > 0".into());
        }
        Ok(())
    }

    fn admit(&mut self, request: &RequestView, saturation: &FleetSaturation) -> AdmitDecision {
        if !self.saturated(saturation) {
            return AdmitDecision::Admit;
        }
        if request.priority < self.shed_below {
            counter_add("shed", 1);
            return AdmitDecision::Reject(Rejection {
                status: 503,
                message: format!(
                    "the fleet is saturated; priority {} requests are shed (below {})",
                    request.priority, self.shed_below
                ),
            });
        }
        AdmitDecision::Queue(request.priority)
    }
}

export_admission!(PriorityAdmission);

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_plugin_sdk::testing::{AdmissionHarness, request, saturation};

    fn with_priority(p: i32) -> RequestView {
        let mut r = request(100);
        r.priority = p;
        r
    }

    #[test]
    fn admits_all_until_saturated_then_sheds_low_and_queues_high() {
        let mut a = AdmissionHarness::<PriorityAdmission>::new("").unwrap();
        let calm = saturation();
        assert_eq!(a.admit(&with_priority(0), &calm), AdmitDecision::Admit);
        let mut full = calm;
        full.kv_blocks_used = full.kv_blocks_total * 95 / 100;
        assert!(
            matches!(a.admit(&with_priority(0), &full), AdmitDecision::Reject(r) if r.status == 503)
        );
        assert_eq!(a.admit(&with_priority(5), &full), AdmitDecision::Queue(5));
        let mut busy = calm;
        busy.active_requests = busy.healthy_workers * 32;
        assert!(matches!(
            a.admit(&with_priority(-1), &busy),
            AdmitDecision::Reject(_)
        ));
        let mut none = calm;
        none.healthy_workers = 0;
        assert_eq!(a.admit(&with_priority(1), &none), AdmitDecision::Queue(1));
    }

    #[test]
    fn thresholds_come_from_config() {
        let mut a =
            AdmissionHarness::<PriorityAdmission>::new("kv_threshold=0.4, shed_below=3").unwrap();
        let half = saturation(); // 50% KV
        assert!(matches!(
            a.admit(&with_priority(2), &half),
            AdmitDecision::Reject(_)
        ));
        assert_eq!(a.admit(&with_priority(3), &half), AdmitDecision::Queue(3));
        assert!(AdmissionHarness::<PriorityAdmission>::new("kv_threshold=2").is_err());
    }
}
