//! A real nats-server per test: JetStream on (unless a test asks for a server
//! without), 127.0.0.1 only, a port of its own and a store dir of its own, killed when
//! dropped.

use std::fs::{self, File};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// Covers a cold start on a loaded 2-core CI machine with room to spare.
const START_TIMEOUT: Duration = Duration::from_secs(10);
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Room for every stream a test provisions (each pool reserves its reply and
/// dead-letter budgets, 512 MiB by default), whatever the disk has free.
const MAX_FILE_STORE: &str = "1TB";

/// A running `nats-server` (the first one on PATH; `just test` puts a recent
/// enough one there) with its config, log and JetStream store in a tempdir.
pub struct NatsServer {
    /// The executable: `nats-server` from PATH, or one a test names.
    binary: PathBuf,
    dir: TempDir,
    store_dir: PathBuf,
    ports_dir: PathBuf,
    config_path: PathBuf,
    log_path: PathBuf,
    output_path: PathBuf,
    extra_config: String,
    /// False for a server that answers NATS but not JetStream (no `jetstream` block).
    jetstream: bool,
    port: u16,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a JetStream-enabled server on a random 127.0.0.1 port.
    pub fn start() -> NatsServer {
        Self::start_with("")
    }

    /// Like [`NatsServer::start`], with `extra_config` (nats-server config
    /// syntax, e.g. an `authorization { .. }` block) appended to the config.
    /// It must not set `listen`, `jetstream`, `log_file` or `ports_file_dir`.
    pub fn start_with(extra_config: &str) -> NatsServer {
        Self::start_from(PathBuf::from("nats-server"), extra_config)
    }

    /// Like [`NatsServer::start`], with the executable at `binary` (another version).
    pub fn start_binary(binary: impl Into<PathBuf>) -> NatsServer {
        Self::start_from(binary.into(), "")
    }

    /// A server with JetStream off: NATS answers, a JetStream publish gets "no
    /// responders", as for a JetStream that lost its quorum.
    pub fn start_without_jetstream() -> NatsServer {
        Self::start_configured(PathBuf::from("nats-server"), "", false)
    }

    fn start_from(binary: PathBuf, extra_config: &str) -> NatsServer {
        Self::start_configured(binary, extra_config, true)
    }

    fn start_configured(binary: PathBuf, extra_config: &str, jetstream: bool) -> NatsServer {
        let dir = tempfile::Builder::new()
            .prefix("webproxy-nats-")
            .tempdir()
            .expect("create a tempdir for nats-server");
        let ports_dir = dir.path().join("ports");
        fs::create_dir(&ports_dir).expect("create nats-server ports dir");
        let mut server = NatsServer {
            binary,
            store_dir: dir.path().join("jetstream"),
            config_path: dir.path().join("nats-server.conf"),
            log_path: dir.path().join("nats-server.log"),
            output_path: dir.path().join("nats-server.out"),
            ports_dir,
            extra_config: extra_config.to_owned(),
            jetstream,
            port: 0,
            child: None,
            dir,
        };
        server.spawn(None);
        server
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The running server's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The CPU time the running server has used so far (zero when it is not running).
    pub fn cpu_time(&self) -> Duration {
        self.pid().map_or(Duration::ZERO, crate::process::cpu_time)
    }

    /// `http://127.0.0.1:PORT` of the monitoring endpoint (`/varz`, ...), when the
    /// server was started with one (`http: "127.0.0.1:-1"` in its extra config).
    pub fn monitoring_url(&self) -> Option<String> {
        let pid = self.pid()?;
        let ports = self.ports_file(&format!("_{pid}.ports"))?;
        Some(ports.get("monitoring")?.get(0)?.as_str()?.to_string())
    }

    /// The JetStream store dir; it survives [`NatsServer::restart`].
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    /// The server's own log (it survives restarts, so it tells the whole story).
    pub fn logs(&self) -> String {
        let mut logs = read_lossy(&self.log_path);
        // Config errors are printed before the log file is opened.
        let output = read_lossy(&self.output_path);
        if !output.trim().is_empty() {
            logs.push_str("\n--- nats-server stdout/stderr ---\n");
            logs.push_str(&output);
        }
        logs
    }

    /// Kills the server (SIGKILL, like a crash) and starts it again on the
    /// same port with the same store dir; returns once it accepts connections.
    pub fn restart(&mut self) {
        self.kill();
        self.start_again();
    }

    /// Stops the server as an orchestrator restarting it would (SIGTERM: it shuts
    /// JetStream down, writing its stores' state) and starts it again on the same port
    /// with the same store dir; returns once it accepts connections. What was in memory
    /// storage is gone.
    pub fn restart_gracefully(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(pid) = i32::try_from(child.id()) {
                // Err means it already exited, which is what we want anyway.
                let _ = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
            let _ = child.wait();
        }
        self.start_again();
    }

    /// Starts the server again after [`NatsServer::kill`], on the same port with the
    /// same store dir; returns once it accepts connections. With a wait between the
    /// two, a test makes an outage of a known length.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "nats-server is still running");
        self.spawn(Some(self.port));
    }

    /// SIGKILLs the server and reaps it. Clients see a dropped connection.
    /// A no-op if it is not running.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Err means it already exited, which is what we want anyway.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// An unauthenticated client, retrying for up to 10 s while the server
    /// comes up.
    pub async fn client(&self) -> async_nats::Client {
        self.client_with(async_nats::ConnectOptions::new).await
    }

    /// Like [`NatsServer::client`], but reconnecting every 100 ms instead of with
    /// async-nats' backoff, which grows to 4 s: for timing a recovery, so that the
    /// figure is the service's and not the test client's.
    pub async fn quick_client(&self) -> async_nats::Client {
        self.client_with(|| {
            async_nats::ConnectOptions::new()
                .reconnect_delay_callback(|_| Duration::from_millis(100))
        })
        .await
    }

    /// A client built from fresh `options()` on each attempt (credentials for
    /// servers started with an `authorization` block), retrying for up to 10 s.
    pub async fn client_with<F>(&self, mut options: F) -> async_nats::Client
    where
        F: FnMut() -> async_nats::ConnectOptions,
    {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match options().connect(self.url()).await {
                Ok(client) => return client,
                Err(_) if Instant::now() < deadline => tokio::time::sleep(POLL_INTERVAL).await,
                Err(error) => panic!(
                    "could not connect to nats-server at {} within {START_TIMEOUT:?}: {error}\n{}",
                    self.url(),
                    self.log_tail()
                ),
            }
        }
    }

    /// Writes the config (random port on first start, the known port on
    /// restarts), starts the process and waits until it accepts connections.
    fn spawn(&mut self, port: Option<u16>) {
        self.write_config(port);
        // A SIGKILLed server leaves its ports file behind; drop it so only the
        // new process's file can be found.
        for entry in fs::read_dir(&self.ports_dir).expect("list nats-server ports dir") {
            let path = entry.expect("read nats-server ports dir entry").path();
            fs::remove_file(&path).expect("remove stale nats-server ports file");
        }
        let output = File::options()
            .create(true)
            .append(true)
            .open(&self.output_path)
            .expect("open nats-server output file");
        let child = Command::new(&self.binary)
            .arg("-c")
            .arg(&self.config_path)
            .stdin(Stdio::null())
            .stdout(output.try_clone().expect("clone nats-server output file"))
            .stderr(output)
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "could not run `{}`: {error}. Run tests via `just test`, \
                     or put the directory printed by scripts/ensure-nats-server.sh first on PATH",
                    self.binary.display()
                )
            });
        let pid = child.id();
        // Owned by self from here on, so a panic below still kills it on drop.
        self.child = Some(child);

        let found = self.wait_for_ports_file(pid);
        if let Some(expected) = port {
            assert_eq!(
                found,
                expected,
                "restarted nats-server came up on another port\n{}",
                self.log_tail()
            );
        }
        self.port = found;
        self.wait_accepting();
    }

    fn write_config(&self, port: Option<u16>) {
        // -1 lets the server pick a free port itself: no window in which
        // another test could grab one we picked.
        let listen = match port {
            Some(port) => format!("127.0.0.1:{port}"),
            None => "127.0.0.1:-1".to_owned(),
        };
        // JetStream reserves each stream's max_bytes against max_file_store,
        // which by default is 75% of the disk free when the server starts: on
        // a CI machine with little disk left, provisioning then fails with
        // "insufficient storage resources" though tests write only kilobytes.
        // A fixed limit makes the reservations the same on every machine.
        let jetstream = if self.jetstream {
            format!(
                "jetstream {{\n  store_dir: {}\n  max_file_store: {MAX_FILE_STORE}\n}}\n",
                quote_path(&self.store_dir)
            )
        } else {
            String::new()
        };
        let config = format!(
            "listen: {listen}\n\
             {jetstream}\
             log_file: {log}\n\
             ports_file_dir: {ports}\n\
             \n{extra}\n",
            listen = quote(&listen),
            log = quote_path(&self.log_path),
            ports = quote_path(&self.ports_dir),
            extra = self.extra_config,
        );
        fs::write(&self.config_path, config).expect("write nats-server config");
    }

    /// The server writes `<exe>_<pid>.ports` (JSON, `{"nats":["nats://host:port"],..}`)
    /// once it listens; matching on the pid ignores how the binary was invoked.
    fn wait_for_ports_file(&mut self, pid: u32) -> u16 {
        let suffix = format!("_{pid}.ports");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(port) = self.read_ports_file(&suffix) {
                return port;
            }
            self.panic_if_exited("before reporting its port");
            if Instant::now() >= deadline {
                panic!(
                    "nats-server (pid {pid}) wrote no ports file in {} within {START_TIMEOUT:?}\n{}",
                    self.ports_dir.display(),
                    self.log_tail()
                );
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// `None` until the file exists and parses (it may be caught half-written).
    fn read_ports_file(&self, suffix: &str) -> Option<u16> {
        let ports = self.ports_file(suffix)?;
        let url = ports.get("nats")?.get(0)?.as_str()?;
        url.rsplit(':').next()?.parse().ok()
    }

    /// The ports file whose name ends in `suffix`, parsed.
    fn ports_file(&self, suffix: &str) -> Option<serde_json::Value> {
        let path = fs::read_dir(&self.ports_dir)
            .ok()?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .find(|path| {
                path.file_name()
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| name.ends_with(suffix))
            })?;
        serde_json::from_slice(&fs::read(path).ok()?).ok()
    }

    /// The ports file is a strong hint; a completed TCP connect is the proof.
    fn wait_accepting(&mut self) {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return;
            }
            self.panic_if_exited("before accepting connections");
            if Instant::now() >= deadline {
                panic!(
                    "nats-server did not accept connections on {addr} within {START_TIMEOUT:?}\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    fn panic_if_exited(&mut self, when: &str) {
        let Some(child) = self.child.as_mut() else {
            return;
        };
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "nats-server exited ({status}) {when}; config {}\n{}",
                self.config_path.display(),
                self.log_tail()
            );
        }
    }

    fn log_tail(&self) -> String {
        format!(
            "--- nats-server log ({}) ---\n{}",
            self.dir.path().display(),
            crate::tail(&self.logs(), 16 * 1024)
        )
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// A double-quoted nats-server config string; its escapes are JSON's.
fn quote(text: &str) -> String {
    serde_json::to_string(text).expect("serialize a string")
}

fn quote_path(path: &Path) -> String {
    quote(path.to_str().expect("tempdir paths are UTF-8"))
}
