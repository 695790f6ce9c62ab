//! What the gateway tests share: route tables and reading an answer's headers.

use reqwest::Response;

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

/// The text of `response`'s header `name`, which it must have.
pub fn header<'a>(response: &'a Response, name: &str) -> &'a str {
    response
        .headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header"))
        .to_str()
        .expect("text")
}
