//! Raw HTTP/2 frames for the listener and ingest flood tests: the client preface, frames, and a
//! HEADERS frame that opens `AgentService.Connect` and leaves the stream open (no Hello).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

/// The HTTP/2 client connection preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The gRPC path of `AgentService.Connect`.
pub const CONNECT_PATH: &str = "/inferencecache.v1alpha1.AgentService/Connect";

/// One frame: 24-bit length, type, flags, stream id, payload.
pub fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, ty, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK "literal header field without indexing, new name" (names and values < 127 bytes).
pub fn literal(name: &str, value: &str) -> Vec<u8> {
    let mut b = vec![0x00, name.len() as u8];
    b.extend_from_slice(name.as_bytes());
    b.push(value.len() as u8);
    b.extend_from_slice(value.as_bytes());
    b
}

/// A HEADERS frame opening `AgentService.Connect` on `stream` (END_HEADERS, not END_STREAM:
/// the stream stays open, as an agent's before its Hello).
pub fn connect_headers(stream: u32) -> Vec<u8> {
    let mut block = Vec::new();
    for (n, v) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", CONNECT_PATH),
        (":authority", "x"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        block.extend(literal(n, v));
    }
    frame(0x1, 0x4, stream, &block)
}
