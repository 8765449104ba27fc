//! Mutual TLS between agents and the collector: each side proves who it is with a
//! certificate signed by a CA the operator gives (or the one `roce-trace certs` makes).
//!
//! - The collector presents its certificate (its names: what agents dial) and requires
//!   one from every agent, signed by the CA.
//! - An agent's certificate names its node (a DNS subject alternative name): a HELLO for
//!   any other node is refused, so a host's key speaks for that host only.
//! - An agent checks the collector's certificate against the CA and the name it dialled:
//!   a rogue collector learns nothing and cannot steer it.
//!
//! rustls with the ring provider (the one fleet mode's NATS client uses); TLS 1.3 and
//! 1.2.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::Context as _;
use rustls::{ClientConfig, RootCertStore, ServerConfig, server::WebPkiClientVerifier};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file (a chain: the leaf first).
pub fn load_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("{}: not a PEM certificate file: {e}", path.display()))?;
    anyhow::ensure!(!certs.is_empty(), "{}: no certificate in it", path.display());
    Ok(certs)
}

/// A private key from a PEM file that only its owner can read (checked like the token
/// file: a key others can read is refused).
pub fn load_key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    crate::sys::check_secret_file(path, "private key")?;
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| anyhow::anyhow!("{}: not a PEM private key: {e}", path.display()))
}

fn roots(ca: &Path) -> anyhow::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(ca)? {
        roots
            .add(c)
            .map_err(|e| anyhow::anyhow!("{}: not a usable CA certificate: {e}", ca.display()))?;
    }
    Ok(roots)
}

/// Where the collector's TLS material is.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// This side's certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM, readable by its owner only).
    pub key: PathBuf,
    /// The CA that signs the other side's certificates (PEM).
    pub ca: PathBuf,
}

/// The collector's side: its certificate, and agents' certificates required and checked
/// against the CA.
pub fn server_config(f: &TlsFiles) -> anyhow::Result<Arc<ServerConfig>> {
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots(&f.ca)?), provider())
        .build()
        .map_err(|e| anyhow::anyhow!("{}: {e}", f.ca.display()))?;
    let cfg = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(load_certs(&f.cert)?, load_key(&f.key)?)
        .with_context(|| format!("{} and {}", f.cert.display(), f.key.display()))?;
    Ok(Arc::new(cfg))
}

/// An agent's side: the collector's certificate checked against the CA, this node's
/// certificate presented.
pub fn client_config(f: &TlsFiles) -> anyhow::Result<Arc<ClientConfig>> {
    let cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_root_certificates(roots(&f.ca)?)
        .with_client_auth_cert(load_certs(&f.cert)?, load_key(&f.key)?)
        .with_context(|| format!("{} and {}", f.cert.display(), f.key.display()))?;
    Ok(Arc::new(cfg))
}

/// The name an agent checks the collector's certificate for: the host of `host:port`
/// (an IP address or a DNS name), unless given.
pub fn server_name(collector: &str, given: Option<&str>) -> anyhow::Result<ServerName<'static>> {
    let host = match given {
        Some(n) => n,
        None => collector
            .rsplit_once(':')
            .map_or(collector, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']'),
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ServerName::IpAddress(ip.into()));
    }
    ServerName::try_from(host.to_owned())
        .map_err(|e| anyhow::anyhow!("`{host}` is not a name a certificate can be checked for: {e}"))
}

/// Whether the (already verified) certificate `cert` names `node`: one of its DNS subject
/// alternative names is `node`. Why not, if not.
pub fn cert_names_node(cert: &CertificateDer<'_>, node: &str) -> Result<(), String> {
    let ee = webpki::EndEntityCert::try_from(cert).map_err(|e| format!("unreadable certificate: {e}"))?;
    let name = ServerName::try_from(node)
        .map_err(|_| format!("node `{node}` is not a DNS name its certificate could carry"))?;
    ee.verify_is_valid_for_subject_name(&name)
        .map_err(|_| format!("the certificate is not for node `{node}`"))
}

/// What `roce-trace certs` writes: a CA, the collector's certificate and one per node,
/// each key readable by its owner only. Existing files are not overwritten.
pub struct Issued {
    pub files: Vec<PathBuf>,
}

/// The current year (UTC), for validity periods.
fn this_year() -> i32 {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    1970 + (secs / 31_556_952) as i32
}

/// Makes a CA and certificates for the collector (`collector_names`: the DNS names and
/// IP addresses agents dial) and for each of `nodes` (its name as a DNS SAN) in `dir`:
/// `ca.pem`, `ca.key`, `collector.pem`, `collector.key`, `NODE.pem`, `NODE.key`. ECDSA
/// P-256; valid from the start of this year, the CA for 10 years, the others for 3.
pub fn create(dir: &Path, collector_names: &[String], nodes: &[String]) -> anyhow::Result<Issued> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
        date_time_ymd,
    };
    anyhow::ensure!(
        !collector_names.is_empty(),
        "name the collector (--collector-name, as agents dial it)"
    );
    for n in nodes {
        ServerName::try_from(n.as_str())
            .map_err(|_| anyhow::anyhow!("node `{n}` is not a DNS name a certificate can carry"))?;
        anyhow::ensure!(
            n != "ca" && n != "collector" && !n.contains('/'),
            "node `{n}`: its files would clash with the CA's or the collector's"
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let year = this_year();
    let mut files = Vec::new();
    let mut write = |name: String, text: String, secret: bool| -> anyhow::Result<()> {
        let path = dir.join(name);
        crate::sys::write_new(&path, text.as_bytes(), if secret { 0o600 } else { 0o644 }).with_context(
            || {
                format!(
                    "creating {} (an existing file is never overwritten)",
                    path.display()
                )
            },
        )?;
        files.push(path);
        Ok(())
    };
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, "roce-trace CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = date_time_ymd(year, 1, 1);
    ca.not_after = date_time_ymd(year + 10, 1, 1);
    let ca_cert = ca.self_signed(&ca_key)?;
    write("ca.pem".into(), ca_cert.pem(), false)?;
    write("ca.key".into(), ca_key.serialize_pem(), true)?;
    let mut leaf = |file: &str, names: Vec<String>, usage: ExtendedKeyUsagePurpose| -> anyhow::Result<()> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(names.clone()).map_err(|e| anyhow::anyhow!("{names:?}: {e}"))?;
        p.distinguished_name.push(DnType::CommonName, names[0].clone());
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![usage];
        p.use_authority_key_identifier_extension = true;
        p.not_before = date_time_ymd(year, 1, 1);
        p.not_after = date_time_ymd(year + 3, 1, 1);
        let cert = p.signed_by(&key, &ca_cert, &ca_key)?;
        write(format!("{file}.pem"), cert.pem(), false)?;
        write(format!("{file}.key"), key.serialize_pem(), true)?;
        Ok(())
    };
    leaf(
        "collector",
        collector_names.to_vec(),
        ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    for n in nodes {
        leaf(n, vec![n.clone()], ExtendedKeyUsagePurpose::ClientAuth)?;
    }
    Ok(Issued { files })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_made_here_name_their_node_and_no_other() {
        let dir = std::env::temp_dir().join(format!("rt-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let issued = create(
            &dir,
            &["collector.lab".into(), "10.0.0.1".into()],
            &["h1".into(), "leaf-1".into()],
        )
        .unwrap();
        assert_eq!(issued.files.len(), 8);
        // Keys are readable by their owner only.
        use std::os::unix::fs::PermissionsExt as _;
        for f in &issued.files {
            let mode = std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
            let want = if f.extension().is_some_and(|e| e == "key") {
                0o600
            } else {
                0o644
            };
            assert_eq!(mode, want, "{}", f.display());
        }
        let h1 = load_certs(&dir.join("h1.pem")).unwrap();
        assert_eq!(cert_names_node(&h1[0], "h1"), Ok(()));
        assert!(cert_names_node(&h1[0], "leaf-1").is_err());
        assert!(cert_names_node(&h1[0], "h1.evil").is_err());
        assert!(
            cert_names_node(&h1[0], "bad name!")
                .unwrap_err()
                .contains("not a DNS name")
        );
        // Both sides' configurations load from them.
        let files = |leaf: &str| TlsFiles {
            cert: dir.join(format!("{leaf}.pem")),
            key: dir.join(format!("{leaf}.key")),
            ca: dir.join("ca.pem"),
        };
        server_config(&files("collector")).unwrap();
        client_config(&files("h1")).unwrap();
        // Nothing is overwritten.
        let again = create(&dir, &["collector.lab".into()], &[]).err().unwrap();
        assert!(format!("{again:#}").contains("never overwritten"), "{again:#}");
        // A key others can read is refused.
        std::fs::set_permissions(dir.join("h1.key"), std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(client_config(&files("h1")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_name_checked_is_the_host_dialled() {
        assert_eq!(
            server_name("10.0.0.1:4792", None).unwrap(),
            ServerName::IpAddress("10.0.0.1".parse::<IpAddr>().unwrap().into())
        );
        assert_eq!(
            server_name("[fd00::1]:4792", None).unwrap(),
            ServerName::IpAddress("fd00::1".parse::<IpAddr>().unwrap().into())
        );
        assert_eq!(
            server_name("collector.lab:4792", None).unwrap(),
            ServerName::try_from("collector.lab").unwrap()
        );
        assert_eq!(
            server_name("10.0.0.1:4792", Some("c.lab")).unwrap(),
            ServerName::try_from("c.lab").unwrap()
        );
    }
}
