//! `webproxy serve` as a subprocess with its own config, log and HTTP port.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tempfile::TempDir;
use tokio::time::Instant;

use crate::NatsServer;

/// Generous because the first start on a cold 2-core machine also creates
/// streams and consumers.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How many times an instance is started again on another port when its health port
/// was taken before it could bind it.
const PORT_TRIES: usize = 3;

const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Proxy settings would let the service route loopback upstream traffic off
/// the machine; tests must only ever talk to 127.0.0.1.
/// The nats CLI's variables, which outrank the config file's `[nats]`: a developer's
/// own must not point the binary under test elsewhere.
pub const NATS_CLI_VARS: &[&str] = &[
    "NATS_URL",
    "NATS_CREDS",
    "NATS_NKEY",
    "NATS_CERT",
    "NATS_KEY",
    "NATS_CONTEXT",
];

const PROXY_VARS: &[&str] = &[
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
];

/// The `webproxy` binary under test: `$WEBPROXY_BIN` if set, else the one in
/// the same target profile dir as the running test executable.
pub fn webproxy_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("WEBPROXY_BIN") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "WEBPROXY_BIN={} is not a file",
            path.display()
        );
        return path;
    }
    let exe = std::env::current_exe().expect("path of the running test executable");
    // Integration tests live in target/<profile>/deps/; the binary one level up.
    let mut dir = exe
        .parent()
        .expect("test executable has a parent dir")
        .to_path_buf();
    if dir.file_name().is_some_and(|name| name == "deps") {
        dir.pop();
    }
    let path = dir.join(format!("webproxy{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} not found: run `cargo build -p webproxy` first (`just test` does), \
         or set WEBPROXY_BIN",
        path.display()
    );
    path
}

/// Runs the `webproxy` binary with `args` (a CLI command, not `serve`) to its end,
/// with the log level it would have for a user.
pub async fn run_webproxy(args: &[&str]) -> std::process::Output {
    let mut command = tokio::process::Command::new(webproxy_bin());
    for var in NATS_CLI_VARS {
        command.env_remove(var);
    }
    command
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .await
        .expect("run webproxy")
}

/// A running `webproxy serve`, killed when dropped.
pub struct Service {
    // Held so the config and log outlive the process.
    _dir: TempDir,
    config_path: PathBuf,
    log_path: PathBuf,
    port: u16,
    pid: u32,
    // A Mutex so `&self` methods can check for (and reap) an exit, and so a
    // signal is never sent to a pid that has been reaped and reused.
    child: Mutex<Child>,
}

/// The variable that lets the service reach the tests' loopback upstreams, which
/// the address guard denies by default.
pub const ALLOW_PRIVATE_NETWORKS: &str = "WEBPROXY_OUTBOUND__ALLOW_PRIVATE_NETWORKS";

/// Each pool's replies and dead-letter streams' max_bytes in tests (64 MiB each).
const TEST_STREAM_MAX_BYTES: &str = "67108864";

/// How a [`Service`] is started beyond its config file.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    /// Sets `WEBPROXY_OUTBOUND__ALLOW_PRIVATE_NETWORKS=true` (the default), so the
    /// service may reach loopback upstreams. Guard tests turn it off and configure the
    /// guard in the config file instead.
    pub allow_private_networks: bool,
    /// Extra `WEBPROXY_*` (or other) variables for the process, set last.
    pub env: Vec<(String, String)>,
    /// Another `webproxy` binary than [`webproxy_bin`], e.g. an older version.
    pub binary: Option<PathBuf>,
}

impl Default for ServiceOptions {
    fn default() -> Self {
        ServiceOptions {
            allow_private_networks: true,
            env: Vec::new(),
            binary: None,
        }
    }
}

impl ServiceOptions {
    /// The guard as the config file says (denying loopback unless it opens it).
    pub fn guarded() -> Self {
        ServiceOptions {
            allow_private_networks: false,
            ..ServiceOptions::default()
        }
    }

    /// Runs `binary` instead of [`webproxy_bin`].
    pub fn binary(mut self, binary: impl Into<PathBuf>) -> Self {
        self.binary = Some(binary.into());
        self
    }

    /// Adds an environment variable.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }
}

impl Service {
    /// Starts the service against `nats` and waits until `/readyz` is 200.
    /// `config` is appended verbatim after the generated `[nats]` and `[http]`
    /// tables, so it must start with a table header of its own. The service may
    /// reach loopback upstreams (see [`ServiceOptions`]).
    pub async fn start(nats: &NatsServer, config: &str) -> Service {
        Self::start_with_url(&nats.url(), config).await
    }

    /// Like [`Service::start`] with an explicit NATS URL (e.g. a cluster seed
    /// list).
    pub async fn start_with_url(nats_url: &str, config: &str) -> Service {
        Self::start_with(nats_url, config, ServiceOptions::default()).await
    }

    /// Like [`Service::start_with_url`] with explicit options.
    pub async fn start_with(nats_url: &str, config: &str, options: ServiceOptions) -> Service {
        let service = Self::spawn(nats_url, config, options.clone());
        service
            .ready_on_a_free_port(nats_url, config, options)
            .await
    }

    /// `count` instances on one `config`, started together (so they race for what
    /// instances race for: seeding, leases), then each waited for until ready.
    pub async fn start_many(nats_url: &str, config: &str, count: usize) -> Vec<Service> {
        Self::start_each(nats_url, config, vec![ServiceOptions::default(); count]).await
    }

    /// One instance per entry of `options` (one with a skewed clock beside others on
    /// time, say), on one `config`, started together as [`Service::start_many`]'s.
    pub async fn start_each(
        nats_url: &str,
        config: &str,
        options: Vec<ServiceOptions>,
    ) -> Vec<Service> {
        let spawned: Vec<(Service, ServiceOptions)> = options
            .into_iter()
            .map(|options| (Self::spawn(nats_url, config, options.clone()), options))
            .collect();
        let mut services = Vec::with_capacity(spawned.len());
        for (service, options) in spawned {
            services.push(
                service
                    .ready_on_a_free_port(nats_url, config, options)
                    .await,
            );
        }
        services
    }

    /// Waits until this instance is ready; when it exited because its health port was
    /// taken between [`crate::free_port`]'s pick and its own bind (another process can
    /// bind a port in between), starts it again on another, a few times at most.
    async fn ready_on_a_free_port(
        self,
        nats_url: &str,
        config: &str,
        options: ServiceOptions,
    ) -> Service {
        let mut service = self;
        for _ in 0..PORT_TRIES {
            if service.wait_ready_unless_port_taken(READY_TIMEOUT).await {
                return service;
            }
            eprintln!("webproxy's health port was taken before it bound it; another port");
            service = Self::spawn(nats_url, config, options.clone());
        }
        service.wait_ready(READY_TIMEOUT).await;
        service
    }

    /// Like [`Service::start_with`], without waiting for it to be ready (for an
    /// instance that is expected to stay not ready; see [`Service::is_ready`]).
    pub fn spawn(nats_url: &str, config: &str, options: ServiceOptions) -> Service {
        Self::spawn_command(nats_url, config, options, None)
    }

    /// `webproxy serve`, or with `gateway_port`, `webproxy gateway` listening on it
    /// (its health listener on the port [`Service::health_url`] names). For the
    /// gateway the fixture writes `[gateway]` with both listeners, so `config` starts
    /// with more of its keys (or a table of its own).
    pub(crate) fn spawn_command(
        nats_url: &str,
        config: &str,
        options: ServiceOptions,
        gateway_port: Option<u16>,
    ) -> Service {
        let written = if gateway_port.is_some() {
            ["[nats]", "[http]", "[gateway]"].as_slice()
        } else {
            ["[nats]", "[http]"].as_slice()
        };
        for table in written {
            assert!(
                !config.lines().any(|line| line.trim() == *table),
                "Service config must not contain {table}: the fixture writes it"
            );
        }
        let dir = tempfile::Builder::new()
            .prefix("webproxy-service-")
            .tempdir()
            .expect("create a tempdir for webproxy");
        let config_path = dir.path().join("webproxy.toml");
        let log_path = dir.path().join("webproxy.log");
        let port = crate::free_port();
        let url = toml::Value::String(nats_url.to_owned());
        let (subcommand, text) = match gateway_port {
            None => (
                "serve",
                format!(
                    "[nats]\nurl = {url}\n\n[http]\nlisten = \"127.0.0.1:{port}\"\n\n{config}\n"
                ),
            ),
            Some(listen) => (
                "gateway",
                format!(
                    "[nats]\nurl = {url}\n\n[gateway]\nlisten = \"127.0.0.1:{listen}\"\nhealth_listen = \"127.0.0.1:{port}\"\n{config}\n"
                ),
            ),
        };
        fs::write(&config_path, text).expect("write webproxy config");

        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("open webproxy log file");
        let binary = options.binary.clone().unwrap_or_else(webproxy_bin);
        let mut command = Command::new(binary);
        command
            .arg(subcommand)
            .arg("--config")
            .arg(&config_path)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone webproxy log file"))
            .stderr(log);
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "info");
        }
        for var in PROXY_VARS.iter().chain(NATS_CLI_VARS) {
            command.env_remove(var);
        }
        // The service's settings must come from the config file the test
        // wrote, not from whatever WEBPROXY_* or OTEL_* (which switches span export
        // on) the developer has exported.
        for (var, _) in std::env::vars_os() {
            if var
                .to_str()
                .is_some_and(|var| var.starts_with("WEBPROXY_") || var.starts_with("OTEL_"))
            {
                command.env_remove(var);
            }
        }
        if options.allow_private_networks {
            command.env(ALLOW_PRIVATE_NETWORKS, "true");
        }
        // JetStream reserves a stream's max_bytes against free disk when it creates the
        // stream; the defaults (256 MiB for each pool's replies and dead-letter
        // streams), times the pools of a test and the servers of tests running in
        // parallel, would fail on a machine with little free disk. Tests store a few
        // megabytes at most; a test of three pools reserves 384 MiB.
        for var in [
            "WEBPROXY_STREAMS__REPLY_MAX_BYTES",
            "WEBPROXY_STREAMS__DEAD_MAX_BYTES",
        ] {
            command.env(var, TEST_STREAM_MAX_BYTES);
        }
        for (name, value) in &options.env {
            command.env(name, value);
        }
        let child = command.spawn().expect("spawn webproxy");

        Service {
            _dir: dir,
            config_path,
            log_path,
            port,
            pid: child.id(),
            child: Mutex::new(child),
        }
    }

    /// Whether `GET /readyz` answers 200 now.
    pub async fn is_ready(&self) -> bool {
        crate::http_client()
            .get(format!("{}/readyz", self.health_url()))
            .timeout(Duration::from_secs(1))
            .send()
            .await
            .is_ok_and(|r| r.status() == reqwest::StatusCode::OK)
    }

    /// `GET /readyz`'s status and body; `(0, "")` when it does not answer.
    pub async fn readiness(&self) -> (u16, String) {
        let Ok(response) = crate::http_client()
            .get(format!("{}/readyz", self.health_url()))
            .timeout(Duration::from_secs(1))
            .send()
            .await
        else {
            return (0, String::new());
        };
        let status = response.status().as_u16();
        (status, response.text().await.unwrap_or_default())
    }

    /// `/readyz`'s body once it answers 503 with a line containing `naming`; panics
    /// if `within` passes first.
    pub async fn not_ready_naming(&self, within: Duration, naming: &str) -> String {
        crate::wait_for(within, &format!("/readyz 503 naming {naming}"), || async {
            let (status, text) = self.readiness().await;
            (status == 503 && text.contains(naming)).then_some(text)
        })
        .await
    }

    /// The value of one series on `GET /metrics`, named with its labels exactly as
    /// exposed (`webproxy_in_flight{pool="default"}`); `None` when it is not exposed
    /// or the scrape fails.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let text = crate::http_client()
            .get(format!("{}/metrics", self.health_url()))
            .timeout(Duration::from_secs(1))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
    }

    /// `http://127.0.0.1:PORT`, the service's health/metrics listener.
    pub fn health_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Everything the process wrote to stdout and stderr so far.
    pub fn logs(&self) -> String {
        fs::read(&self.log_path)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The CPU time (user and system) the process has used so far.
    pub fn cpu_time(&self) -> Duration {
        crate::process::cpu_time(self.pid)
    }

    /// SIGKILL, like a crash, and reap. A no-op if it already exited.
    pub fn kill(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
        // Err means it already exited, which is what we want anyway.
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGTERM, asking for a graceful shutdown; see [`Service::wait_exit`].
    /// A no-op if the process already exited.
    pub fn terminate(&self) {
        let mut child = self.lock_child();
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        // Sent while holding the lock: the pid can't be reaped (and reused)
        // in between.
        let status = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .expect("run `kill -TERM`");
        assert!(
            status.success(),
            "`kill -TERM {}` failed: {status}",
            self.pid
        );
    }

    /// The exit status once the process exits, or `None` if it is still
    /// running after `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit_status() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// Polls `GET /readyz` until it answers 200; panics with the service's
    /// logs if `timeout` passes or the process exits first.
    pub async fn wait_ready(&self, timeout: Duration) {
        assert!(
            self.wait_ready_unless_port_taken(timeout).await,
            "webproxy exited: its health port {} was taken\n{}",
            self.port,
            self.log_tail()
        );
    }

    /// [`Service::wait_ready`], but `false` when the process exited because its health
    /// port was in use.
    async fn wait_ready_unless_port_taken(&self, timeout: Duration) -> bool {
        let client = crate::http_client();
        let url = format!("{}/readyz", self.health_url());
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit_status() {
                let log = self.log_tail();
                if log.contains("cannot listen on") && log.contains("Address already in use") {
                    return false;
                }
                panic!("webproxy exited ({status}) before {url} returned 200\n{log}");
            }
            let attempt = client
                .get(&url)
                .timeout(Duration::from_secs(1))
                .send()
                .await;
            let last = match attempt {
                Ok(response) if response.status() == reqwest::StatusCode::OK => return true,
                Ok(response) => format!("HTTP {}", response.status()),
                Err(error) => error.to_string(),
            };
            if Instant::now() >= deadline {
                panic!(
                    "webproxy not ready after {timeout:?}: {url} last gave {last}\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    fn exit_status(&self) -> Option<ExitStatus> {
        self.lock_child().try_wait().ok().flatten()
    }

    fn lock_child(&self) -> MutexGuard<'_, Child> {
        // A panicking test must not turn every later call (and Drop) into a
        // second panic.
        self.child.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn log_tail(&self) -> String {
        format!(
            "config {}\n--- webproxy log ---\n{}",
            self.config_path.display(),
            crate::tail(&self.logs(), 32 * 1024)
        )
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}
