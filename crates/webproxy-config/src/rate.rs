//! A pool's rate limit as configured: `[pools.NAME] rate = "10/s"`, parsed and
//! printed back. The cluster-wide schedule of its slots is the dispatcher's.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A rate: `count` calls per `per`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    count: f64,
    per: Per,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Per {
    Second,
    Minute,
    Hour,
}

impl Per {
    fn seconds(self) -> f64 {
        match self {
            Per::Second => 1.0,
            Per::Minute => 60.0,
            Per::Hour => 3600.0,
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Per::Second => "s",
            Per::Minute => "min",
            Per::Hour => "h",
        }
    }
}

impl Rate {
    /// The time between two slots.
    pub fn interval(&self) -> Duration {
        Duration::from_secs_f64(self.per.seconds() / self.count)
    }

    /// Calls per second.
    pub fn per_second(&self) -> f64 {
        self.count / self.per.seconds()
    }
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(text: &str) -> Result<Rate, String> {
        let wrong = || format!("{text:?} is not a rate: write COUNT/s, COUNT/min or COUNT/h");
        let (count, unit) = text.trim().split_once('/').ok_or_else(wrong)?;
        let per = match unit.trim() {
            "s" => Per::Second,
            "min" => Per::Minute,
            "h" => Per::Hour,
            _ => return Err(wrong()),
        };
        let count: f64 = count.trim().parse().map_err(|_| wrong())?;
        if !count.is_finite() || count <= 0.0 {
            return Err(format!("{text:?}: the count must be above 0"));
        }
        // Slots are scheduled in microseconds: a million a second is the most.
        if count / per.seconds() > 1_000_000.0 {
            return Err(format!("{text:?}: at most 1000000/s"));
        }
        Ok(Rate { count, per })
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, self.per.unit())
    }
}

impl Serialize for Rate {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Rate, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(text: &str) -> Rate {
        text.parse().expect("rate")
    }

    #[test]
    fn rates_parse_and_print_back() {
        assert_eq!(rate("10/s").interval(), Duration::from_millis(100));
        assert_eq!(rate("120/min").interval(), Duration::from_millis(500));
        assert_eq!(rate("2/h").interval(), Duration::from_secs(1800));
        assert_eq!(rate(" 0.5 / s ").interval(), Duration::from_secs(2));
        assert_eq!(rate("20/s").to_string(), "20/s");
        assert_eq!(rate("1.5/min").to_string(), "1.5/min");
        for wrong in ["10", "10/d", "x/s", "0/s", "-1/s", "inf/s", "2000000/s"] {
            assert!(wrong.parse::<Rate>().is_err(), "{wrong}");
        }
        let err = "10/day".parse::<Rate>().expect_err("unit");
        assert!(err.contains("COUNT/s, COUNT/min or COUNT/h"), "{err}");
    }
}
