//! Check results as Prometheus metrics, with bounded labels only.
//!
//! The agent's `inferencecache_agent_check_results{check, status}` counts results per check
//! and status; this adds the detail an alert needs, never with a pod name, path or hash as a
//! label (those stay in `/v1/report`):
//!
//! | metric | labels | value |
//! |---|---|---|
//! | `inferencecache_agent_check_reasons` | `check`, `status`, `reason` | results of the latest pass (reasons are a fixed set per check) |
//! | `inferencecache_agent_gpu_status` | `gpu` (NVML index) | 0 ok, 1 unknown, 2 warning, 3 critical |
//! | `inferencecache_agent_gpu_temperature_celsius` | `gpu` | die temperature |
//! | `inferencecache_agent_gpu_last_xid` | `gpu` | the GPU's most recent XID (0: none) |
//! | `inferencecache_agent_gpu_xid_events_total` | `gpu` | XID events received |
//! | `inferencecache_agent_cuda_status` | `device` (CUDA ordinal) | 0 ok, 1 unknown, 2 warning, 3 critical |
//! | `inferencecache_agent_shm_host_size_bytes` / `_used_bytes` | — | the host's `/dev/shm` |
//! | `inferencecache_agent_mp_workers` | `verdict` (`Live`, `NotListening`, `Hung`, `BadReply`) | MP workers per verdict |

use std::collections::HashMap;
use std::sync::Arc;

use ic_shared::check::CheckResult;
use parking_lot::Mutex;
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

const P: &str = "inferencecache_agent_";

/// The detail metrics; cheap to clone (shared handles).
#[derive(Clone)]
pub struct CheckMetrics {
    reasons: IntGaugeVec,
    gpu_status: IntGaugeVec,
    gpu_temperature: IntGaugeVec,
    gpu_last_xid: IntGaugeVec,
    gpu_xid_events: IntCounterVec,
    cuda_status: IntGaugeVec,
    shm_size: IntGauge,
    shm_used: IntGauge,
    mp_workers: IntGaugeVec,
    xid_seen: Arc<Mutex<HashMap<String, u64>>>,
}

impl std::fmt::Debug for CheckMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CheckMetrics")
    }
}

fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> Result<IntGaugeVec, prometheus::Error> {
    IntGaugeVec::new(Opts::new(format!("{P}{name}"), help), labels)
}

impl CheckMetrics {
    /// Creates the metrics and registers them in `registry` (errors: a name already taken).
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let m = CheckMetrics {
            reasons: gauge_vec(
                "check_reasons",
                "Results of the latest check pass by check, status and reason.",
                &["check", "status", "reason"],
            )?,
            gpu_status: gauge_vec(
                "gpu_status",
                "Verdict of the gpu check per GPU: 0 ok, 1 unknown, 2 warning, 3 critical.",
                &["gpu"],
            )?,
            gpu_temperature: gauge_vec(
                "gpu_temperature_celsius",
                "GPU die temperature in degrees Celsius.",
                &["gpu"],
            )?,
            gpu_last_xid: gauge_vec(
                "gpu_last_xid",
                "Most recent XID reported for the GPU (0 when none since the agent started).",
                &["gpu"],
            )?,
            gpu_xid_events: IntCounterVec::new(
                Opts::new(
                    format!("{P}gpu_xid_events_total"),
                    "XID events received from NVML per GPU.",
                ),
                &["gpu"],
            )?,
            cuda_status: gauge_vec(
                "cuda_status",
                "Verdict of the cuda check per CUDA device: 0 ok, 1 unknown, 2 warning, 3 \
                 critical.",
                &["device"],
            )?,
            shm_size: IntGauge::new(
                format!("{P}shm_host_size_bytes"),
                "Size of the host's /dev/shm in bytes (0: unlimited tmpfs).",
            )?,
            shm_used: IntGauge::new(
                format!("{P}shm_host_used_bytes"),
                "Bytes used in the host's /dev/shm.",
            )?,
            mp_workers: gauge_vec(
                "mp_workers",
                "Planned LMCache MP workers per probe verdict.",
                &["verdict"],
            )?,
            xid_seen: Arc::new(Mutex::new(HashMap::new())),
        };
        registry.register(Box::new(m.reasons.clone()))?;
        registry.register(Box::new(m.gpu_status.clone()))?;
        registry.register(Box::new(m.gpu_temperature.clone()))?;
        registry.register(Box::new(m.gpu_last_xid.clone()))?;
        registry.register(Box::new(m.gpu_xid_events.clone()))?;
        registry.register(Box::new(m.cuda_status.clone()))?;
        registry.register(Box::new(m.shm_size.clone()))?;
        registry.register(Box::new(m.shm_used.clone()))?;
        registry.register(Box::new(m.mp_workers.clone()))?;
        Ok(m)
    }

    /// Sets every gauge from one pass's results (gauges of subjects no longer present are
    /// removed; counters only grow).
    pub fn record(&self, results: &[CheckResult]) {
        self.reasons.reset();
        self.gpu_status.reset();
        self.gpu_temperature.reset();
        self.gpu_last_xid.reset();
        self.cuda_status.reset();
        self.mp_workers.reset();
        for verdict in ["Live", "NotListening", "Hung", "BadReply"] {
            self.mp_workers.with_label_values(&[verdict]).set(0);
        }
        let num = |r: &CheckResult, k: &str| r.observed.get(k).and_then(|v| v.parse::<i64>().ok());
        for r in results {
            self.reasons
                .with_label_values(&[r.name.as_str(), r.status.as_label(), r.reason.as_str()])
                .inc();
            let severity = i64::from(r.status.severity());
            match r.name.as_str() {
                "gpu" => {
                    let Some(gpu) = r.subject.strip_prefix("gpu") else {
                        continue;
                    };
                    self.gpu_status.with_label_values(&[gpu]).set(severity);
                    if let Some(t) = num(r, "temperatureCelsius") {
                        self.gpu_temperature.with_label_values(&[gpu]).set(t);
                    }
                    self.gpu_last_xid
                        .with_label_values(&[gpu])
                        .set(num(r, "lastXid").unwrap_or(0));
                    // The series exists at 0 from the GPU's first pass: `increase()` sees the
                    // first XID only as a step up from an earlier sample.
                    let xid_events = self.gpu_xid_events.with_label_values(&[gpu]);
                    if let Some(total) = r
                        .observed
                        .get("xidEventsTotal")
                        .and_then(|v| v.parse::<u64>().ok())
                    {
                        let mut seen = self.xid_seen.lock();
                        let last = seen.entry(gpu.to_string()).or_insert(0);
                        if total > *last {
                            xid_events.inc_by(total - *last);
                        }
                        *last = total;
                    }
                }
                "cuda" => {
                    if let Some(dev) = r.subject.strip_prefix("cuda") {
                        self.cuda_status.with_label_values(&[dev]).set(severity);
                    }
                }
                "shm" if r.subject == "host" => {
                    self.shm_size.set(num(r, "sizeBytes").unwrap_or(0));
                    self.shm_used.set(num(r, "usedBytes").unwrap_or(0));
                }
                "mp_worker" => {
                    if let Some(v) = r.observed.get("verdict") {
                        self.mp_workers.with_label_values(&[v.as_str()]).inc();
                    }
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use ic_shared::check::CheckStatus;

    /// A GPU's XID counter is exported at 0 before its first XID, so the first one is an
    /// increase (InferenceCacheGpuXid) rather than a series that starts at 1.
    #[test]
    fn the_xid_counter_starts_at_zero() {
        let reg = Registry::new();
        let m = CheckMetrics::register(&reg).unwrap();
        m.record(&[
            CheckResult::new("gpu", "gpu1", CheckStatus::Ok, "GpuOk", "m")
                .with("xidEventsTotal", 0),
        ]);
        let mut buf = Vec::new();
        prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &reg.gather(), &mut buf)
            .unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert!(
            text.contains("inferencecache_agent_gpu_xid_events_total{gpu=\"1\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn gauges_from_results() {
        let reg = Registry::new();
        let m = CheckMetrics::register(&reg).unwrap();
        let gpu = |xids: u64| {
            CheckResult::new("gpu", "gpu0", CheckStatus::Critical, "GpuXidFatal", "m")
                .with("temperatureCelsius", 61)
                .with("lastXid", 79)
                .with("xidEventsTotal", xids)
        };
        let results = vec![
            gpu(2),
            CheckResult::new("cuda", "cuda0", CheckStatus::Ok, "CudaOk", "m"),
            CheckResult::new("shm", "host", CheckStatus::Ok, "ShmOk", "m")
                .with("sizeBytes", 1024)
                .with("usedBytes", 10),
            CheckResult::new(
                "mp_worker",
                "ns/p",
                CheckStatus::Critical,
                "MpWorkerHung",
                "m",
            )
            .with("verdict", "Hung"),
        ];
        m.record(&results);
        m.record(&[gpu(3)]);
        m.record(&results[..0]);
        m.record(&results);
        let mut buf = Vec::new();
        prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &reg.gather(), &mut buf)
            .unwrap();
        let text = String::from_utf8(buf).unwrap();
        for line in [
            "inferencecache_agent_gpu_status{gpu=\"0\"} 3",
            "inferencecache_agent_gpu_temperature_celsius{gpu=\"0\"} 61",
            "inferencecache_agent_gpu_last_xid{gpu=\"0\"} 79",
            // 2, then 3 (+1), then a pass without the GPU, then 2 again: no decrease
            "inferencecache_agent_gpu_xid_events_total{gpu=\"0\"} 3",
            "inferencecache_agent_cuda_status{device=\"0\"} 0",
            "inferencecache_agent_shm_host_size_bytes 1024",
            "inferencecache_agent_mp_workers{verdict=\"Hung\"} 1",
            "inferencecache_agent_mp_workers{verdict=\"Live\"} 0",
            "inferencecache_agent_check_reasons{check=\"gpu\",reason=\"GpuXidFatal\",status=\"critical\"} 1",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
    }
}
