//! A nats-server with deploy/nats/authorization.conf's accounts, users and permissions,
//! plus a user who may do anything in each account (to observe what callers cannot,
//! and to show that the account boundary holds whatever a user's permissions say).

use crate::NatsServer;

/// The accounts, users and permissions the repository ships, as the tests run them.
pub const AUTHORIZATION: &str = include_str!("../../../deploy/nats/authorization.conf");

/// The user with every permission in webproxy's account, added by the fixture.
pub const ADMIN: &str = "admin";

/// The user with every permission in the callers' account, added by the fixture.
pub const CALLERS_ADMIN: &str = "callers_admin";

/// The service's user in the file.
pub const SERVICE_USER: &str = "webproxy";

/// The HTTP gateway's user in the file.
pub const GATEWAY_USER: &str = "gateway";

/// The operators' user in the file (`config push`, `pools`, `dead`).
pub const OPERATOR_USER: &str = "operator";

/// webproxy's account in the file.
pub const SERVICE_ACCOUNT: &str = "WEBPROXY";

/// The callers' account in the file.
pub const CALLERS_ACCOUNT: &str = "CALLERS";

/// The password of `user` on [`NatsServer::start_authorized`]'s servers.
pub fn password(user: &str) -> String {
    format!("{user}-pw")
}

impl NatsServer {
    /// A server with deploy/nats/authorization.conf's accounts and users (`webproxy`,
    /// `gateway`, `operator`, `caller_a`, `caller_b`, each with the password [`password`] gives)
    /// and their permissions, plus [`ADMIN`] in webproxy's account and
    /// [`CALLERS_ADMIN`] in the callers' account, who may publish and subscribe to
    /// anything there.
    pub fn start_authorized() -> NatsServer {
        NatsServer::start_authorized_from(AUTHORIZATION)
    }

    /// Like [`NatsServer::start_authorized`], with `authorization` (the file changed by
    /// a test) instead of the file.
    pub fn start_authorized_from(authorization: &str) -> NatsServer {
        let with_admins = with_user(
            &with_user(authorization, SERVICE_ACCOUNT, ADMIN),
            CALLERS_ACCOUNT,
            CALLERS_ADMIN,
        );
        let variables: String = [
            ("SERVICE_NATS_PASSWORD", SERVICE_USER),
            ("OPERATOR_NATS_PASSWORD", OPERATOR_USER),
            ("GATEWAY_NATS_PASSWORD", GATEWAY_USER),
            ("CALLER_A_NATS_PASSWORD", "caller_a"),
            ("CALLER_B_NATS_PASSWORD", "caller_b"),
        ]
        .iter()
        .map(|(variable, user)| format!("{variable}: \"{}\"\n", password(user)))
        .collect();
        NatsServer::start_with(&format!("{variables}\n{with_admins}"))
    }
}

/// `config` with `user` (every permission, [`password`]'s password) added to the
/// users of `account`.
fn with_user(config: &str, account: &str, user: &str) -> String {
    let account_start = format!("\n  {account}: {{");
    let users = "users: [";
    let at = config
        .find(&account_start)
        .and_then(|start| {
            config[start..]
                .find(users)
                .map(|at| start + at + users.len())
        })
        .unwrap_or_else(|| {
            panic!("deploy/nats/authorization.conf has no `{users}` list in account {account}")
        });
    format!(
        "{}\n      {{ user: {user}, password: \"{}\" }}{}",
        &config[..at],
        password(user),
        &config[at..]
    )
}
