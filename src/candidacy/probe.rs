//! The app's readiness check: an HTTP GET on the pod's own network (`--app-ready URL`).
//!
//! ## Behaviour
//! - Every `--app-ready-interval` one `GET` (HTTP/1.1, `Connection: close`); a 2xx status line
//!   is ready, anything else (another status, a refused or reset connection, no answer within
//!   the interval, garbage) is not ready. The interval also bounds each probe, so a hung app
//!   counts as failing, never as "still being asked".
//! - Only `http://HOST[:PORT][/PATH]` URLs (the app is next to the sidecar, in the same pod);
//!   the host is resolved for each probe.
//! - Each answer goes to [`Candidacy::answered`]; a change of answer is logged once.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::{info, warn};

use super::{Candidacy, CandidacyTx};
use crate::clock::{self, Deadline};

/// Where to send the probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppUrl {
    /// `host:port`, as dialled.
    pub authority: String,
    /// The request target, starting with `/`.
    pub path: String,
}

impl AppUrl {
    /// Parses `http://HOST[:PORT][/PATH]` (port 80 by default); the error says why not.
    pub fn parse(url: &str) -> Result<AppUrl, String> {
        let rest = url
            .strip_prefix("http://")
            .ok_or("must start with http:// (the app's own readiness endpoint in the pod)")?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.is_empty() || authority.starts_with(':') || authority.contains('@') {
            return Err("must name a host (and no credentials)".into());
        }
        if path.chars().any(|c| c.is_control() || c == ' ') {
            return Err("the path must not contain spaces or control characters".into());
        }
        // An IPv6 literal is bracketed: its colons are not the port's.
        let port = match authority.strip_prefix('[') {
            Some(v6) => match v6.split_once(']') {
                Some((host, "")) if !host.is_empty() => None,
                Some((host, rest)) if !host.is_empty() => rest.strip_prefix(':').map(Some),
                _ => return Err("a bracketed IPv6 host must close its bracket".into()),
            }
            .ok_or("the port must follow the host after a colon")?,
            None => authority.split_once(':').map(|(_, port)| port),
        };
        if port.is_some_and(|p| p.parse::<u16>().map_or(true, |p| p == 0)) {
            return Err("the port must be a number from 1 to 65535".into());
        }
        let authority = match port {
            Some(_) => authority.to_owned(),
            None => format!("{authority}:80"),
        };
        Ok(AppUrl {
            authority,
            path: path.to_owned(),
        })
    }

    /// The `Host` header value.
    fn host(&self) -> &str {
        self.authority
            .strip_suffix(":80")
            .unwrap_or(&self.authority)
    }
}

/// One probe: whether the app answered 2xx within `timeout`.
pub async fn ready(url: &AppUrl, timeout: Duration) -> bool {
    clock::within(timeout, get(url)).await.unwrap_or(false)
}

async fn get(url: &AppUrl) -> bool {
    let Ok(mut stream) = tokio::net::TcpStream::connect(&url.authority).await else {
        return false;
    };
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: redlock-sidecar\r\nConnection: close\r\n\r\n",
        url.path,
        url.host()
    );
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    // The status line is all we need: `HTTP/1.x 2xx ...`.
    let mut head = [0u8; 16];
    let mut read = 0;
    while read < 12 {
        match stream.read(&mut head[read..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => read += n,
        }
    }
    is_2xx(&head[..read])
}

/// Whether `head` starts with an HTTP/1.x status line of class 2xx.
fn is_2xx(head: &[u8]) -> bool {
    head.len() >= 12
        && (head.starts_with(b"HTTP/1.1 ") || head.starts_with(b"HTTP/1.0 "))
        && head[9] == b'2'
        && head[10].is_ascii_digit()
        && head[11].is_ascii_digit()
}

/// Probes `url` every `interval` until the channel's readers are gone, feeding `candidacy`.
pub async fn run(url: AppUrl, interval: Duration, candidacy: CandidacyTx) {
    let mut last = None;
    loop {
        let started = Deadline::now();
        let ok = ready(&url, interval).await;
        if last != Some(ok) {
            if ok {
                info!(app = %url.authority, path = %url.path, "the app is ready");
            } else {
                warn!(app = %url.authority, path = %url.path, "the app is not ready");
            }
            last = Some(ok);
        }
        candidacy.send_modify(|c: &mut Candidacy| c.answered(ok, Deadline::now()));
        if candidacy.is_closed() {
            return;
        }
        clock::sleep_until_deadline(started + interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn urls_name_a_host_a_port_and_a_path() {
        let url = AppUrl::parse("http://localhost:8080/ready?deep=1").unwrap();
        assert_eq!(url.authority, "localhost:8080");
        assert_eq!(url.path, "/ready?deep=1");
        let url = AppUrl::parse("http://app").unwrap();
        assert_eq!((url.authority.as_str(), url.path.as_str()), ("app:80", "/"));
        assert_eq!(url.host(), "app");
        let url = AppUrl::parse("http://[::1]:9000/").unwrap();
        assert_eq!(url.authority, "[::1]:9000");
        for bad in [
            "https://app/",
            "app:80",
            "http://",
            "http://u:p@app/",
            "http://app:0/",
            "http://app:x/",
            "http://app/a b",
            "http://:80/",
            "http://[::1/",
        ] {
            assert!(AppUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_a_2xx_status_line_is_ready() {
        assert!(is_2xx(b"HTTP/1.1 200 OK\r\n"));
        assert!(is_2xx(b"HTTP/1.0 204 No"));
        for bad in [
            &b"HTTP/1.1 503 Service Unavailable"[..],
            b"HTTP/1.1 301 Moved",
            b"HTTP/1.1 2",
            b"SSH-2.0-OpenSSH",
            b"",
        ] {
            assert!(!is_2xx(bad));
        }
    }

    proptest! {
        #[test]
        fn no_url_or_answer_panics(url in ".{0,64}", head in proptest::collection::vec(any::<u8>(), 0..16)) {
            let _ = AppUrl::parse(&format!("http://{url}"));
            let _ = AppUrl::parse(&url);
            let _ = is_2xx(&head);
        }
    }

    #[tokio::test]
    async fn a_probe_is_ready_on_2xx_and_not_on_an_error_a_hang_or_a_closed_port() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let url = AppUrl::parse(&format!("http://127.0.0.1:{port}/ready")).unwrap();
        let answers = [
            Some("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
            Some("HTTP/1.1 503 Service Unavailable\r\n\r\n"),
            None,
        ];
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            for answer in answers {
                let (mut conn, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 512];
                let n = conn.read(&mut buf).await.unwrap();
                assert!(buf[..n].starts_with(b"GET /ready HTTP/1.1\r\n"));
                match answer {
                    Some(answer) => conn.write_all(answer.as_bytes()).await.unwrap(),
                    // A hung app: the connection stays open, nothing is answered.
                    None => held.push(conn),
                }
            }
            held
        });
        let timeout = Duration::from_millis(300);
        assert!(ready(&url, timeout).await);
        assert!(!ready(&url, timeout).await);
        assert!(!ready(&url, timeout).await, "a hang is not ready");
        drop(server.await.unwrap());
        assert!(!ready(&url, timeout).await, "a closed port is not ready");
    }
}
