//! Gateway route tables the gateway tests share.

use crate::ServiceOptions;

/// Two token routes to `upstream`: `/a` (token in `Proxy-Authorization`) and `/b`
/// (token in `X-Gateway-Token`), their tokens from the environment ([`token_options`]).
pub fn token_routes(upstream: &str) -> String {
    format!(
        "[[gateway.routes]]\npath = \"/a\"\nupstream = \"{upstream}\"\ntoken = {{ env = \"GW_TOKEN_A\" }}\n\n\
         [[gateway.routes]]\npath = \"/b\"\nupstream = \"{upstream}\"\ntoken = {{ env = \"GW_TOKEN_B\" }}\ntoken_header = \"X-Gateway-Token\"\n"
    )
}

/// The environment [`token_routes`] reads its tokens from: `alpha-secret` for `/a`,
/// `beta-secret` for `/b`.
pub fn token_options() -> ServiceOptions {
    ServiceOptions::default()
        .env("GW_TOKEN_A", "alpha-secret")
        .env("GW_TOKEN_B", "beta-secret")
}
