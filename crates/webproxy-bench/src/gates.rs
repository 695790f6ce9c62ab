//! Issue 33's gates: webproxy's medians against the minimal pipeline's (`pipeline.rs`),
//! measured in the same rounds. The bench prints each ratio and whether it meets its
//! bound on every run, so that a later change shows it did not regress. The
//! large-bodies section (`large_bodies.rs`) states its bound on RSS as a [`Gate`] too.

use serde::Serialize;

use crate::{LevelMedian, Measured};

/// Where a gate's bound lies.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

/// One gate: its figure (a ratio to the pipeline, or slot utilization itself) and
/// whether it meets its bound; `None` when a level it needs was not measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Gate {
    pub(crate) name: String,
    pub(crate) value: Option<f64>,
    pub(crate) bound: Bound,
}

impl Gate {
    pub(crate) fn met(&self) -> bool {
        match (self.value, self.bound) {
            (Some(value), Bound::AtLeast(bound)) => value >= bound,
            (Some(value), Bound::AtMost(bound)) => value <= bound,
            (None, _) => false,
        }
    }
}

/// The level the CPU and throughput gates read most: the one of the figures.
pub(crate) const HIGH: usize = 256;

fn at(measured: &Measured, concurrency: usize) -> Option<&LevelMedian> {
    measured
        .medians
        .iter()
        .find(|level| level.concurrency == concurrency)
}

fn ratio(mine: f64, theirs: f64) -> Option<f64> {
    (theirs > 0.0).then(|| mine / theirs)
}

/// The gates of `webproxy` against `pipeline`.
pub(crate) fn gates(webproxy: &Measured, pipeline: &Measured) -> Vec<Gate> {
    let level = |concurrency: usize, figure: fn(&LevelMedian) -> f64| {
        let (mine, theirs) = (at(webproxy, concurrency)?, at(pipeline, concurrency)?);
        ratio(figure(mine), figure(theirs))
    };
    vec![
        Gate {
            name: "throughput at 64 outstanding ÷ pipeline".into(),
            value: level(64, |l| l.rps),
            bound: Bound::AtLeast(0.85),
        },
        Gate {
            name: format!("throughput at {HIGH} outstanding ÷ pipeline"),
            value: level(HIGH, |l| l.rps),
            bound: Bound::AtLeast(0.85),
        },
        Gate {
            name: format!("service CPU per conversation at {HIGH} ÷ pipeline"),
            value: level(HIGH, |l| l.cost.service_cpu_us),
            bound: Bound::AtMost(1.4),
        },
        Gate {
            name: format!("nats-server CPU per conversation at {HIGH} ÷ pipeline"),
            value: level(HIGH, |l| l.cost.nats_cpu_us),
            bound: Bound::AtMost(1.15),
        },
        Gate {
            name: "slot utilization (pool of 1, 10 ms upstream, ÷ direct)".into(),
            value: Some(webproxy.slot_utilization),
            bound: Bound::AtLeast(0.93),
        },
        Gate {
            name: format!("peak RSS after {HIGH} outstanding ÷ pipeline"),
            value: ratio(webproxy.peak_rss_mib, pipeline.peak_rss_mib),
            bound: Bound::AtMost(1.3),
        },
    ]
}

/// Prints one gate's line: its name, its value, its bound and whether it is met.
pub(crate) fn print_gate(gate: &Gate) {
    let bound = match gate.bound {
        Bound::AtLeast(b) => format!(">= {b:.2}"),
        Bound::AtMost(b) => format!("<= {b:.2}"),
    };
    let value = gate
        .value
        .map_or("not measured".into(), |v| format!("{v:.2}"));
    let verdict = if gate.met() { "met" } else { "NOT MET" };
    println!("  {:<58} {value:>12} {bound:>8}  {verdict}", gate.name);
}

/// The pipeline's throughput at [`HIGH`] ÷ the broker-only loop's: below
/// [`PIPELINE_FLOOR`], the pipeline is too slow to be the measure of webproxy.
pub(crate) const PIPELINE_FLOOR: f64 = 0.5;

/// Prints the gates, and whether the pipeline is fast enough for them to count
/// (`pipeline_vs_broker`, its throughput at [`HIGH`] ÷ the broker-only loop's).
pub(crate) fn print(gates: &[Gate], pipeline_vs_broker: Option<f64>) {
    println!();
    println!("gates against the minimal pipeline (issue 33; medians of the rounds):");
    for gate in gates {
        print_gate(gate);
    }
    match pipeline_vs_broker {
        Some(r) if r >= PIPELINE_FLOOR => println!(
            "  the pipeline reached {r:.3} of the broker-only loop's throughput at {HIGH} (>= {PIPELINE_FLOOR}): a fair measure"
        ),
        Some(r) => println!(
            "  the pipeline reached only {r:.3} of the broker-only loop's throughput at {HIGH} (< {PIPELINE_FLOOR}): too slow to measure webproxy by; the gates do not count"
        ),
        None => println!("  the pipeline or the broker-only loop was not measured at {HIGH}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Cost;

    fn measured(levels: &[(usize, f64, f64, f64)], slot: f64, rss: f64) -> Measured {
        Measured {
            name: String::new(),
            rounds: Vec::new(),
            medians: levels
                .iter()
                .map(
                    |&(concurrency, rps, service_cpu_us, nats_cpu_us)| LevelMedian {
                        concurrency,
                        rps,
                        p50_ms: 1.0,
                        cost: Cost {
                            service_cpu_us,
                            nats_cpu_us,
                            msgs_in: 4.0,
                            msgs_out: 4.0,
                        },
                    },
                )
                .collect(),
            slot_utilization: slot,
            peak_rss_mib: rss,
        }
    }

    #[test]
    fn each_gate_reads_its_own_figure_against_its_bound() {
        let pipeline = measured(
            &[(64, 1000.0, 100.0, 50.0), (256, 1000.0, 100.0, 50.0)],
            0.95,
            20.0,
        );
        let webproxy = measured(
            &[(64, 900.0, 150.0, 60.0), (256, 800.0, 130.0, 57.0)],
            0.94,
            30.0,
        );
        let found = gates(&webproxy, &pipeline);
        let values: Vec<Option<f64>> = found.iter().map(|g| g.value).collect();
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
        assert!(close(values[0], 0.9) && close(values[1], 0.8), "{values:?}");
        assert!(
            close(values[2], 1.3) && close(values[3], 1.14),
            "{values:?}"
        );
        assert!(
            close(values[4], 0.94) && close(values[5], 1.5),
            "{values:?}"
        );
        let met: Vec<bool> = found.iter().map(Gate::met).collect();
        assert_eq!(met, [true, false, true, true, true, false]);
    }

    #[test]
    fn a_level_left_unmeasured_is_a_gate_not_met() {
        let pipeline = measured(&[(256, 1000.0, 100.0, 50.0)], 0.95, 20.0);
        let webproxy = measured(&[(256, 1000.0, 100.0, 50.0)], 0.95, 20.0);
        let found = gates(&webproxy, &pipeline);
        assert_eq!(found[0].value, None);
        assert!(!found[0].met());
        assert!(found[1].met());
    }
}
