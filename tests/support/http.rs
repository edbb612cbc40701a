//! A minimal HTTP/1.1 client over tokio `TcpStream` for the sidecar's admin port:
//! one request per connection (`Connection: close`), `Content-Length` and chunked bodies,
//! and a server-sent-events reader.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Whole-request timeout of [`get`] / [`request`].
pub const TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    /// In arrival order; names as sent.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    /// First header with this name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> Result<serde_json::Value, String> {
        serde_json::from_str(&self.body)
            .map_err(|e| format!("body is not JSON ({e}): {}", self.body))
    }
}

pub async fn get(addr: SocketAddr, path: &str) -> Result<Response, String> {
    request("GET", addr, path).await
}

pub async fn request(method: &str, addr: SocketAddr, path: &str) -> Result<Response, String> {
    request_with_body(method, addr, path, None).await
}

/// [`request`] with a whole-request timeout of its own instead of [`TIMEOUT`]: for requests
/// that wait on purpose (a lock acquisition with a `wait`) or must give up sooner.
pub async fn request_within(
    method: &str,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<Response, String> {
    let run = async {
        let mut conn = Conn::open(addr, method, path, None, &[]).await?;
        let (status, headers) = conn.read_head().await?;
        let body = conn.read_body(&headers).await?;
        Ok(Response {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(timeout, run)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "{method} http://{addr}{path}: timed out after {timeout:?}"
            ))
        })
}

/// `body` is `(content_type, text)`.
pub async fn request_with_body(
    method: &str,
    addr: SocketAddr,
    path: &str,
    body: Option<(&str, &str)>,
) -> Result<Response, String> {
    let run = async {
        let mut conn = Conn::open(addr, method, path, body, &[]).await?;
        let (status, headers) = conn.read_head().await?;
        let no_body = method.eq_ignore_ascii_case("HEAD")
            || (100..200).contains(&status)
            || status == 204
            || status == 304;
        let body = if no_body {
            Vec::new()
        } else {
            conn.read_body(&headers).await?
        };
        Ok(Response {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(TIMEOUT, run)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "{method} http://{addr}{path}: timed out after {TIMEOUT:?}"
            ))
        })
}

/// Opens a server-sent-events stream at `path` and returns the `data:` payloads of the first
/// `n` events (multi-line data joined with `\n`; comments and data-less events skipped).
/// Fails if the status is not 200, the stream ends early, or `timeout` passes first.
pub async fn sse_events(
    addr: SocketAddr,
    path: &str,
    n: usize,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    let mut events = Vec::new();
    let run = async {
        let mut conn =
            Conn::open(addr, "GET", path, None, &[("Accept", "text/event-stream")]).await?;
        let (status, headers) = conn.read_head().await?;
        if status != 200 {
            let body = conn.read_body(&headers).await.unwrap_or_default();
            return Err(format!(
                "SSE {path}: status {status}: {}",
                String::from_utf8_lossy(&body)
            ));
        }
        let chunked = is_chunked(&headers);
        let mut raw = std::mem::take(&mut conn.buf);
        let mut text = Vec::new();
        let mut parser = SseParser::default();
        loop {
            if chunked {
                let (data, used, done) = decode_chunks(&raw)?;
                raw.drain(..used);
                text.extend_from_slice(&data);
                parser.feed(&mut text, &mut events, n);
                if events.len() >= n {
                    return Ok(());
                }
                if done {
                    return Err(format!(
                        "SSE {path}: stream ended after {} events",
                        events.len()
                    ));
                }
            } else {
                text.append(&mut raw);
                parser.feed(&mut text, &mut events, n);
                if events.len() >= n {
                    return Ok(());
                }
            }
            if !conn.fill(&mut raw).await? {
                return Err(format!(
                    "SSE {path}: stream ended after {} events",
                    events.len()
                ));
            }
        }
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(Ok(())) => Ok(events),
        Ok(Err(e)) => Err(format!("{e}; got so far: {events:?}")),
        Err(_) => Err(format!(
            "SSE {path}: only {} of {n} events within {timeout:?}: {events:?}",
            events.len()
        )),
    }
}

struct Conn {
    stream: TcpStream,
    /// Bytes read past what has been consumed so far.
    buf: Vec<u8>,
}

impl Conn {
    async fn open(
        addr: SocketAddr,
        method: &str,
        path: &str,
        body: Option<(&str, &str)>,
        extra_headers: &[(&str, &str)],
    ) -> Result<Conn, String> {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        for (k, v) in extra_headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        match body {
            Some((content_type, text)) => req.push_str(&format!(
                "Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n{text}",
                text.len()
            )),
            None if matches!(method, "POST" | "PUT" | "PATCH") => {
                req.push_str("Content-Length: 0\r\n\r\n")
            }
            None => req.push_str("\r\n"),
        }
        stream
            .write_all(req.as_bytes())
            .await
            .map_err(|e| format!("send request: {e}"))?;
        Ok(Conn {
            stream,
            buf: Vec::new(),
        })
    }

    /// Reads more bytes into `into`; false on EOF.
    async fn fill(&mut self, into: &mut Vec<u8>) -> Result<bool, String> {
        let mut chunk = [0u8; 8192];
        let n = self
            .stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("read: {e}"))?;
        into.extend_from_slice(&chunk[..n]);
        Ok(n > 0)
    }

    /// Status line and headers; leaves any body bytes already read in `self.buf`.
    async fn read_head(&mut self) -> Result<(u16, Vec<(String, String)>), String> {
        let mut buf = std::mem::take(&mut self.buf);
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
            if !self.fill(&mut buf).await? {
                return Err(format!(
                    "connection closed before the response head: {:?}",
                    String::from_utf8_lossy(&buf)
                ));
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        self.buf = buf.split_off(end + 4);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let mut parts = status_line.split_whitespace();
        let status = match (parts.next(), parts.next()) {
            (Some(v), Some(code)) if v.starts_with("HTTP/1.") => code
                .parse::<u16>()
                .map_err(|e| format!("bad status line {status_line:?}: {e}"))?,
            _ => return Err(format!("bad status line {status_line:?}")),
        };
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        Ok((status, headers))
    }

    async fn read_body(&mut self, headers: &[(String, String)]) -> Result<Vec<u8>, String> {
        let mut raw = std::mem::take(&mut self.buf);
        if is_chunked(headers) {
            let mut body = Vec::new();
            loop {
                let (data, used, done) = decode_chunks(&raw)?;
                raw.drain(..used);
                body.extend_from_slice(&data);
                if done {
                    return Ok(body);
                }
                if !self.fill(&mut raw).await? {
                    return Err("connection closed inside a chunked body".into());
                }
            }
        }
        let length = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| {
                v.parse::<usize>()
                    .map_err(|e| format!("bad Content-Length {v:?}: {e}"))
            })
            .transpose()?;
        match length {
            Some(len) => {
                while raw.len() < len {
                    if !self.fill(&mut raw).await? {
                        return Err(format!(
                            "connection closed after {} of {len} body bytes",
                            raw.len()
                        ));
                    }
                }
                raw.truncate(len);
                Ok(raw)
            }
            None => {
                while self.fill(&mut raw).await? {}
                Ok(raw)
            }
        }
    }
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked")
    })
}

/// Decodes the complete chunks at the front of `raw`: (data, bytes used, final chunk seen).
/// An incomplete chunk at the end is left for later.
pub fn decode_chunks(raw: &[u8]) -> Result<(Vec<u8>, usize, bool), String> {
    let mut data = Vec::new();
    let mut at = 0;
    loop {
        let Some(rel) = raw[at..].windows(2).position(|w| w == b"\r\n") else {
            return Ok((data, at, false));
        };
        let size_line = String::from_utf8_lossy(&raw[at..at + rel]).into_owned();
        let size_hex = size_line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|e| format!("bad chunk size {size_line:?}: {e}"))?;
        let start = at + rel + 2;
        if size == 0 {
            // Trailer section: header lines until an empty line.
            let mut t = start;
            loop {
                let Some(r) = raw[t..].windows(2).position(|w| w == b"\r\n") else {
                    return Ok((data, at, false));
                };
                t += r + 2;
                if r == 0 {
                    return Ok((data, t, true));
                }
            }
        }
        if raw.len() < start + size + 2 {
            return Ok((data, at, false));
        }
        data.extend_from_slice(&raw[start..start + size]);
        at = start + size + 2;
    }
}

/// Incremental `text/event-stream` parser.
#[derive(Default)]
struct SseParser {
    data: Vec<String>,
}

impl SseParser {
    /// Consumes the complete lines of `text`, pushing finished events' data until `events`
    /// holds `limit` of them.
    fn feed(&mut self, text: &mut Vec<u8>, events: &mut Vec<String>, limit: usize) {
        while events.len() < limit {
            let Some(nl) = text.iter().position(|&b| b == b'\n') else {
                return;
            };
            let line_bytes: Vec<u8> = text.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line_bytes);
            let line = line.trim_end_matches('\n').trim_end_matches('\r');
            if line.is_empty() {
                if !self.data.is_empty() {
                    events.push(self.data.join("\n"));
                    self.data.clear();
                }
            } else if let Some(value) = line.strip_prefix("data") {
                if value.is_empty() || value.starts_with(':') {
                    let value = value.strip_prefix(':').unwrap_or_default();
                    self.data
                        .push(value.strip_prefix(' ').unwrap_or(value).to_string());
                }
            }
            // `event:`, `id:`, `retry:` and `:` comments are ignored.
        }
    }
}

/// `n` clients that each send `head` and then one more byte a second, never finishing the
/// request head, and connect again whenever the server closes them (a slowloris attack);
/// they stop when the returned handles are aborted.
pub fn slowloris(
    addr: SocketAddr,
    n: usize,
    head: &'static [u8],
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|_| {
            tokio::spawn(async move {
                loop {
                    let Ok(mut stream) = TcpStream::connect(addr).await else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    if stream.write_all(head).await.is_err() {
                        continue;
                    }
                    while stream.write_all(b"a").await.is_ok() {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            })
        })
        .collect()
}

/// One request through `router` in process, no socket: (status, body).
pub async fn oneshot(router: &axum::Router, method: &str, uri: &str, body: &str) -> (u16, String) {
    let request = ::http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_owned()))
        .unwrap();
    let response = tower_service::Service::call(&mut router.clone(), request)
        .await
        .unwrap();
    let status = response.status().as_u16();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}
