//! A private CA and a server certificate for the receiver (`vgpu-receiver gen-certs`), and client
//! certificates from that CA for mutual TLS (`vgpu-receiver gen-client-cert`), for trying vgpu out
//! and for its tests. Production clusters use their own PKI (cert-manager, a corporate CA): the
//! receiver only needs a PEM certificate and key (and, for mutual TLS, the CA of its clients), and
//! each agent the CA that signed the receiver's certificate (and its own certificate and key).

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use std::path::{Path, PathBuf};

/// PEM texts of a fresh CA, a server certificate for `hosts` (DNS names or IP addresses) signed by
/// it, the server's key, and a random bearer token.
pub struct Bundle {
    pub ca: String,
    pub ca_key: String,
    pub cert: String,
    pub key: String,
    pub token: String,
}

/// Why certificates, a token or their files could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("cannot make the certificates: {0}")]
    Make(#[from] rcgen::Error),
    #[error("not a CA key: {0}")]
    CaKey(rcgen::Error),
    #[error("cannot read /dev/urandom: {0}")]
    Random(std::io::Error),
    #[error("cannot create {}: {source}", path.display())]
    CreateDir { path: PathBuf, source: std::io::Error },
    #[error("cannot write {}: {source}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
}

/// The CA's parameters (the same every time, so that its key alone can sign for it again).
fn ca_params() -> Result<CertificateParams, CertError> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "vgpu receiver CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok(ca)
}

pub fn generate(hosts: &[String]) -> Result<Bundle, CertError> {
    let ca = ca_params()?;
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let ca_key_pem = ca_key.serialize_pem();
    let issuer = Issuer::new(ca, ca_key);
    let mut srv = CertificateParams::new(hosts.to_vec())?;
    srv.distinguished_name.push(DnType::CommonName, hosts.first().map_or("vgpu-receiver", |h| h.as_str()));
    srv.use_authority_key_identifier_extension = true;
    srv.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    srv.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate()?;
    let cert = srv.signed_by(&key, &issuer)?;
    Ok(Bundle { ca: ca_cert.pem(), ca_key: ca_key_pem, cert: cert.pem(), key: key.serialize_pem(), token: token()? })
}

/// A client certificate for `name` (its common name, and its subject alternative name, which
/// `--require-node-certs` compares with the node's name) and its key, PEM, signed by the CA that
/// `gen-certs` made (given by its key).
pub fn client(ca_key_pem: &str, name: &str) -> Result<(String, String), CertError> {
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(CertError::CaKey)?;
    let issuer = Issuer::new(ca_params()?, ca_key);
    let mut p = CertificateParams::new(vec![name.to_string()])?;
    p.distinguished_name.push(DnType::CommonName, name);
    p.use_authority_key_identifier_extension = true;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, &issuer)?;
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
pub fn token() -> Result<String, CertError> {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .map_err(CertError::Random)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Writes `ca.pem`, `ca-key.pem` (0600), `server.pem`, `server-key.pem` (0600) and `token` (0600)
/// into `dir`.
pub fn write(dir: &Path, b: &Bundle) -> Result<(), CertError> {
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
pub fn write_files(dir: &Path, files: &[(&str, &str, u32)]) -> Result<(), CertError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir).map_err(|source| CertError::CreateDir { path: dir.to_owned(), source })?;
    for &(name, text, mode) in files {
        let p = dir.join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&p)
            .map_err(|source| CertError::Write { path: p.clone(), source })?;
        std::io::Write::write_all(&mut f, text.as_bytes())
            .map_err(|source| CertError::Write { path: p.clone(), source })?;
    }
    Ok(())
}
