//! A plain HTTP GET for the integration tests that read the controller's HTTP endpoints
//! (`reconcile_t2`, `binary_metrics`).

#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::time::Duration;

/// `GET path` on `addr` (HTTP/1.1, `Connection: close`): the response body.
pub fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n").unwrap().1.to_string()
}
