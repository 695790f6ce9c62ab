//! A test certificate authority made at test time with rcgen: a CA, a server
//! certificate for 127.0.0.1 and localhost, and a client certificate, as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

/// PEM files in a directory of the caller's.
pub struct TestCa {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TestCa {
    /// Generates the CA and both certificates into `dir`.
    pub fn generate(dir: &Path) -> TestCa {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "webproxy test CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);

        let leaf = |names: Vec<String>, common_name: &str| {
            let key = KeyPair::generate().expect("leaf key");
            let mut params = CertificateParams::new(names).expect("leaf params");
            params
                .distinguished_name
                .push(DnType::CommonName, common_name);
            let cert = params.signed_by(&key, &issuer).expect("leaf certificate");
            (cert.pem(), key.serialize_pem())
        };
        let (server_pem, server_key_pem) = leaf(
            vec!["127.0.0.1".to_string(), "localhost".to_string()],
            "nats-server",
        );
        let (client_pem, client_key_pem) = leaf(vec!["webproxy".to_string()], "webproxy");

        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {name}: {e}"));
            path
        };
        TestCa {
            ca: write("ca.pem", &ca_cert.pem()),
            server_cert: write("server.pem", &server_pem),
            server_key: write("server-key.pem", &server_key_pem),
            client_cert: write("client.pem", &client_pem),
            client_key: write("client-key.pem", &client_key_pem),
        }
    }
}
