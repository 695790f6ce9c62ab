//! A nats-server with deploy/nats/authorization.conf's users and permissions, plus an
//! `admin` who may do anything (to observe what callers cannot).

use crate::NatsServer;

/// The users and permissions the repository ships, as the tests run them.
pub const AUTHORIZATION: &str = include_str!("../../../deploy/nats/authorization.conf");

/// The user with every permission the fixtures add to the file's users.
pub const ADMIN: &str = "admin";

/// The service's user in the file.
pub const SERVICE_USER: &str = "webproxy";

/// The password of `user` on [`NatsServer::start_authorized`]'s servers.
pub fn password(user: &str) -> String {
    format!("{user}-pw")
}

impl NatsServer {
    /// A server with deploy/nats/authorization.conf's users (`webproxy`, `caller_a`,
    /// `caller_b`, each with the password [`password`] gives) and their permissions,
    /// plus [`ADMIN`], who may publish and subscribe to anything.
    pub fn start_authorized() -> NatsServer {
        let users = "users = [";
        assert!(
            AUTHORIZATION.contains(users),
            "deploy/nats/authorization.conf has no `{users}` list to add the admin to"
        );
        let with_admin = AUTHORIZATION.replacen(
            users,
            &format!(
                "{users}\n    {{ user: {ADMIN}, password: \"{}\" }}",
                password(ADMIN)
            ),
            1,
        );
        NatsServer::start_with(&format!(
            "SERVICE_NATS_PASSWORD: \"{}\"\n\
             CALLER_A_NATS_PASSWORD: \"{}\"\n\
             CALLER_B_NATS_PASSWORD: \"{}\"\n\n{with_admin}",
            password(SERVICE_USER),
            password("caller_a"),
            password("caller_b"),
        ))
    }
}
