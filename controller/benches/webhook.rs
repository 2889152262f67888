//! Pod-webhook latency and throughput over real HTTPS (work in progress).

fn main() {}
