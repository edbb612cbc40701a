//! TLS material for tests: a CA, a server certificate for 127.0.0.1 and client certificates,
//! made with openssl, and Redis nodes that serve TLS only.

use std::process::Command;

use super::{free_port, RedisNode, TempDir};

/// Runs `script` with `sh` in `dir`, panicking with openssl's complaint on failure.
pub fn sh(dir: &TempDir, script: &str) {
    let status = Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(dir.path())
        .output()
        .expect("sh runs");
    assert!(
        status.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&status.stderr)
    );
}

/// In `dir`: `ca.crt`/`ca.key`, `server.crt`/`server.key` for 127.0.0.1 and
/// `client.crt`/`client.key`, all signed by that CA.
pub fn make_certs(dir: &TempDir) {
    sh(dir, "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 1 -subj /CN=redlock-test-ca");
    sh(dir, "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1");
    sh(dir, "printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext && openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt -days 1 -extfile san.ext");
    client_cert(dir, "ca", "client");
}

/// In `dir`: `<name>.crt`/`<name>.key`, a client certificate signed by the CA `<ca>.crt`.
pub fn client_cert(dir: &TempDir, ca: &str, name: &str) {
    sh(dir, &format!("openssl req -newkey rsa:2048 -nodes -keyout {name}.key -out {name}.csr -subj /CN=redlock-{name}"));
    sh(dir, &format!("printf 'extendedKeyUsage=clientAuth\\n' > client.ext && openssl x509 -req -in {name}.csr -CA {ca}.crt -CAkey {ca}.key -CAcreateserial -out {name}.crt -days 1 -extfile client.ext"));
}

/// In `dir`: a second CA, `<name>.crt`/`<name>.key`.
pub fn make_ca(dir: &TempDir, name: &str) {
    sh(dir, &format!("openssl req -x509 -newkey rsa:2048 -nodes -keyout {name}.key -out {name}.crt -days 1 -subj /CN=redlock-{name}"));
}

/// A Redis node serving TLS only, with the certificates of [`make_certs`] and `extra`
/// arguments; its `rediss://` URL.
pub fn tls_node_with(dir: &TempDir, auth_clients: &str, extra: &[&str]) -> (RedisNode, String) {
    let tls_port = free_port().to_string();
    let path = |f: &str| dir.path().join(f).display().to_string();
    let mut args = vec![
        "--tls-port".to_owned(),
        tls_port.clone(),
        "--tls-cert-file".to_owned(),
        path("server.crt"),
        "--tls-key-file".to_owned(),
        path("server.key"),
        "--tls-ca-cert-file".to_owned(),
        path("ca.crt"),
        "--tls-auth-clients".to_owned(),
        auth_clients.to_owned(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let node = RedisNode::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
    (node, format!("rediss://127.0.0.1:{tls_port}"))
}

/// [`tls_node_with`] without extra arguments.
pub fn tls_node(dir: &TempDir, auth_clients: &str) -> (RedisNode, String) {
    tls_node_with(dir, auth_clients, &[])
}
