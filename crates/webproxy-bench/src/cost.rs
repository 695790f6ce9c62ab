//! What one conversation costs beyond its latency: the CPU of `webproxy serve` and of
//! nats-server, and the NATS messages the server takes in and sends out, each as the
//! difference of two readings over a measured interval divided by the conversations
//! completed in it.

use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use webproxy_testkit::process;

/// Cumulative counters of one service and its nats-server at one instant.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counters {
    service_cpu: Duration,
    nats_cpu: Duration,
    in_msgs: u64,
    out_msgs: u64,
}

/// Per completed conversation.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct Cost {
    /// CPU (user + system) of `webproxy serve`, in µs.
    pub(crate) service_cpu_us: f64,
    /// CPU (user + system) of nats-server, in µs.
    pub(crate) nats_cpu_us: f64,
    /// Messages nats-server received (`/varz` `in_msgs`).
    pub(crate) msgs_in: f64,
    /// Messages nats-server delivered (`/varz` `out_msgs`).
    pub(crate) msgs_out: f64,
}

impl Counters {
    /// Reads the counters: `service` is the service's pid (`None` for a loop with no
    /// service), `nats` the server's pid and `monitoring` its monitoring URL.
    pub(crate) async fn read(
        http: &reqwest::Client,
        service: Option<u32>,
        nats: u32,
        monitoring: &str,
    ) -> anyhow::Result<Counters> {
        let body = http
            .get(format!("{monitoring}/varz"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .context("cannot read nats-server's /varz")?
            .bytes()
            .await
            .context("cannot read nats-server's /varz")?;
        let varz: serde_json::Value =
            serde_json::from_slice(&body).context("nats-server's /varz is not JSON")?;
        let counter = |name: &str| {
            varz.get(name)
                .and_then(serde_json::Value::as_u64)
                .with_context(|| format!("/varz has no {name}"))
        };
        Ok(Counters {
            service_cpu: service.map_or(Duration::ZERO, process::cpu_time),
            nats_cpu: process::cpu_time(nats),
            in_msgs: counter("in_msgs")?,
            out_msgs: counter("out_msgs")?,
        })
    }

    /// What happened between `self` and `later`, per conversation of `conversations`
    /// (all zero when none completed).
    pub(crate) fn per_conversation(&self, later: &Counters, conversations: usize) -> Cost {
        if conversations == 0 {
            return Cost::default();
        }
        let n = conversations as f64;
        let us = |before: Duration, after: Duration| {
            after.saturating_sub(before).as_secs_f64() * 1e6 / n
        };
        let count = |before: u64, after: u64| after.saturating_sub(before) as f64 / n;
        Cost {
            service_cpu_us: us(self.service_cpu, later.service_cpu),
            nats_cpu_us: us(self.nats_cpu, later.nats_cpu),
            msgs_in: count(self.in_msgs, later.in_msgs),
            msgs_out: count(self.out_msgs, later.out_msgs),
        }
    }
}

/// The median of `values` (the mean of the middle two for an even count; 0 for none).
pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_are_differences_divided_by_the_conversations() {
        let before = Counters {
            service_cpu: Duration::from_millis(100),
            nats_cpu: Duration::from_millis(50),
            in_msgs: 10,
            out_msgs: 20,
        };
        let after = Counters {
            service_cpu: Duration::from_millis(300),
            nats_cpu: Duration::from_millis(150),
            in_msgs: 4010,
            out_msgs: 6020,
        };
        let cost = before.per_conversation(&after, 1000);
        assert!((cost.service_cpu_us - 200.0).abs() < 1e-9, "{cost:?}");
        assert!((cost.nats_cpu_us - 100.0).abs() < 1e-9, "{cost:?}");
        assert!((cost.msgs_in - 4.0).abs() < 1e-9, "{cost:?}");
        assert!((cost.msgs_out - 6.0).abs() < 1e-9, "{cost:?}");
        assert_eq!(before.per_conversation(&after, 0).msgs_in, 0.0);
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
