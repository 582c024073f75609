//! A private CA and a server certificate for the receiver (`vgpu-receiver gen-certs`), and client
//! certificates from that CA for mutual TLS (`vgpu-receiver gen-client-cert`), for trying vgpu out
//! and for its tests. Production clusters use their own PKI (cert-manager, a corporate CA): the
//! receiver only needs a PEM certificate and key (and, for mutual TLS, the CA of its clients), and
//! each agent the CA that signed the receiver's certificate (and its own certificate and key).

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use std::path::Path;

/// PEM texts of a fresh CA, a server certificate for `hosts` (DNS names or IP addresses) signed by
/// it, the server's key, and a random bearer token.
pub struct Bundle {
    pub ca: String,
    pub ca_key: String,
    pub cert: String,
    pub key: String,
    pub token: String,
}

fn err(e: rcgen::Error) -> String {
    format!("cannot make the certificates: {e}")
}

/// The CA's parameters (the same every time, so that its key alone can sign for it again).
fn ca_params() -> Result<CertificateParams, String> {
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "vgpu receiver CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok(ca)
}

pub fn generate(hosts: &[String]) -> Result<Bundle, String> {
    let e = err;
    let ca = ca_params()?;
    let ca_key = KeyPair::generate().map_err(e)?;
    let ca_cert = ca.self_signed(&ca_key).map_err(e)?;
    let ca_key_pem = ca_key.serialize_pem();
    let issuer = Issuer::new(ca, ca_key);
    let mut srv = CertificateParams::new(hosts.to_vec()).map_err(e)?;
    srv.distinguished_name.push(DnType::CommonName, hosts.first().map_or("vgpu-receiver", |h| h.as_str()));
    srv.use_authority_key_identifier_extension = true;
    srv.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    srv.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate().map_err(e)?;
    let cert = srv.signed_by(&key, &issuer).map_err(e)?;
    Ok(Bundle { ca: ca_cert.pem(), ca_key: ca_key_pem, cert: cert.pem(), key: key.serialize_pem(), token: token()? })
}

/// A client certificate for `name` (its common name, and its subject alternative name, which
/// `--require-node-certs` compares with the node's name) and its key, PEM, signed by the CA that
/// `gen-certs` made (given by its key).
pub fn client(ca_key_pem: &str, name: &str) -> Result<(String, String), String> {
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(|e| format!("not a CA key: {e}"))?;
    let issuer = Issuer::new(ca_params()?, ca_key);
    let mut p = CertificateParams::new(vec![name.to_string()]).map_err(err)?;
    p.distinguished_name.push(DnType::CommonName, name);
    p.use_authority_key_identifier_extension = true;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().map_err(err)?;
    let cert = p.signed_by(&key, &issuer).map_err(err)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Whether a client certificate (DER) names `node`: a DNS name (wildcards as in TLS) or an IP
/// address among its subject alternative names. The common name does not count.
pub fn names(cert: &rustls_pki_types::CertificateDer<'_>, node: &str) -> bool {
    let Ok(cert) = webpki::EndEntityCert::try_from(cert) else { return false };
    let Ok(name) = rustls_pki_types::ServerName::try_from(node) else { return false };
    cert.verify_is_valid_for_subject_name(&name).is_ok()
}

/// 32 random bytes, hex.
pub fn token() -> Result<String, String> {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .map_err(|e| format!("cannot read /dev/urandom: {e}"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Writes `ca.pem`, `ca-key.pem` (0600), `server.pem`, `server-key.pem` (0600) and `token` (0600)
/// into `dir`.
pub fn write(dir: &Path, b: &Bundle) -> Result<(), String> {
    write_files(
        dir,
        &[
            ("ca.pem", &b.ca, 0o644),
            ("ca-key.pem", &b.ca_key, 0o600),
            ("server.pem", &b.cert, 0o644),
            ("server-key.pem", &b.key, 0o600),
            ("token", &b.token, 0o600),
        ],
    )
}

/// Writes each `(name, text, mode)` into `dir` (made if needed).
pub fn write_files(dir: &Path, files: &[(&str, &str, u32)]) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for &(name, text, mode) in files {
        let p = dir.join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&p)
            .map_err(|e| format!("cannot write {}: {e}", p.display()))?;
        std::io::Write::write_all(&mut f, text.as_bytes()).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    Ok(())
}
