//! Connecting to NATS: the connection's health, ping interval and reconnect backoff.

use std::time::Duration;

use async_nats::connection;
use tracing::{debug, error};

use crate::Instruments;
use webproxy_jetstream::backoff::Backoff;

/// Connects to NATS, keeping `health` in step with the connection state. Returns at
/// once: an unreachable server is retried in the background (`client.flush()` waits
/// for it); an error is one that retrying cannot mend (an address that does not parse,
/// an unreadable credentials file).
///
/// `options` carry the process's authentication and TLS (the binary builds them from
/// `[nats]`); `urls` are the servers; `ack_wait` sets the ping interval.
pub async fn connect(
    options: async_nats::ConnectOptions,
    urls: Vec<String>,
    ack_wait: Duration,
    instruments: &Instruments,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    let health = &instruments.health;
    let events = health.clone();
    let client = options
        .name("webproxy")
        // The one retry of connecting: the first connection too is made in the
        // background, with `reconnect_delay`; errors returned here are permanent.
        .retry_on_initial_connect()
        // A half-open connection is noticed within a few pings, well inside ack_wait.
        .ping_interval(ping_interval(ack_wait))
        // Back within about a second of the server, not the client's default of 4 s.
        .reconnect_delay_callback(reconnect_delay)
        .event_callback(move |event| {
            let events = events.clone();
            async move {
                match event {
                    async_nats::Event::Connected => events.set_nats_connected(true),
                    async_nats::Event::Disconnected => events.set_nats_connected(false),
                    async_nats::Event::ServerError(async_nats::ServerError::Other(error)) => {
                        match denied_subscription(&error) {
                            Some(subject) => {
                                error!(subject, %error, "NATS refused a subscription: not ready");
                                events.set_subscription_denied(subject);
                            }
                            None => debug!(%error, "nats server error"),
                        }
                    }
                    other => debug!(event = %other, "nats event"),
                }
            }
        })
        .connect(urls)
        .await?;
    health.set_nats_connected(client.connection_state() == connection::State::Connected);
    Ok(client)
}

/// The subject a server error refuses a subscription to: the server's
/// `Permissions Violation for Subscription to "webproxy.cancel"` (and ` using queue
/// "q"` for a queue subscription); `None` for any other error.
fn denied_subscription(error: &str) -> Option<&str> {
    const REFUSED: &str = "permissions violation for subscription to \"";
    let rest = error
        .get(..REFUSED.len())
        .filter(|head| head.eq_ignore_ascii_case(REFUSED))
        .map(|_| &error[REFUSED.len()..])?;
    rest.split_once('"').map(|(subject, _)| subject)
}

/// How often the connection is pinged: a fifth of `ack_wait`, at most 10 s.
fn ping_interval(ack_wait: Duration) -> Duration {
    (ack_wait / 5).clamp(Duration::from_millis(100), Duration::from_secs(10))
}

/// Connecting, the first time and after a loss (`retry_on_initial_connect`: the
/// client's own loop is the only one): 100 ms more per attempt, at most 1 s, forever.
const RECONNECT_BACKOFF: Backoff =
    Backoff::linear(Duration::from_millis(100), Duration::from_secs(1));

/// The wait before reconnect attempt `attempts`: growing to about a second, no more.
fn reconnect_delay(attempts: usize) -> Duration {
    let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
    RECONNECT_BACKOFF
        .after(attempts)
        .unwrap_or(Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_refused_subscription_names_its_subject_and_nothing_else_does() {
        assert_eq!(
            denied_subscription(r#"Permissions Violation for Subscription to "webproxy.cancel""#),
            Some("webproxy.cancel")
        );
        assert_eq!(
            denied_subscription(
                r#"Permissions Violation for Subscription to "webproxy.body.put.>" using queue "webproxy""#
            ),
            Some("webproxy.body.put.>")
        );
        for other in [
            r#"Permissions Violation for Publish to "webproxy.reply.x""#,
            "Permissions Violation for Subscription to ",
            r#"Permissions Violation for Subscription to "unterminated"#,
            "maximum payload violation",
            "",
        ] {
            assert_eq!(denied_subscription(other), None, "{other}");
        }
    }

    #[test]
    fn reconnecting_waits_100_ms_more_per_attempt_up_to_a_second() {
        assert_eq!(reconnect_delay(0), ms(0));
        assert_eq!(reconnect_delay(1), ms(100));
        assert_eq!(reconnect_delay(5), ms(500));
        assert_eq!(reconnect_delay(10), ms(1000));
        assert_eq!(reconnect_delay(11), ms(1000));
        assert_eq!(reconnect_delay(usize::MAX), ms(1000));
    }
}
