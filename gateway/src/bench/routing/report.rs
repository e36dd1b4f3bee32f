//! The routing benchmark's figures: a run's records and worker counters
//! turned into modelled-time figures, a markdown table of every run, and an
//! SVG plot of TTFT p90 against load, one line per policy (plotters, SVG
//! backend).

use plotters::prelude::*;

use super::percentile;
use super::replay::RequestRecord;

/// The figures of one (trace, load, policy) run, in modelled time.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RunFigures {
    pub trace: String,
    pub policy: String,
    /// Offered load as a fraction of the fleet's capacity.
    pub load: f64,
    pub requests: usize,
    pub errors: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p90_ms: f64,
    /// Completed requests per modelled second.
    pub throughput_rps: f64,
    /// Output tokens per modelled second.
    pub output_tok_s: f64,
    /// Cached prompt tokens / prompt tokens, from the workers' counters.
    pub hit_rate: f64,
    /// The busiest worker's requests over the mean.
    pub imbalance: f64,
}

pub fn markdown(runs: &[RunFigures]) -> String {
    let mut out = String::from(
        "| trace | load | policy | TTFT p50 | TTFT p90 | TTFT p99 | e2e p50 | e2e p90 | req/s | tok/s | hit rate | imbalance | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        out.push_str(&format!(
            "| {} | {:.0}% | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.3} | {:.2} | {} |\n",
            r.trace,
            r.load * 100.0,
            r.policy,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.e2e_p50_ms,
            r.e2e_p90_ms,
            r.throughput_rps,
            r.output_tok_s,
            r.hit_rate,
            r.imbalance,
            r.errors,
        ));
    }
    out
}

/// TTFT p90 (ms, log scale) against load (%), one line per policy, for the
/// runs of one trace; written to `path` as SVG.
pub fn plot(runs: &[RunFigures], trace: &str, path: &std::path::Path) -> Result<(), String> {
    let runs: Vec<&RunFigures> = runs.iter().filter(|r| r.trace == trace).collect();
    if runs.is_empty() {
        return Err(format!("no runs of {trace} to plot"));
    }
    let mut policies: Vec<&str> = runs.iter().map(|r| r.policy.as_str()).collect();
    policies.dedup();
    policies.sort_unstable();
    policies.dedup();
    let (lo, hi) = runs.iter().fold((f64::MAX, 0.0f64), |(lo, hi), r| {
        (lo.min(r.ttft_p90_ms), hi.max(r.ttft_p90_ms))
    });
    let (x_lo, x_hi) = runs.iter().fold((100.0f64, 0.0f64), |(lo, hi), r| {
        (lo.min(r.load * 100.0), hi.max(r.load * 100.0))
    });
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    let e = |e: DrawingAreaErrorKind<_>| format!("plot: {e:?}");
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("TTFT p90 against load — {trace}"),
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (x_lo - 5.0)..(x_hi + 5.0),
            ((lo * 0.8).max(0.1)..(hi * 1.25).max(1.0)).log_scale(),
        )
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("offered load, % of fleet capacity")
        .y_desc("TTFT p90, ms")
        .draw()
        .map_err(e)?;
    for (i, policy) in policies.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut points: Vec<(f64, f64)> = runs
            .iter()
            .filter(|r| r.policy == *policy)
            .map(|r| (r.load * 100.0, r.ttft_p90_ms.max(0.1)))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(e)?
            .label(policy.to_string())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )
            .map_err(e)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

/// The TTFTs of the answered requests among `records`, in modelled ms,
/// sorted (for `percentile`).
pub fn sorted_ttft_ms<'a>(
    records: impl Iterator<Item = &'a RequestRecord>,
    time_scale: f64,
) -> Vec<f64> {
    let mut ms: Vec<f64> = records
        .filter(|r| r.error.is_none())
        .filter_map(|r| r.ttft)
        .map(|s| s / time_scale * 1000.0)
        .collect();
    ms.sort_by(f64::total_cmp);
    ms
}

/// Turns records and worker counters into modelled-time figures.
pub fn figures(
    records: &[RequestRecord],
    counters: &[(u64, u64, u64)],
    span_s: f64,
    time_scale: f64,
    trace: &str,
    policy: &str,
    load: f64,
) -> RunFigures {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    let ms = |s: f64| s / time_scale * 1000.0;
    let ttft = sorted_ttft_ms(records.iter(), time_scale);
    let mut e2e: Vec<f64> = ok.iter().map(|r| ms(r.e2e)).collect();
    e2e.sort_by(f64::total_cmp);
    let modelled_span = span_s / time_scale;
    let output: u64 = ok.iter().filter_map(|r| r.completion_tokens).sum();
    let (prompt, cached) = counters
        .iter()
        .fold((0u64, 0u64), |(p, c), w| (p + w.1, c + w.2));
    let per_worker: Vec<f64> = counters.iter().map(|w| w.0 as f64).collect();
    let mean = per_worker.iter().sum::<f64>() / per_worker.len().max(1) as f64;
    let max = per_worker.iter().copied().fold(0.0, f64::max);
    RunFigures {
        trace: trace.to_string(),
        policy: policy.to_string(),
        load,
        requests: records.len(),
        errors: records.len() - ok.len(),
        ttft_p50_ms: percentile(&ttft, 0.5),
        ttft_p90_ms: percentile(&ttft, 0.9),
        ttft_p99_ms: percentile(&ttft, 0.99),
        e2e_p50_ms: percentile(&e2e, 0.5),
        e2e_p90_ms: percentile(&e2e, 0.9),
        throughput_rps: ok.len() as f64 / modelled_span.max(f64::MIN_POSITIVE),
        output_tok_s: output as f64 / modelled_span.max(f64::MIN_POSITIVE),
        hit_rate: cached as f64 / prompt.max(1) as f64,
        imbalance: if mean > 0.0 { max / mean } else { 0.0 },
    }
}
