//! Where the `[nats]` settings come from besides the configuration: the nats CLI's
//! conventions (`-s/--server`, `--creds`, `--nkey`, `--user`, `--password`, `--tlsca`,
//! `--tlscert`/`--tlskey`, `--inbox-prefix`, `--context`, and `NATS_URL`, `NATS_CREDS`,
//! `NATS_NKEY`, `NATS_CERT`/`NATS_KEY`, `NATS_CONTEXT` with the nats CLI's context
//! files), resolved in one pure function into a [`Layer`] that is laid over
//! the configuration's `[nats]`.
//!
//! Precedence, highest first: flags (`-s` before `--context`), then `NATS_CONTEXT`,
//! then `NATS_URL` (and `NATS_CREDS`, `NATS_NKEY`, `NATS_CERT`/`NATS_KEY`), then the configuration (`WEBPROXY_NATS__*`, the
//! file, the compiled default). `NATS_URL` is read here rather than by clap's `env`,
//! which would make it outrank an explicit `--context`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use clap::Args;
use serde::Deserialize;

use crate::config::nats_auth::{NatsConfig, Secret};

/// The nats CLI's connection flags, on every command that talks to NATS.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct ConnectionArgs {
    /// NATS server URL(s), comma-separated [env: NATS_URL].
    #[arg(
        short = 's',
        long = "server",
        visible_alias = "nats",
        value_name = "URL"
    )]
    pub(crate) server: Option<String>,
    /// NATS user credentials file [env: NATS_CREDS].
    #[arg(long, value_name = "FILE", conflicts_with = "user")]
    pub(crate) creds: Option<PathBuf>,
    /// NATS NKey seed file [env: NATS_NKEY].
    #[arg(long, value_name = "FILE", conflicts_with_all = ["user", "creds"])]
    pub(crate) nkey: Option<PathBuf>,
    /// NATS user name; without --password, a token (as the nats CLI reads it).
    #[arg(long, value_name = "USER")]
    pub(crate) user: Option<String>,
    /// NATS password, with --user.
    #[arg(long, value_name = "PASSWORD", requires = "user")]
    pub(crate) password: Option<String>,
    /// The CA that signs the NATS server's certificate; turns TLS on.
    #[arg(long, value_name = "FILE")]
    pub(crate) tlsca: Option<PathBuf>,
    /// Client certificate for TLS, with --tlskey [env: NATS_CERT].
    #[arg(long, value_name = "FILE", requires = "tlskey")]
    pub(crate) tlscert: Option<PathBuf>,
    /// Private key of --tlscert [env: NATS_KEY].
    #[arg(long, value_name = "FILE", requires = "tlscert")]
    pub(crate) tlskey: Option<PathBuf>,
    /// The connection's inbox prefix, for a user whose NATS permissions allow
    /// subscribing only under its own subjects (`callers.a._INBOX`).
    #[arg(long, value_name = "PREFIX")]
    pub(crate) inbox_prefix: Option<String>,
    /// The JetStream API prefix of a JetStream imported from another account, instead
    /// of `$JS.API`.
    #[arg(long, value_name = "PREFIX")]
    pub(crate) js_api_prefix: Option<String>,
    /// A nats CLI context, read from $XDG_CONFIG_HOME/nats/context/NAME.json
    /// [env: NATS_CONTEXT].
    #[arg(long, value_name = "NAME")]
    pub(crate) context: Option<String>,
}

/// The nats CLI's environment variables; an empty one counts as unset.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct NatsEnvironment {
    pub(crate) url: Option<String>,
    pub(crate) creds: Option<PathBuf>,
    pub(crate) nkey: Option<PathBuf>,
    pub(crate) cert: Option<PathBuf>,
    pub(crate) key: Option<PathBuf>,
    pub(crate) context: Option<String>,
}

impl NatsEnvironment {
    pub(crate) fn from_process() -> NatsEnvironment {
        let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
        NatsEnvironment {
            url: var("NATS_URL"),
            creds: var("NATS_CREDS").map(PathBuf::from),
            nkey: var("NATS_NKEY").map(PathBuf::from),
            cert: var("NATS_CERT").map(PathBuf::from),
            key: var("NATS_KEY").map(PathBuf::from),
            context: var("NATS_CONTEXT"),
        }
    }
}

/// How to authenticate: one way at a time, so a higher layer's choice replaces a
/// lower layer's whole.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Auth {
    Creds(PathBuf),
    NkeySeed(PathBuf),
    Token(Secret),
    UserPassword(String, Secret),
}

/// Connection settings from one source; `None` leaves the setting to the sources below.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Layer {
    pub(crate) url: Option<String>,
    pub(crate) auth: Option<Auth>,
    pub(crate) tls_ca_file: Option<PathBuf>,
    /// The client certificate and its key.
    pub(crate) client_cert: Option<(PathBuf, PathBuf)>,
    pub(crate) inbox_prefix: Option<String>,
    pub(crate) js_api_prefix: Option<String>,
}

impl Layer {
    /// `self` with every setting `higher` has replaced by `higher`'s.
    fn under(self, higher: Layer) -> Layer {
        Layer {
            url: higher.url.or(self.url),
            auth: higher.auth.or(self.auth),
            tls_ca_file: higher.tls_ca_file.or(self.tls_ca_file),
            client_cert: higher.client_cert.or(self.client_cert),
            inbox_prefix: higher.inbox_prefix.or(self.inbox_prefix),
            js_api_prefix: higher.js_api_prefix.or(self.js_api_prefix),
        }
    }

    /// Lays these settings over the configuration's `[nats]`: an authentication
    /// replaces whichever the configuration names.
    pub(crate) fn apply(&self, nats: &mut NatsConfig) {
        if let Some(url) = &self.url {
            nats.url.clone_from(url);
        }
        if let Some(auth) = &self.auth {
            nats.credentials_file = None;
            nats.nkey_seed_file = None;
            nats.token = None;
            nats.user = None;
            nats.password = None;
            match auth {
                Auth::Creds(path) => nats.credentials_file = Some(path.clone()),
                Auth::NkeySeed(path) => nats.nkey_seed_file = Some(path.clone()),
                Auth::Token(token) => nats.token = Some(token.clone()),
                Auth::UserPassword(user, password) => {
                    nats.user = Some(user.clone());
                    nats.password = Some(password.clone());
                }
            }
        }
        if let Some(ca) = &self.tls_ca_file {
            nats.tls_ca_file = Some(ca.clone());
        }
        if let Some((cert, key)) = &self.client_cert {
            nats.tls_cert_file = Some(cert.clone());
            nats.tls_key_file = Some(key.clone());
        }
        if let Some(prefix) = &self.inbox_prefix {
            nats.inbox_prefix = Some(prefix.clone());
        }
        if let Some(prefix) = &self.js_api_prefix {
            nats.js_api_prefix = Some(prefix.clone());
        }
    }
}

/// The context to read: `--context`, else `NATS_CONTEXT`.
pub(crate) fn context_name<'a>(
    flags: &'a ConnectionArgs,
    env: &'a NatsEnvironment,
) -> Option<&'a str> {
    flags.context.as_deref().or(env.context.as_deref())
}

/// The one precedence: `NATS_URL`, `NATS_CREDS` (before `NATS_NKEY`, the nats CLI's
/// order) and `NATS_CERT`/`NATS_KEY`, under the context's settings, under the flags.
pub(crate) fn resolve(
    flags: &ConnectionArgs,
    env: &NatsEnvironment,
    context: Option<Layer>,
) -> Layer {
    let environment = Layer {
        url: env.url.clone(),
        auth: env
            .creds
            .clone()
            .map(Auth::Creds)
            .or_else(|| env.nkey.clone().map(Auth::NkeySeed)),
        // One of the pair alone is left to the layers below, as a context's is refused:
        // a certificate without its key cannot be used.
        client_cert: env.cert.clone().zip(env.key.clone()),
        ..Layer::default()
    };
    let auth = match (&flags.creds, &flags.nkey, &flags.user, &flags.password) {
        (Some(creds), _, _, _) => Some(Auth::Creds(creds.clone())),
        (None, Some(seed), _, _) => Some(Auth::NkeySeed(seed.clone())),
        (None, None, Some(user), Some(password)) => Some(Auth::UserPassword(
            user.clone(),
            Secret::new(password.clone()),
        )),
        (None, None, Some(token), None) => Some(Auth::Token(Secret::new(token.clone()))),
        (None, None, None, _) => None,
    };
    let flags = Layer {
        url: flags.server.clone(),
        auth,
        tls_ca_file: flags.tlsca.clone(),
        client_cert: flags.tlscert.clone().zip(flags.tlskey.clone()),
        inbox_prefix: flags.inbox_prefix.clone(),
        js_api_prefix: flags.js_api_prefix.clone(),
    };
    environment.under(context.unwrap_or_default()).under(flags)
}

/// Resolves the flags with the process's environment, reading the chosen context.
pub(crate) fn overrides(flags: &ConnectionArgs) -> anyhow::Result<Layer> {
    let env = NatsEnvironment::from_process();
    let home = std::env::home_dir();
    let context = match context_name(flags, &env) {
        Some(name) => {
            let dir = context_dir(std::env::var_os("XDG_CONFIG_HOME"), home.as_deref())?;
            Some(read_context(&dir, name, home.as_deref())?)
        }
        None => None,
    };
    Ok(resolve(flags, &env, context))
}

/// `$XDG_CONFIG_HOME/nats/context`, with `~/.config` when the variable is unset or
/// empty, as the nats CLI has it.
pub(crate) fn context_dir(
    xdg_config_home: Option<OsString>,
    home: Option<&Path>,
) -> anyhow::Result<PathBuf> {
    let base = match xdg_config_home.filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => home
            .context("cannot find the nats contexts: neither XDG_CONFIG_HOME nor HOME is set")?
            .join(".config"),
    };
    Ok(base.join("nats").join("context"))
}

/// A nats CLI context file. Keys webproxy has no use for (`description`,
/// `jetstream_domain`, ...) are ignored, as other nats tools ignore keys they do not
/// know.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ContextFile {
    url: String,
    token: String,
    user: String,
    password: String,
    creds: String,
    nkey: String,
    cert: String,
    key: String,
    ca: String,
    inbox_prefix: String,
    jetstream_api_prefix: String,
    nsc: String,
}

/// Reads the context `name` from `dir`.
fn read_context(dir: &Path, name: &str, home: Option<&Path>) -> anyhow::Result<Layer> {
    if name.is_empty() || name.contains("..") || name.contains('/') || name.contains('\\') {
        bail!("invalid nats context name {name:?}");
    }
    let path = dir.join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read nats context {name:?} at {}", path.display()))?;
    context_layer(&text, home).with_context(|| format!("nats context {}", path.display()))
}

/// The settings a context file's text names (pure). Among several ways to
/// authenticate, the nats CLI's order decides: user, creds, nkey, token.
fn context_layer(text: &str, home: Option<&Path>) -> anyhow::Result<Layer> {
    let file: ContextFile = serde_json::from_str(text).context("is not a context file")?;
    if !file.nsc.is_empty() {
        bail!("uses an nsc lookup (\"nsc\"), which webproxy does not run; give \"creds\" instead");
    }
    let set = |value: String| Some(value).filter(|v| !v.is_empty());
    let path = |value: String| set(value).map(|v| expand_home(&v, home));
    let auth = if let Some(user) = set(file.user) {
        Some(Auth::UserPassword(user, Secret::new(file.password)))
    } else if let Some(creds) = path(file.creds) {
        Some(Auth::Creds(creds))
    } else if let Some(seed) = path(file.nkey) {
        Some(Auth::NkeySeed(seed))
    } else {
        set(file.token).map(|t| Auth::Token(Secret::new(t)))
    };
    let client_cert = match (path(file.cert), path(file.key)) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => bail!("names only one of \"cert\" and \"key\"; a client certificate needs both"),
    };
    Ok(Layer {
        url: set(file.url),
        auth,
        tls_ca_file: path(file.ca),
        client_cert,
        inbox_prefix: set(file.inbox_prefix),
        js_api_prefix: set(file.jetstream_api_prefix),
    })
}

/// `~/x` under the home directory, as the nats CLI expands its contexts' paths.
fn expand_home(path: &str, home: Option<&Path>) -> PathBuf {
    match (path.strip_prefix("~/"), home) {
        (Some(rest), Some(home)) => home.join(rest),
        _ => PathBuf::from(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(layer: &Layer) -> Option<&str> {
        layer.url.as_deref()
    }

    fn context(url: &str) -> Option<Layer> {
        Some(Layer {
            url: Some(url.into()),
            ..Layer::default()
        })
    }

    #[test]
    fn each_step_of_the_precedence() {
        let mut flags = ConnectionArgs::default();
        let mut env = NatsEnvironment::default();
        // Nothing set: the configuration decides.
        assert_eq!(resolve(&flags, &env, None), Layer::default());
        env.url = Some("nats://from-nats-url:4222".into());
        assert_eq!(
            url(&resolve(&flags, &env, None)),
            Some("nats://from-nats-url:4222")
        );
        // A context (NATS_CONTEXT or --context) outranks NATS_URL...
        assert_eq!(
            url(&resolve(&flags, &env, context("nats://ctx:4222"))),
            Some("nats://ctx:4222")
        );
        // ...but a context without a URL leaves it to NATS_URL.
        assert_eq!(
            url(&resolve(&flags, &env, Some(Layer::default()))),
            Some("nats://from-nats-url:4222")
        );
        // -s outranks the context.
        flags.server = Some("nats://flag:4222".into());
        assert_eq!(
            url(&resolve(&flags, &env, context("nats://ctx:4222"))),
            Some("nats://flag:4222")
        );
    }

    #[test]
    fn the_context_flag_outranks_nats_context() {
        let mut flags = ConnectionArgs::default();
        let env = NatsEnvironment {
            context: Some("from-env".into()),
            ..NatsEnvironment::default()
        };
        assert_eq!(context_name(&flags, &env), Some("from-env"));
        flags.context = Some("from-flag".into());
        assert_eq!(context_name(&flags, &env), Some("from-flag"));
        assert_eq!(
            context_name(&ConnectionArgs::default(), &NatsEnvironment::default()),
            None
        );
    }

    #[test]
    fn authentication_is_replaced_whole() {
        let env = NatsEnvironment {
            creds: Some("/env.creds".into()),
            ..NatsEnvironment::default()
        };
        let mut flags = ConnectionArgs::default();
        assert_eq!(
            resolve(&flags, &env, None).auth,
            Some(Auth::Creds("/env.creds".into()))
        );
        let ctx = Layer {
            auth: Some(Auth::Token(Secret::new("007"))),
            ..Layer::default()
        };
        assert_eq!(
            resolve(&flags, &env, Some(ctx.clone())).auth,
            Some(Auth::Token(Secret::new("007")))
        );
        flags.user = Some("alice".into());
        flags.password = Some("1.50".into());
        assert_eq!(
            resolve(&flags, &env, Some(ctx)).auth,
            Some(Auth::UserPassword("alice".into(), Secret::new("1.50")))
        );
        // --user alone is a token, as the nats CLI has it.
        flags.password = None;
        assert_eq!(
            resolve(&flags, &env, None).auth,
            Some(Auth::Token(Secret::new("alice")))
        );

        let mut nats = crate::config::nats_auth::tests::nats();
        nats.token = Some(Secret::new("config-token"));
        nats.tls_ca_file = Some("/config-ca.pem".into());
        let layer = Layer {
            auth: Some(Auth::Creds("/flag.creds".into())),
            ..Layer::default()
        };
        layer.apply(&mut nats);
        assert_eq!(nats.token, None);
        assert_eq!(nats.credentials_file, Some("/flag.creds".into()));
        assert_eq!(nats.tls_ca_file, Some("/config-ca.pem".into()));
        assert!(
            crate::config::nats_auth::check(&nats).is_err(),
            "the file is absent"
        );
    }

    #[test]
    fn the_nkey_flag_outranks_nats_nkey_and_a_context() {
        let auth = |f: &ConnectionArgs, e: &NatsEnvironment, c| resolve(f, e, c).auth;
        let seed = |path: &str| Some(Auth::NkeySeed(path.into()));
        let mut env = NatsEnvironment {
            nkey: Some("/env.nk".into()),
            ..NatsEnvironment::default()
        };
        let mut flags = ConnectionArgs::default();
        assert_eq!(auth(&flags, &env, None), seed("/env.nk"));
        // NATS_CREDS comes first, as the nats CLI orders its ways to authenticate.
        env.creds = Some("/env.creds".into());
        assert_eq!(
            auth(&flags, &env, None),
            Some(Auth::Creds("/env.creds".into()))
        );
        let token = Some(Auth::Token(Secret::new("007")));
        let ctx = Layer {
            auth: token.clone(),
            ..Layer::default()
        };
        assert_eq!(auth(&flags, &env, Some(ctx.clone())), token);
        flags.nkey = Some("/flag.nk".into());
        assert_eq!(auth(&flags, &env, Some(ctx)), seed("/flag.nk"));
        let mut nats = crate::config::nats_auth::tests::nats();
        nats.credentials_file = Some("/config.creds".into());
        resolve(&flags, &env, None).apply(&mut nats);
        assert_eq!(nats.credentials_file, None);
        assert_eq!(nats.nkey_seed_file, Some("/flag.nk".into()));
    }

    #[test]
    fn the_client_certificate_flags_outrank_nats_cert_and_a_context() {
        let pair = |c: &str, k: &str| Some((PathBuf::from(c), PathBuf::from(k)));
        let mut env = NatsEnvironment {
            cert: Some("/env.pem".into()),
            ..NatsEnvironment::default()
        };
        let mut flags = ConnectionArgs::default();
        // NATS_CERT without NATS_KEY is no client certificate.
        assert_eq!(resolve(&flags, &env, None).client_cert, None);
        env.key = Some("/env-key.pem".into());
        assert_eq!(
            resolve(&flags, &env, None).client_cert,
            pair("/env.pem", "/env-key.pem")
        );
        let ctx = Layer {
            client_cert: pair("/ctx.pem", "/ctx-key.pem"),
            ..Layer::default()
        };
        assert_eq!(
            resolve(&flags, &env, Some(ctx.clone())).client_cert,
            pair("/ctx.pem", "/ctx-key.pem")
        );
        flags.tlscert = Some("/flag.pem".into());
        flags.tlskey = Some("/flag-key.pem".into());
        assert_eq!(
            resolve(&flags, &env, Some(ctx)).client_cert,
            pair("/flag.pem", "/flag-key.pem")
        );
        let mut nats = crate::config::nats_auth::tests::nats();
        nats.tls_cert_file = Some("/config.pem".into());
        nats.tls_key_file = Some("/config-key.pem".into());
        resolve(&flags, &env, None).apply(&mut nats);
        assert_eq!(nats.tls_cert_file, Some("/flag.pem".into()));
        assert_eq!(nats.tls_key_file, Some("/flag-key.pem".into()));
    }

    /// A prefix flag, the nats CLI context's key for it, and the `[nats]` key it sets.
    type PrefixSetting = (
        fn(&mut ConnectionArgs) -> &mut Option<String>,
        &'static str,
        fn(&mut NatsConfig) -> &mut Option<String>,
        &'static str,
    );

    #[test]
    fn the_prefix_flags_outrank_a_context_and_the_configuration() {
        let settings: [PrefixSetting; 2] = [
            (
                |f| &mut f.inbox_prefix,
                "inbox_prefix",
                |n| &mut n.inbox_prefix,
                "nats.inbox_prefix",
            ),
            (
                |f| &mut f.js_api_prefix,
                "jetstream_api_prefix",
                |n| &mut n.js_api_prefix,
                "nats.js_api_prefix",
            ),
        ];
        let env = NatsEnvironment::default();
        for (flag, context_key, config, config_key) in settings {
            let mut flags = ConnectionArgs::default();
            let ctx = context_layer(&format!(r#"{{"{context_key}": "ctx.X"}}"#), None)
                .expect("a context");
            let mut nats = crate::config::nats_auth::tests::nats();
            *config(&mut nats) = Some("config.X".into());
            // Nothing set: the configuration's stays.
            resolve(&flags, &env, None).apply(&mut nats);
            assert_eq!(
                config(&mut nats).as_deref(),
                Some("config.X"),
                "{config_key}"
            );
            resolve(&flags, &env, Some(ctx.clone())).apply(&mut nats);
            assert_eq!(config(&mut nats).as_deref(), Some("ctx.X"), "{config_key}");
            *flag(&mut flags) = Some("callers.a.X".into());
            resolve(&flags, &env, Some(ctx)).apply(&mut nats);
            assert_eq!(config(&mut nats).as_deref(), Some("callers.a.X"));
            assert!(
                crate::config::nats_auth::check(&nats).is_ok(),
                "{config_key}"
            );
            for bad in ["", "callers.*.X", "callers..x", "a >", "callers.>"] {
                *config(&mut nats) = Some(bad.into());
                let e = crate::config::nats_auth::check(&nats).expect_err(bad);
                assert_eq!(e.key, config_key);
            }
        }
    }

    #[test]
    fn a_context_file_maps_onto_the_nats_settings() {
        let home = Path::new("/home/op");
        let layer = context_layer(
            r#"{"description": "prod", "url": "nats://a:4222,nats://b:4222", "token": "",
                "user": "", "password": "", "creds": "~/prod.creds", "nkey": "",
                "cert": "/c.pem", "key": "/k.pem", "ca": "~/ca.pem",
                "jetstream_domain": "hub", "color_scheme": "", "future_key": {"x": 1}}"#,
            Some(home),
        )
        .expect("a context");
        assert_eq!(url(&layer), Some("nats://a:4222,nats://b:4222"));
        assert_eq!(layer.auth, Some(Auth::Creds("/home/op/prod.creds".into())));
        assert_eq!(layer.tls_ca_file, Some("/home/op/ca.pem".into()));
        assert_eq!(layer.client_cert, Some(("/c.pem".into(), "/k.pem".into())));

        let layer = context_layer(r#"{"user": "u", "password": "007", "token": "t"}"#, None)
            .expect("a context");
        assert_eq!(
            layer.auth,
            Some(Auth::UserPassword("u".into(), Secret::new("007")))
        );
        assert_eq!(layer.url, None);
        let layer = context_layer(r#"{"token": "007"}"#, None).expect("a context");
        assert_eq!(layer.auth, Some(Auth::Token(Secret::new("007"))));
        let layer = context_layer(r#"{"nkey": "/u.nk"}"#, None).expect("a context");
        assert_eq!(layer.auth, Some(Auth::NkeySeed("/u.nk".into())));
    }

    #[test]
    fn a_context_webproxy_cannot_follow_is_refused() {
        let e = context_layer(r#"{"nsc": "nsc://op/acc/user"}"#, None).expect_err("nsc");
        assert!(format!("{e:#}").contains("nsc"), "{e:#}");
        let e = context_layer(r#"{"cert": "/c.pem"}"#, None).expect_err("no key");
        assert!(format!("{e:#}").contains("\"key\""), "{e:#}");
        assert!(context_layer("not json", None).is_err());
        let dir = tempfile::tempdir().expect("tempdir");
        for name in ["", "../x", "a/b"] {
            let e = read_context(dir.path(), name, None).expect_err("bad name");
            assert!(
                format!("{e:#}").contains("invalid nats context name"),
                "{e:#}"
            );
        }
        let e = read_context(dir.path(), "missing", None).expect_err("absent");
        assert!(format!("{e:#}").contains("missing.json"), "{e:#}");
    }

    #[test]
    fn contexts_live_under_xdg_config_home_or_home() {
        let home = Path::new("/home/op");
        assert_eq!(
            context_dir(Some("/xdg".into()), Some(home)).expect("dir"),
            Path::new("/xdg/nats/context")
        );
        for unset in [None, Some(OsString::new())] {
            assert_eq!(
                context_dir(unset, Some(home)).expect("dir"),
                Path::new("/home/op/.config/nats/context")
            );
        }
        assert!(context_dir(None, None).is_err());
    }
}
