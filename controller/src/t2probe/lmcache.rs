//! Stage C for a managed LMCache server (`lm://`): a put and a get of one probe chunk over the
//! server's own TCP protocol, the one LMCache's `lm://` remote connector speaks
//! (`lmcache/v1/protocol.py`, served by `lmcache/v1/server/__main__.py`; LMCache 0.4.7, the
//! default server image's version).
//!
//! # Wire format
//!
//! Every integer is a 32-bit signed little-endian value (Python `struct` native `i` on the
//! x86-64 / arm64 hosts the server runs on). A request is [`REQUEST_HEADER_BYTES`] bytes:
//!
//! | field | bytes |
//! |---|---|
//! | command ([`Command`]) | 4 |
//! | length (payload bytes that follow a PUT) | 4 |
//! | memory format ([`FORMAT_BINARY`] here) | 4 |
//! | dtype id (0 = none) | 4 |
//! | location (0 = none) | 4 |
//! | shape, 4 dimensions | 16 |
//! | key, space-padded | [`MAX_KEY_LENGTH`] |
//!
//! followed, for a PUT, by `length` payload bytes. PUT has no reply. GET, EXIST and HEALTH get a
//! [`REPLY_HEADER_BYTES`]-byte reply: code ([`CODE_SUCCESS`] / [`CODE_FAIL`]), length, memory
//! format, dtype id, 4 shape dimensions, location; a successful GET then sends `length` payload
//! bytes. The server parses every key as a `CacheEngineKey`
//! (`model@world_size@worker_id@chunk_hash_hex@dtype`); a request it cannot parse ends the
//! connection without a reply.
//!
//! The protocol has no delete and the server no eviction, so the probe writes one fixed key per
//! CacheBackend ([`probe_chunk_key`]) and overwrites it on every probe: the server holds at most
//! one small probe chunk per backend. The value carries the probe's nonce, so a get proves this
//! probe's put, not an earlier one.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest key the protocol carries (bytes; space-padded on the wire).
pub const MAX_KEY_LENGTH: usize = 150;
/// Size of a request header: nine integers and the key.
pub const REQUEST_HEADER_BYTES: usize = 9 * 4 + MAX_KEY_LENGTH;
/// Size of a reply header: nine integers.
pub const REPLY_HEADER_BYTES: usize = 9 * 4;
/// Reply code of a request that succeeded.
pub const CODE_SUCCESS: i32 = 200;
/// Reply code of a request that did not (a GET or EXIST of an absent key).
pub const CODE_FAIL: i32 = 400;
/// `MemoryFormat.BINARY`: an opaque byte payload with shape `[length, 0, 0, 0]`.
pub const FORMAT_BINARY: i32 = 4;
/// Largest GET payload the probe reads back (its own value is a few dozen bytes).
pub const MAX_PROBE_PAYLOAD: usize = 64 * 1024;

/// A request's command (`ClientCommand`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Command {
    /// Store the payload under the key; no reply.
    Put = 1,
    /// Return the key's payload.
    Get = 2,
    /// Whether the key is stored.
    Exist = 3,
    /// The server is alive.
    Health = 5,
}

/// One request header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub command: Command,
    /// Payload bytes after the header (PUT only).
    pub length: i32,
    /// Memory format id.
    pub format: i32,
    /// Dtype id (0 = none).
    pub dtype: i32,
    /// Shape, 4 dimensions.
    pub shape: [i32; 4],
    /// The key, at most [`MAX_KEY_LENGTH`] bytes.
    pub key: String,
}

impl Request {
    /// The header's bytes.
    ///
    /// # Errors
    /// The key is longer than [`MAX_KEY_LENGTH`] bytes.
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let key = self.key.as_bytes();
        if key.len() > MAX_KEY_LENGTH {
            return Err(format!(
                "probe key of {} bytes is longer than the protocol's {MAX_KEY_LENGTH}",
                key.len()
            ));
        }
        let mut out = Vec::with_capacity(REQUEST_HEADER_BYTES);
        let location = 0;
        for v in [
            self.command as i32,
            self.length,
            self.format,
            self.dtype,
            location,
        ]
        .into_iter()
        .chain(self.shape)
        {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(key);
        out.resize(REQUEST_HEADER_BYTES, b' ');
        Ok(out)
    }
}

/// One reply header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    /// [`CODE_SUCCESS`] or [`CODE_FAIL`].
    pub code: i32,
    /// Payload bytes that follow (successful GET).
    pub length: i32,
    /// Memory format id.
    pub format: i32,
    /// Dtype id.
    pub dtype: i32,
    /// Shape, 4 dimensions.
    pub shape: [i32; 4],
    /// Location id.
    pub location: i32,
}

impl Reply {
    /// Decodes a reply header.
    pub fn decode(b: &[u8; REPLY_HEADER_BYTES]) -> Reply {
        let i = |n: usize| i32::from_le_bytes([b[4 * n], b[4 * n + 1], b[4 * n + 2], b[4 * n + 3]]);
        Reply {
            code: i(0),
            length: i(1),
            format: i(2),
            dtype: i(3),
            shape: [i(4), i(5), i(6), i(7)],
            location: i(8),
        }
    }
}

/// The fixed probe key of backend `namespace/name`: model `inferencecache-probe`, world size 1,
/// worker 0, the xxh3 hash of `namespace/name` as the chunk hash, dtype `uint8`. No engine asks
/// for this model, so the chunk never serves a lookup.
pub fn probe_chunk_key(namespace: &str, name: &str) -> String {
    let h = xxhash_rust::xxh3::xxh3_64(format!("{namespace}/{name}").as_bytes());
    format!("inferencecache-probe@1@0@{h:016x}@uint8")
}

/// What a failed step says: the server's own I/O error, a closed connection, or the deadline.
fn step_error(
    endpoint: &str,
    what: &str,
    timeout: Duration,
    r: Result<std::io::Error, ()>,
) -> String {
    match r {
        Ok(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => format!(
            "the LMCache server at {endpoint} closed the connection during the {what} \
             (it could not parse the request: a server of another protocol version?)"
        ),
        Ok(e) => format!("the LMCache server at {endpoint} failed the {what}: {e}"),
        Err(()) => format!(
            "the LMCache server at {endpoint} did not answer the {what} within {} ms",
            timeout.as_millis()
        ),
    }
}

async fn bounded<T>(
    endpoint: &str,
    what: &str,
    timeout: Duration,
    fut: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, String> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(step_error(endpoint, what, timeout, Ok(e))),
        Err(_) => Err(step_error(endpoint, what, timeout, Err(()))),
    }
}

async fn read_reply(
    stream: &mut TcpStream,
    endpoint: &str,
    what: &str,
    timeout: Duration,
) -> Result<Reply, String> {
    let mut b = [0u8; REPLY_HEADER_BYTES];
    bounded(endpoint, what, timeout, stream.read_exact(&mut b)).await?;
    let reply = Reply::decode(&b);
    if reply.code != CODE_SUCCESS && reply.code != CODE_FAIL {
        return Err(format!(
            "the server at {endpoint} answered the {what} with code {} (an LMCache server \
             answers {CODE_SUCCESS} or {CODE_FAIL}): not an LMCache server, or another protocol \
             version",
            reply.code
        ));
    }
    Ok(reply)
}

/// HEALTH, PUT of `value` under `key`, GET of `key` (must return `value`) on the LMCache server
/// at `endpoint` (`host:port`), on one connection; every step within `timeout`.
///
/// # Errors
/// What failed: the connection's own error, a closed connection, a deadline, a reply code, or a
/// value that did not come back.
pub async fn lmcache_round_trip(
    endpoint: &str,
    key: &str,
    value: &[u8],
    timeout: Duration,
) -> Result<(), String> {
    let header = |command, length: usize| Request {
        command,
        length: length as i32,
        format: FORMAT_BINARY,
        dtype: 0,
        shape: [length as i32, 0, 0, 0],
        key: key.to_string(),
    };
    if value.len() > MAX_PROBE_PAYLOAD {
        return Err(format!(
            "probe value of {} bytes is above {MAX_PROBE_PAYLOAD}",
            value.len()
        ));
    }
    let health = header(Command::Health, 0).encode()?;
    let mut put = header(Command::Put, value.len()).encode()?;
    put.extend_from_slice(value);
    let get = header(Command::Get, 0).encode()?;

    let mut stream = bounded(
        endpoint,
        "connection",
        timeout,
        TcpStream::connect(endpoint),
    )
    .await?;
    bounded(endpoint, "health check", timeout, stream.write_all(&health)).await?;
    let h = read_reply(&mut stream, endpoint, "health check", timeout).await?;
    if h.code != CODE_SUCCESS {
        return Err(format!(
            "the LMCache server at {endpoint} answered the health check with code {}",
            h.code
        ));
    }
    bounded(endpoint, "put (PUT)", timeout, stream.write_all(&put)).await?;
    bounded(endpoint, "get (GET)", timeout, stream.write_all(&get)).await?;
    let g = read_reply(&mut stream, endpoint, "get (GET)", timeout).await?;
    if g.code == CODE_FAIL {
        return Err(format!(
            "the LMCache server at {endpoint} accepted the put but answered the get with code \
             {CODE_FAIL} (key not stored)"
        ));
    }
    let len = usize::try_from(g.length).unwrap_or(usize::MAX);
    if len != value.len() {
        return Err(format!(
            "the LMCache server at {endpoint} returned {} bytes for the probe key, not the {} \
             that were put",
            g.length,
            value.len()
        ));
    }
    let mut got = vec![0u8; len];
    bounded(endpoint, "get (GET)", timeout, stream.read_exact(&mut got)).await?;
    if got != value {
        return Err(format!(
            "the LMCache server at {endpoint} returned a different value for the probe key \
             (another writer of the same key?)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte layout of `lmcache/v1/protocol.py` `ClientMetaMessage.serialize` for a HEALTH of
    /// key `m@1@0@ab@uint8`: nine little-endian integers, then the key padded with spaces.
    #[test]
    fn request_header_layout() {
        let r = Request {
            command: Command::Health,
            length: 0,
            format: FORMAT_BINARY,
            dtype: 0,
            shape: [7, 0, 0, 0],
            key: "m@1@0@ab@uint8".into(),
        };
        let b = r.encode().unwrap();
        assert_eq!(b.len(), 186);
        assert_eq!(&b[..4], &[5, 0, 0, 0]);
        assert_eq!(&b[8..12], &[4, 0, 0, 0]);
        assert_eq!(&b[20..24], &[7, 0, 0, 0]);
        assert_eq!(&b[36..50], b"m@1@0@ab@uint8");
        assert!(b[50..].iter().all(|&c| c == b' '));
        let long = Request {
            key: "k".repeat(151),
            ..r
        };
        assert!(long.encode().is_err());
    }

    #[test]
    fn probe_keys_are_fixed_per_backend_and_fit() {
        let k = probe_chunk_key("ml", "kv");
        assert_eq!(k, probe_chunk_key("ml", "kv"));
        assert_ne!(k, probe_chunk_key("ml", "kv2"));
        assert!(k.len() <= MAX_KEY_LENGTH);
        assert_eq!(k.split('@').count(), 5);
    }
}
