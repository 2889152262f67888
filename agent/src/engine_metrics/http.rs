//! A minimal HTTP/1.1 `GET` for engine `/metrics` endpoints (`http://HOST:PORT/PATH`).
//!
//! Engines serve their metrics from uvicorn (vLLM, SGLang): plain HTTP/1.1, a body framed by
//! `Content-Length`, by chunked transfer encoding, or by closing the connection. That is all
//! this client speaks — one request per connection (`Connection: close`), no TLS, no
//! redirects, no compression (`Accept-Encoding: identity`) — so the agent needs no HTTP client
//! crate for it. Every call is bounded in time (the whole exchange) and in size (headers and
//! body), and every failure is a [`FetchError`] with a stable metric label.

use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest response header section accepted.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// Why a fetch failed.
#[derive(Debug, Error)]
pub enum FetchError {
    /// The URL is not `http://HOST[:PORT][/PATH]`.
    #[error("unsupported metrics URL {url:?}: {why}")]
    Url {
        /// The URL.
        url: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The TCP connection could not be opened.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// OS error.
        source: std::io::Error,
    },
    /// Sending the request or reading the response failed.
    #[error("reading from {addr}: {source}")]
    Io {
        /// `host:port`.
        addr: String,
        /// OS error.
        source: std::io::Error,
    },
    /// The whole exchange took longer than the timeout.
    #[error("no complete response within {0:?}")]
    Timeout(Duration),
    /// The server answered with a status other than 2xx.
    #[error("HTTP status {0}")]
    Status(u16),
    /// The response is larger than allowed.
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
    /// The response is not HTTP/1.x as this client speaks it.
    #[error("malformed HTTP response: {0}")]
    Malformed(&'static str),
}

impl FetchError {
    /// Stable metric label.
    pub fn outcome(&self) -> &'static str {
        match self {
            FetchError::Url { .. } => "invalid_url",
            FetchError::Connect { .. } => "connect_error",
            FetchError::Io { .. } => "io_error",
            FetchError::Timeout(_) => "timeout",
            FetchError::Status(_) => "http_status",
            FetchError::TooLarge(_) => "too_large",
            FetchError::Malformed(_) => "malformed",
        }
    }

    /// Every label [`outcome`](Self::outcome) can return.
    pub const OUTCOMES: &'static [&'static str] = &[
        "invalid_url",
        "connect_error",
        "io_error",
        "timeout",
        "http_status",
        "too_large",
        "malformed",
    ];
}

/// A parsed `http://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Host to connect to (IPv6 without brackets).
    pub host: String,
    /// TCP port (80 when the URL has none).
    pub port: u16,
    /// The `Host` header value (`host:port`, IPv6 in brackets).
    pub authority: String,
    /// Request target, `/` when the URL has no path.
    pub path: String,
}

/// Parses `http://HOST[:PORT][/PATH]` (IPv6 hosts in brackets).
pub fn parse_url(url: &str) -> Result<Target, FetchError> {
    let bad = |why| FetchError::Url {
        url: url.to_string(),
        why,
    };
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| bad("only http:// is supported"))?;
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let path = if path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_string()
    };
    if authority.is_empty() || authority.contains('@') {
        return Err(bad("the URL needs a host (and no user info)"));
    }
    if path.chars().any(|c| c.is_ascii_control() || c == ' ') {
        return Err(bad("the path contains spaces or control characters"));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or_else(|| bad("unterminated IPv6 host"))?;
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| bad("junk after the IPv6 host"))?,
            ),
        };
        (h, port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() || host.chars().any(|c| c.is_ascii_control() || c == ' ') {
        return Err(bad("invalid host"));
    }
    let port = match port {
        None => 80,
        Some(p) => p.parse::<u16>().map_err(|_| bad("invalid port"))?,
    };
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    Ok(Target {
        host: host.to_string(),
        port,
        authority,
        path,
    })
}

/// Fetches `url` and returns its body as text (invalid UTF-8 replaced). The whole exchange —
/// connect, request, response — must finish within `timeout`, and the body may be at most
/// `max_body_bytes` long.
pub async fn get(
    url: &str,
    timeout: Duration,
    max_body_bytes: usize,
) -> Result<String, FetchError> {
    let target = parse_url(url)?;
    match tokio::time::timeout(timeout, exchange(&target, max_body_bytes)).await {
        Ok(r) => r,
        Err(_) => Err(FetchError::Timeout(timeout)),
    }
}

async fn exchange(t: &Target, max_body_bytes: usize) -> Result<String, FetchError> {
    let mut stream = TcpStream::connect((t.host.as_str(), t.port))
        .await
        .map_err(|source| FetchError::Connect {
            addr: t.authority.clone(),
            source,
        })?;
    let io = |source| FetchError::Io {
        addr: t.authority.clone(),
        source,
    };
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: ic-agent/{}\r\nAccept: text/plain;version=0.0.4;q=1,*/*;q=0.1\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n",
        t.path,
        t.authority,
        env!("CARGO_PKG_VERSION"),
    );
    stream.write_all(request.as_bytes()).await.map_err(io)?;

    let mut buf: Vec<u8> = Vec::with_capacity(16 * 1024);
    let mut chunk = vec![0u8; 16 * 1024];
    let mut head: Option<Head> = None;
    loop {
        let n = stream.read(&mut chunk).await.map_err(io)?;
        let eof = n == 0;
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        if head.is_none() {
            match find_header_end(&buf) {
                Some(end) => {
                    let h = parse_head(buf.get(..end).unwrap_or_default())?;
                    buf.drain(..end);
                    if !(200..300).contains(&h.status) {
                        return Err(FetchError::Status(h.status));
                    }
                    head = Some(h);
                }
                None if buf.len() > MAX_HEADER_BYTES => {
                    return Err(FetchError::Malformed("header section too large"))
                }
                None if eof => {
                    return Err(FetchError::Malformed(
                        "connection closed before the headers ended",
                    ))
                }
                None => continue,
            }
        }
        let Some(h) = head.as_ref() else { continue };
        if buf.len() > max_body_bytes.saturating_add(if h.chunked { 64 * 1024 } else { 0 }) {
            return Err(FetchError::TooLarge(max_body_bytes));
        }
        match h.framing() {
            Framing::Length(len) => {
                if len > max_body_bytes {
                    return Err(FetchError::TooLarge(max_body_bytes));
                }
                if buf.len() >= len {
                    buf.truncate(len);
                    return Ok(String::from_utf8_lossy(&buf).into_owned());
                }
                if eof {
                    return Err(FetchError::Malformed(
                        "connection closed before Content-Length bytes arrived",
                    ));
                }
            }
            Framing::Chunked => {
                if eof || buf.ends_with(b"0\r\n\r\n") {
                    match decode_chunked(&buf)? {
                        Some(body) if body.len() > max_body_bytes => {
                            return Err(FetchError::TooLarge(max_body_bytes))
                        }
                        Some(body) => return Ok(String::from_utf8_lossy(&body).into_owned()),
                        None if eof => {
                            return Err(FetchError::Malformed(
                                "connection closed inside a chunked body",
                            ))
                        }
                        None => {}
                    }
                }
            }
            Framing::UntilClose => {
                if eof {
                    return Ok(String::from_utf8_lossy(&buf).into_owned());
                }
            }
        }
    }
}

/// Position just past the blank line ending the header section.
fn find_header_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Head {
    status: u16,
    content_length: Option<usize>,
    chunked: bool,
}

enum Framing {
    Length(usize),
    Chunked,
    UntilClose,
}

impl Head {
    fn framing(&self) -> Framing {
        if self.chunked {
            Framing::Chunked
        } else if let Some(n) = self.content_length {
            Framing::Length(n)
        } else {
            Framing::UntilClose
        }
    }
}

fn parse_head(raw: &[u8]) -> Result<Head, FetchError> {
    let text =
        std::str::from_utf8(raw).map_err(|_| FetchError::Malformed("headers are not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(FetchError::Malformed("not an HTTP/1.x status line"));
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|s| (100..1000).contains(s))
        .ok_or(FetchError::Malformed("no status code"))?;
    let mut head = Head {
        status,
        content_length: None,
        chunked: false,
    };
    for line in lines.filter(|l| !l.is_empty()) {
        let Some((name, value)) = line.split_once(':') else {
            return Err(FetchError::Malformed("header line without a colon"));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let n = value
                .parse::<usize>()
                .map_err(|_| FetchError::Malformed("invalid Content-Length"))?;
            if head.content_length.is_some_and(|prev| prev != n) {
                return Err(FetchError::Malformed("conflicting Content-Length headers"));
            }
            head.content_length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            let last = value.rsplit(',').next().unwrap_or_default().trim();
            if last.eq_ignore_ascii_case("chunked") {
                head.chunked = true;
            } else if !last.eq_ignore_ascii_case("identity") {
                return Err(FetchError::Malformed("unsupported Transfer-Encoding"));
            }
        } else if name.eq_ignore_ascii_case("content-encoding")
            && !value.eq_ignore_ascii_case("identity")
        {
            return Err(FetchError::Malformed("compressed body (Content-Encoding)"));
        }
    }
    Ok(head)
}

/// Decodes a complete chunked body; `Ok(None)` when `buf` ends before the last chunk.
fn decode_chunked(buf: &[u8]) -> Result<Option<Vec<u8>>, FetchError> {
    let mut out = Vec::with_capacity(buf.len());
    let mut pos = 0usize;
    loop {
        let Some(rest) = buf.get(pos..) else {
            return Ok(None);
        };
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let line = std::str::from_utf8(rest.get(..eol).unwrap_or_default())
            .map_err(|_| FetchError::Malformed("chunk size is not text"))?;
        let size_hex = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|_| FetchError::Malformed("invalid chunk size"))?;
        pos = pos.saturating_add(eol + 2);
        if size == 0 {
            // Trailers (ignored) end with an empty line.
            let tail = buf.get(pos..).unwrap_or_default();
            return Ok(
                if tail.starts_with(b"\r\n") || find_header_end(tail).is_some() {
                    Some(out)
                } else {
                    None
                },
            );
        }
        let end = pos.saturating_add(size);
        let Some(data) = buf.get(pos..end) else {
            return Ok(None);
        };
        out.extend_from_slice(data);
        match buf.get(end..end.saturating_add(2)) {
            Some(b"\r\n") => pos = end + 2,
            Some(_) => return Err(FetchError::Malformed("chunk not followed by CRLF")),
            None => return Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokio::net::TcpListener;

    #[test]
    fn urls_parse() {
        let t = parse_url("http://10.0.0.5:8000/metrics").unwrap();
        assert_eq!(
            (
                t.host.as_str(),
                t.port,
                t.authority.as_str(),
                t.path.as_str()
            ),
            ("10.0.0.5", 8000, "10.0.0.5:8000", "/metrics")
        );
        let t = parse_url("http://[fd00::5]:30000/metrics").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.authority.as_str()),
            ("fd00::5", 30000, "[fd00::5]:30000")
        );
        let t = parse_url("http://engine").unwrap();
        assert_eq!((t.port, t.path.as_str()), (80, "/"));
        for bad in [
            "https://h:1/metrics",
            "http://",
            "http://h:x/",
            "http://h:70000/",
            "http://[::1/",
            "http://u@h/",
            "http://h:1/a b",
            "tcp://h:1",
        ] {
            let e = parse_url(bad).unwrap_err();
            assert_eq!(e.outcome(), "invalid_url", "{bad}");
        }
    }

    /// Serves one connection with `response` (written in `pieces` parts), after reading the
    /// request head; returns the URL and a handle yielding the request.
    async fn serve_once(
        pieces: Vec<Vec<u8>>,
        close: bool,
    ) -> (String, tokio::task::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = Vec::new();
            let mut b = [0u8; 1024];
            while find_header_end(&req).is_none() {
                let n = s.read(&mut b).await.unwrap();
                if n == 0 {
                    break;
                }
                req.extend_from_slice(&b[..n]);
            }
            for p in pieces {
                s.write_all(&p).await.unwrap();
                s.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if !close {
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            String::from_utf8(req).unwrap()
        });
        (format!("http://{addr}/metrics"), task)
    }

    const T: Duration = Duration::from_secs(2);

    #[tokio::test]
    async fn content_length_bodies_do_not_wait_for_close() {
        let body = "up 1\n";
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let (url, task) = serve_once(vec![resp.into_bytes()], false).await;
        assert_eq!(get(&url, T, 1024).await.unwrap(), body);
        task.abort();
    }

    #[tokio::test]
    async fn chunked_bodies_are_decoded_across_reads() {
        let pieces = vec![
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nup 1\n\r".to_vec(),
            b"\nA;ext=1\r\nup{a=\"b\"} \r\n".to_vec(),
            b"2\r\n2\n\r\n0\r\n\r\n".to_vec(),
        ];
        let (url, task) = serve_once(pieces, false).await;
        assert_eq!(get(&url, T, 1024).await.unwrap(), "up 1\nup{a=\"b\"} 2\n");
        task.abort();
    }

    #[tokio::test]
    async fn the_request_is_a_plain_close_delimited_get() {
        let (url, task) = serve_once(vec![b"HTTP/1.0 200 OK\r\n\r\nup 1\n".to_vec()], true).await;
        assert_eq!(get(&url, T, 1024).await.unwrap(), "up 1\n");
        let req = task.await.unwrap();
        assert!(req.starts_with("GET /metrics HTTP/1.1\r\n"), "{req}");
        assert!(req.contains("\r\nConnection: close\r\n"), "{req}");
        assert!(req.contains("\r\nAccept-Encoding: identity\r\n"), "{req}");
        assert!(
            req.contains(&format!(
                "\r\nHost: {}\r\n",
                url.trim_start_matches("http://")
                    .trim_end_matches("/metrics")
            )),
            "{req}"
        );
    }

    #[tokio::test]
    async fn failures_have_their_outcome() {
        let (url, _t) = serve_once(
            vec![b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec()],
            true,
        )
        .await;
        assert!(matches!(
            get(&url, T, 1024).await,
            Err(FetchError::Status(404))
        ));

        let big = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n{}",
            "x".repeat(5000)
        );
        let (url, _t) = serve_once(vec![big.into_bytes()], true).await;
        assert_eq!(get(&url, T, 1024).await.unwrap_err().outcome(), "too_large");

        let (url, _t) = serve_once(
            vec![format!("HTTP/1.1 200 OK\r\n\r\n{}", "y".repeat(3000)).into_bytes()],
            true,
        )
        .await;
        assert_eq!(get(&url, T, 1024).await.unwrap_err().outcome(), "too_large");

        let (url, _t) = serve_once(vec![b"SSH-2.0-OpenSSH\r\n\r\n".to_vec()], true).await;
        assert_eq!(get(&url, T, 1024).await.unwrap_err().outcome(), "malformed");

        let (url, _t) = serve_once(
            vec![b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n\r\n".to_vec()],
            true,
        )
        .await;
        assert_eq!(get(&url, T, 1024).await.unwrap_err().outcome(), "malformed");

        // Headers, then silence: the deadline covers the whole exchange.
        let (url, t) = serve_once(
            vec![b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nup".to_vec()],
            false,
        )
        .await;
        let e = get(&url, Duration::from_millis(200), 1024)
            .await
            .unwrap_err();
        assert_eq!(e.outcome(), "timeout");
        t.abort();

        let port = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = get(&format!("http://127.0.0.1:{port}/metrics"), T, 1024)
            .await
            .unwrap_err();
        assert_eq!(e.outcome(), "connect_error");
        assert!(FetchError::OUTCOMES.contains(&e.outcome()));
    }

    proptest! {
        #[test]
        fn garbage_responses_never_panic(raw in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_head(&raw);
            let _ = decode_chunked(&raw);
        }

        #[test]
        fn chunked_round_trips(body in proptest::collection::vec(any::<u8>(), 0..2048), cut in 1usize..64) {
            let mut enc = Vec::new();
            for c in body.chunks(cut) {
                enc.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
                enc.extend_from_slice(c);
                enc.extend_from_slice(b"\r\n");
            }
            enc.extend_from_slice(b"0\r\n\r\n");
            prop_assert_eq!(decode_chunked(&enc).unwrap(), Some(body.clone()));
            // Any strict prefix is incomplete (or, at a chunk boundary, still incomplete).
            let half = enc.len() / 2;
            prop_assert_eq!(decode_chunked(&enc[..half]).unwrap(), None);
        }

        #[test]
        fn arbitrary_urls_never_panic(url in "\\PC{0,64}") {
            let _ = parse_url(&url);
            let _ = parse_url(&format!("http://{url}"));
        }
    }
}
