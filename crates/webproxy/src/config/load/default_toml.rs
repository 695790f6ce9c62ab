//! `config/default.toml`, "every key, commented", held to the code and to the docs
//! (issue 31, point 2): with its commented-out keys and sections uncommented, the
//! loader accepts it, it names every key each section accepts, the defaults it writes
//! for pools, rules and routes (which only the code applies) are the code's, and the
//! configuration reference's table of keys and defaults (`docs/configuration.md`) says
//! the same.

use std::collections::BTreeSet;

use figment::Figment;
use figment::providers::{Format as _, Toml};
use toml::{Table, Value};
use webproxy_config::{PoolConfig, RequestRuleConfig};

use super::DEFAULT_CONFIG;
use crate::config::gateway::RouteConfig;
use crate::config::schema::Config;

/// A commented-out line that is TOML rather than prose: `# key = value` or
/// `# [section]` / `# [[section]]` (a comment may follow).
fn commented_toml(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("# ")?;
    let is_key = rest.split_once(" = ").is_some_and(|(key, _)| {
        key.starts_with(|c: char| c.is_ascii_alphabetic())
            && key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    });
    (is_key || header(rest).is_some()).then_some(rest)
}

/// The dotted path of a `[section]` or `[[section]]` line (a comment may follow), and
/// whether it is an array's.
fn header(line: &str) -> Option<(&str, bool)> {
    let line = line.split('#').next().unwrap_or_default().trim();
    let (inner, array) = match line.strip_prefix("[[") {
        Some(rest) => (rest.strip_suffix("]]")?, true),
        None => (line.strip_prefix('[')?.strip_suffix(']')?, false),
    };
    let plain = !inner.is_empty()
        && inner
            .chars()
            .all(|c| c.is_ascii_lowercase() || c == '_' || c == '.');
    plain.then_some((inner, array))
}

/// The file with every commented-out key and section uncommented: the optional keys
/// and the example sections, as a user would write them.
fn uncommented() -> String {
    DEFAULT_CONFIG
        .lines()
        .map(|line| commented_toml(line).unwrap_or(line))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The file's sections, root first, as paths into the parsed document: a step into an
/// array of tables (`[[request_rules]]`) goes on into its first element, `0`.
fn sections(text: &str) -> Vec<Vec<String>> {
    let mut arrays = BTreeSet::new();
    let mut sections = vec![Vec::new()];
    for (path, array) in text.lines().filter_map(header) {
        let mut steps = Vec::new();
        let mut prefix = Vec::new();
        for step in path.split('.') {
            prefix.push(step);
            steps.push(step.to_owned());
            if arrays.contains(&prefix.join(".")) || (array && prefix.join(".") == path) {
                steps.push("0".into());
            }
        }
        if array {
            arrays.insert(path.to_owned());
        }
        sections.push(steps);
    }
    sections
}

/// The table at `path` in `document`.
fn table_at<'a>(document: &'a mut Table, path: &[String]) -> &'a mut Table {
    let mut value = document;
    // An array's step is followed by `0`: its first element is taken below.
    for step in path.iter().filter(|step| *step != "0") {
        let next = match value.get_mut(step) {
            Some(Value::Array(items)) => items.first_mut(),
            other => other,
        };
        value = match next {
            Some(Value::Table(table)) => table,
            _ => panic!("no table at {}", path.join(".")),
        };
    }
    value
}

/// Sections that are maps of names the user chooses, not structs with fixed keys.
const FREE_FORM: &[&str] = &["request_rules.0.inject_headers"];

/// Sections of one type, whose keys the file documents in one of them: a request rule's
/// own response rules are response rules.
const SAME_TYPE: &[(&str, &str)] = &[("request_rules.0.response_rules.0", "response_rules.0")];

/// The keys the code accepts in the section at `path`: `__probe` added to it makes the
/// loader's strict parse name them.
fn accepted_keys(document: &Table, path: &[String]) -> BTreeSet<String> {
    let mut probed = document.clone();
    table_at(&mut probed, path).insert("__probe".into(), Value::Integer(0));
    let text = toml::to_string(&probed).expect("a TOML table serializes");
    match Figment::from(Toml::string(&text)).extract::<Config>() {
        Err(error) => match error.kind {
            figment::error::Kind::UnknownField(field, expected) if field == "__probe" => {
                expected.iter().map(|key| key.to_string()).collect()
            }
            kind => panic!(
                "[{}]: the file is refused before the probe key is reached: {kind}",
                path.join(".")
            ),
        },
        Ok(_) => panic!(
            "[{}] accepted a key `__probe`: a map, to list in FREE_FORM?",
            path.join(".")
        ),
    }
}

/// Every key the file names (commented out or not) is one the loader accepts.
#[test]
fn default_toml_names_only_keys_the_code_accepts() {
    let text = uncommented();
    if let Err(error) = Figment::from(Toml::string(&text)).extract::<Config>() {
        panic!("config/default.toml, uncommented, is refused: {error}");
    }
}

/// Every key each section accepts is in the file, so a key added to the code and not
/// documented there fails.
#[test]
fn default_toml_names_every_key_the_code_accepts() {
    let text = uncommented();
    let document: Table = toml::from_str(&text).expect("the uncommented file is TOML");
    let mut missing = Vec::new();
    let mut checked = 0;
    for path in sections(&text) {
        if FREE_FORM.contains(&path.join(".").as_str()) {
            continue;
        }
        let mut copy = document.clone();
        let mut named: BTreeSet<String> = table_at(&mut copy, &path).keys().cloned().collect();
        for (section, documented) in SAME_TYPE {
            if path.join(".") == *section {
                let documented: Vec<String> = documented.split('.').map(String::from).collect();
                named.extend(table_at(&mut copy, &documented).keys().cloned());
            }
        }
        for key in accepted_keys(&document, &path).difference(&named) {
            let section = path.iter().filter(|s| *s != "0").cloned();
            missing.push(section.chain([key.clone()]).collect::<Vec<_>>().join("."));
        }
        checked += 1;
    }
    // The root, the ten fixed sections, a pool with its breaker, a route, a request
    // rule with its response rules, and the response rules.
    assert!(checked >= 15, "only {checked} sections found");
    assert!(
        missing.is_empty(),
        "keys the code accepts that config/default.toml does not name: {missing:?}"
    );
}

/// The keys of a pool whose values the file shows as examples, not as the default
/// (which is "unset"); likewise of a request rule and of a gateway route.
const POOL_EXAMPLES: &[&str] = &["max_waiting", "queue_timeout", "rate"];
const RULE_EXAMPLES: &[&str] = &["origin"];
const ROUTE_EXAMPLES: &[&str] = &["pool", "token_header"];

/// The serialized form of a section parsed from `table` (as the loader parses it, the
/// code's defaults filling in what it leaves out).
fn parsed<T: serde::de::DeserializeOwned + serde::Serialize>(table: &Table) -> Value {
    let text = toml::to_string(table).expect("a TOML table serializes");
    let config: T = toml::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    Value::try_from(&config).expect("a configuration serializes")
}

/// The keys of `documented` (a section of the uncommented file) whose value differs
/// from the code's default: each set alone on `required`, against `required` alone.
/// `false` for a key the code leaves unset counts as its default.
fn differing_defaults<T: serde::de::DeserializeOwned + serde::Serialize>(
    section: &str,
    documented: &Table,
    required: &Table,
    examples: &[&str],
) -> Vec<String> {
    let default = parsed::<T>(required);
    documented
        .iter()
        .filter(|(key, value)| {
            !examples.contains(&key.as_str())
                && !required.contains_key(*key)
                && !value.is_table()
                && !matches!(value, Value::Array(items) if items.iter().all(Value::is_table))
        })
        .filter_map(|(key, value)| {
            let mut one = required.clone();
            one.insert(key.clone(), value.clone());
            let with = parsed::<T>(&one);
            let unset_as_false = *value == Value::Boolean(false) && default.get(key).is_none();
            (with != default && !unset_as_false).then(|| {
                format!(
                    "{section}.{key} = {value} (the code's default: {})",
                    default.get(key).map_or("unset".into(), Value::to_string)
                )
            })
        })
        .collect()
}

/// The defaults the file writes for pools, their breakers and request rules, which the
/// code applies to any pool or rule (the file's own values only reach
/// `[pools.default]`), are the code's.
#[test]
fn default_toml_writes_the_code_defaults() {
    let document: Table = toml::from_str(&uncommented()).expect("the uncommented file is TOML");
    let mut copy = document.clone();
    let pool = table_at(&mut copy, &["pools".into(), "default".into()]).clone();
    let breaker = pool
        .get("breaker")
        .and_then(Value::as_table)
        .expect("[pools.default.breaker]")
        .clone();
    let rule = table_at(&mut copy, &["request_rules".into(), "0".into()]).clone();

    let route = table_at(&mut copy, &["gateway".into(), "routes".into(), "0".into()]).clone();

    let mut wrong =
        differing_defaults::<PoolConfig>("pools.NAME", &pool, &Table::new(), POOL_EXAMPLES);
    let mut empty_breaker = Table::new();
    empty_breaker.insert("breaker".into(), Value::Table(Table::new()));
    for (key, value) in &breaker {
        let mut one = Table::new();
        one.insert(key.clone(), value.clone());
        let mut with = Table::new();
        with.insert("breaker".into(), Value::Table(one));
        if parsed::<PoolConfig>(&with) != parsed::<PoolConfig>(&empty_breaker) {
            wrong.push(format!(
                "pools.NAME.breaker.{key} = {value} is not the code's default"
            ));
        }
    }
    wrong.extend(differing_defaults::<RequestRuleConfig>(
        "request_rules[0]",
        &rule,
        &only(&rule, &["name", "url_pattern"]),
        RULE_EXAMPLES,
    ));
    wrong.extend(differing_defaults::<RouteConfig>(
        "gateway.routes[0]",
        &route,
        &only(&route, &["path", "upstream"]),
        ROUTE_EXAMPLES,
    ));
    assert!(
        wrong.is_empty(),
        "config/default.toml writes defaults the code does not have: {wrong:#?}"
    );
}

/// `table`'s `keys`.
fn only(table: &Table, keys: &[&str]) -> Table {
    keys.iter()
        .map(|key| (key.to_string(), table[*key].clone()))
        .collect()
}

/// The uncommenting takes TOML lines only: prose stays commented.
#[test]
fn only_toml_lines_are_uncommented() {
    assert_eq!(
        commented_toml("# max_waiting = 10000"),
        Some("max_waiting = 10000")
    );
    assert_eq!(
        commented_toml("# [[request_rules.response_rules]]   # replaces the global list"),
        Some("[[request_rules.response_rules]]   # replaces the global list")
    );
    assert_eq!(
        commented_toml("# [pools.default] always exists; define others as [pools.NAME]"),
        None
    );
    assert_eq!(
        commented_toml("# Durations are humantime strings: \"250ms\""),
        None
    );
    assert_eq!(
        commented_toml("#   OTEL_EXPORTER_OTLP_ENDPOINT   switches"),
        None
    );
}

/// The configuration reference's table of keys and defaults.
const REFERENCE: &str = "docs/configuration.md";

/// The reference's rows: each key (`section.key`, a row's later unqualified names taking
/// the first one's section; `pools.NAME` as `pools.default`) with the default the row
/// gives it, when it gives each key one (`15m, 256 MiB` for two keys, or one default
/// for all of them). Routes' keys, in a row of their own, are left to the file.
fn reference_rows(text: &str) -> Vec<(String, Option<String>)> {
    let mut rows = Vec::new();
    for line in text.lines().filter(|line| line.starts_with("| `")) {
        let cells: Vec<&str> = line.split(" | ").collect();
        let (Some(keys), Some(default)) = (cells.first(), cells.get(1)) else {
            continue;
        };
        let names: Vec<&str> = keys
            .trim_start_matches("| ")
            .split([',', '+'])
            .map(|name| name.trim().trim_matches('`'))
            .collect();
        let Some((section, _)) = names[0].rsplit_once('.') else {
            continue;
        };
        if section.ends_with("[]") {
            continue;
        }
        let section = section.replace("NAME", "default");
        let parts: Vec<&str> = default.split(", ").collect();
        for (index, name) in names.iter().enumerate() {
            let name = name.rsplit('.').next().unwrap_or(name);
            let default = match parts.len() {
                1 => Some(parts[0].to_owned()),
                n if n == names.len() => Some(parts[index].to_owned()),
                _ => None,
            };
            rows.push((format!("{section}.{name}"), default));
        }
    }
    rows
}

/// A default as the reference writes it, as the file's value would read: "unset" and
/// the like are `None`; `256 MiB` is bytes; quotes, backticks and a remark in
/// parentheses go.
fn reference_value(written: &str) -> Option<String> {
    let value = written.split(" (").next().unwrap_or(written).trim();
    if ["unset", "none", "unlimited"].contains(&value) {
        return None;
    }
    if value == "empty" {
        return Some(String::new());
    }
    if let Some(mib) = value.strip_suffix(" MiB")
        && let Ok(mib) = mib.parse::<u64>()
    {
        return Some((mib * 1024 * 1024).to_string());
    }
    Some(value.trim_matches('`').trim_matches('"').to_owned())
}

/// The file's value as the reference would write it.
fn file_value(value: Option<&Value>) -> Option<String> {
    value.map(|value| match value {
        Value::String(text) => text.clone(),
        Value::Array(items) if items.is_empty() => "[]".into(),
        other => other.to_string(),
    })
}

/// The reference's table names the keys of the file's fixed sections and of a pool, and
/// gives each the file's default (the pools' from the code, as the loader applies them).
#[test]
fn the_reference_table_agrees_with_default_toml() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(REFERENCE);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let rows = reference_rows(&text);
    assert!(
        rows.len() >= 50,
        "only {} keys read from {REFERENCE}",
        rows.len()
    );
    let mut defaults: Table = toml::from_str(DEFAULT_CONFIG).expect("the defaults are TOML");
    // A pool's defaults are the code's: the file's [pools.default] is one pool's.
    let pool = parsed::<PoolConfig>(&Table::new());
    defaults.insert(
        "pools".into(),
        Value::Table(Table::from_iter([("default".into(), pool)])),
    );
    let documented: Table = toml::from_str(&uncommented()).expect("the uncommented file is TOML");

    let mut wrong = Vec::new();
    for (key, written) in &rows {
        let path: Vec<String> = key.split('.').map(String::from).collect();
        let (section, name) = path.split_at(path.len() - 1);
        let mut copy = documented.clone();
        if !table_at(&mut copy, section).contains_key(&name[0]) {
            wrong.push(format!("{key}: in {REFERENCE}, not in config/default.toml"));
            continue;
        }
        let Some(written) = written else { continue };
        let mut copy = defaults.clone();
        let actual = file_value(table_at(&mut copy, section).get(&name[0]));
        if reference_value(written) != actual {
            wrong.push(format!(
                "{key}: {REFERENCE} says {written}, config/default.toml {}",
                actual.unwrap_or_else(|| "leaves it unset".into())
            ));
        }
    }
    // The other way: each key of the sections the table covers is in it.
    let named: BTreeSet<&str> = rows.iter().map(|(key, _)| key.as_str()).collect();
    for (section, table) in &documented {
        let Some(table) = table.as_table() else {
            continue;
        };
        if matches!(section.as_str(), "request_rules" | "response_rules") {
            continue;
        }
        let keys = match section.as_str() {
            "pools" => table["default"].as_table().expect("[pools.default]"),
            _ => table,
        };
        let prefix = if section == "pools" {
            "pools.default"
        } else {
            section
        };
        for key in keys.keys() {
            let key = format!("{prefix}.{key}");
            if key != "gateway.routes" && !named.contains(key.as_str()) {
                wrong.push(format!("{key}: in config/default.toml, not in {REFERENCE}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
