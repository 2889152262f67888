//! One HTTP/1.1 exchange per connection for the tier-2 probe (hyper's client connection), bounded
//! in time and in response size.

use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Largest response body read (a Mooncake master's `/metrics` is a few kilobytes).
pub const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// A response: status code and body (invalid UTF-8 replaced).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// The body as text.
    pub body: String,
}

/// `method http://{authority}{path}` with `body`; the whole exchange within `timeout`.
///
/// # Errors
/// The connection's or the protocol's own error, an oversized body, or the deadline, as a
/// sentence naming `authority`.
pub async fn exchange(
    method: Method,
    authority: &str,
    path: &str,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<Response, String> {
    match tokio::time::timeout(
        timeout,
        exchange_inner(method.clone(), authority, path, body),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => Err(format!(
            "{method} http://{authority}{path} got no complete answer within {} ms",
            timeout.as_millis()
        )),
    }
}

async fn exchange_inner(
    method: Method,
    authority: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<Response, String> {
    let what = format!("{method} http://{authority}{path}");
    let tcp = TcpStream::connect(authority)
        .await
        .map_err(|e| format!("{what}: cannot connect: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("{what}: {e}"))?;
    let driver = tokio::spawn(conn);
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::CONNECTION, "close")
        .body(Full::new(std::io::Cursor::new(body)))
        .map_err(|e| format!("{what}: {e}"))?;
    let result = async {
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("{what}: {e}"))?;
        let status = resp.status().as_u16();
        let bytes = Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| format!("{what}: reading the body: {e}"))?
            .to_bytes();
        Ok(Response {
            status,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        })
    }
    .await;
    driver.abort();
    result
}
