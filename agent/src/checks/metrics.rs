//! Check results as Prometheus metrics, with bounded labels only.
//!
//! The agent's `inferencecache_agent_check_results{check, status}` counts results per check
//! and status; this adds the detail an alert needs, never with a pod name, path or hash as a
//! label (those stay in `/v1/report`):
//!
//! | metric | labels | value |
//! |---|---|---|
//! | `inferencecache_agent_check_reasons` | `check`, `status`, `reason` | results of the latest pass (reasons are a fixed set per check) |
//! | `inferencecache_agent_gpu_status` | `gpu` (NVML index), `uuid`, `model` | 0 ok, 1 unknown, 2 warning, 3 critical |
//! | `inferencecache_agent_gpu_temperature_celsius` | `gpu`, `uuid`, `model` | die temperature |
//! | `inferencecache_agent_gpu_last_xid` | `gpu`, `uuid`, `model` | the GPU's most recent XID (0: none) |
//! | `inferencecache_agent_gpu_xid_events_total` | `gpu`, `uuid`, `model` | XID events received |
//! | `inferencecache_agent_cuda_status` | `device` (CUDA ordinal), `uuid`, `model` | 0 ok, 1 unknown, 2 warning, 3 critical |
//! | `inferencecache_agent_shm_host_size_bytes` / `_used_bytes` | — | the host's `/dev/shm` |
//! | `inferencecache_agent_mp_workers` | `verdict` (`Live`, `NotListening`, `Hung`, `BadReply`) | MP workers per verdict |
//!
//! `uuid` is the GPU's `GPU-…` UUID and `model` its NVML (or CUDA) device name, e.g. `NVIDIA H100
//! 80GB HBM3`, as the result's `observed.uuid` / `observed.name` give them: one value each per
//! GPU, so the series stay one per GPU. They are what dcgm-exporter's `DCGM_FI_*` series carry as
//! `UUID` and `modelName`, to join the two (`docs/operations.md`). A pass in which a GPU's
//! queries fail (a lost GPU) keeps the values last seen for that index; never seen: `""`.

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
    /// Last `(uuid, model)` seen per `gpu` index (`gpu`) or CUDA ordinal (`cuda`).
    identity: Arc<Mutex<Identities>>,
}

/// `(check, index) → (uuid, model)`.
type Identities = HashMap<(&'static str, String), (String, String)>;

/// The labels every per-GPU series carries besides its index.
const GPU_LABELS: [&str; 3] = ["gpu", "uuid", "model"];

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
                &GPU_LABELS,
            )?,
            gpu_temperature: gauge_vec(
                "gpu_temperature_celsius",
                "GPU die temperature in degrees Celsius.",
                &GPU_LABELS,
            )?,
            gpu_last_xid: gauge_vec(
                "gpu_last_xid",
                "Most recent XID reported for the GPU (0 when none since the agent started).",
                &GPU_LABELS,
            )?,
            gpu_xid_events: IntCounterVec::new(
                Opts::new(
                    format!("{P}gpu_xid_events_total"),
                    "XID events received from NVML per GPU.",
                ),
                &GPU_LABELS,
            )?,
            cuda_status: gauge_vec(
                "cuda_status",
                "Verdict of the cuda check per CUDA device: 0 ok, 1 unknown, 2 warning, 3 \
                 critical.",
                &["device", "uuid", "model"],
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
            identity: Arc::new(Mutex::new(HashMap::new())),
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
                    let (uuid, model) = self.identity_of("gpu", gpu, r);
                    let labels = [gpu, uuid.as_str(), model.as_str()];
                    self.gpu_status.with_label_values(&labels).set(severity);
                    if let Some(t) = num(r, "temperatureCelsius") {
                        self.gpu_temperature.with_label_values(&labels).set(t);
                    }
                    self.gpu_last_xid
                        .with_label_values(&labels)
                        .set(num(r, "lastXid").unwrap_or(0));
                    // The series exists at 0 from the GPU's first pass: `increase()` sees the
                    // first XID only as a step up from an earlier sample.
                    let xid_events = self.gpu_xid_events.with_label_values(&labels);
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
                        let (uuid, model) = self.identity_of("cuda", dev, r);
                        self.cuda_status
                            .with_label_values(&[dev, uuid.as_str(), model.as_str()])
                            .set(severity);
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

    /// `(uuid, model)` of device `index` of `check` from the result's `observed.uuid` and
    /// `observed.name`, falling back to the values last seen for that index (`""` when never
    /// seen). When a GPU's UUID changes under the same index, the XID counter of the old
    /// identity is removed (it would never move again).
    fn identity_of(&self, check: &'static str, index: &str, r: &CheckResult) -> (String, String) {
        let mut ids = self.identity.lock();
        let key = (check, index.to_string());
        let known = ids.get(&key).cloned().unwrap_or_default();
        let uuid = r.observed.get("uuid").cloned().unwrap_or(known.0.clone());
        let model = r.observed.get("name").cloned().unwrap_or(known.1.clone());
        let id = (uuid, model);
        if check == "gpu" && known != id && ids.contains_key(&key) {
            let _ = self.gpu_xid_events.remove_label_values(&[
                index,
                known.0.as_str(),
                known.1.as_str(),
            ]);
        }
        ids.insert(key, id.clone());
        id
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
            text.contains(
                "inferencecache_agent_gpu_xid_events_total{gpu=\"1\",model=\"\",uuid=\"\"} 0"
            ),
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
            "inferencecache_agent_gpu_status{gpu=\"0\",model=\"\",uuid=\"\"} 3",
            "inferencecache_agent_gpu_temperature_celsius{gpu=\"0\",model=\"\",uuid=\"\"} 61",
            "inferencecache_agent_gpu_last_xid{gpu=\"0\",model=\"\",uuid=\"\"} 79",
            // 2, then 3 (+1), then a pass without the GPU, then 2 again: no decrease
            "inferencecache_agent_gpu_xid_events_total{gpu=\"0\",model=\"\",uuid=\"\"} 3",
            "inferencecache_agent_cuda_status{device=\"0\",model=\"\",uuid=\"\"} 0",
            "inferencecache_agent_shm_host_size_bytes 1024",
            "inferencecache_agent_mp_workers{verdict=\"Hung\"} 1",
            "inferencecache_agent_mp_workers{verdict=\"Live\"} 0",
            "inferencecache_agent_check_reasons{check=\"gpu\",reason=\"GpuXidFatal\",status=\"critical\"} 1",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
    }

    fn encode(reg: &Registry) -> String {
        let mut buf = Vec::new();
        prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &reg.gather(), &mut buf)
            .unwrap();
        String::from_utf8(buf).unwrap()
    }

    /// Every per-GPU series carries the GPU's UUID and model (dcgm-exporter's `UUID` and
    /// `modelName`) from the result; a pass that cannot read them (a lost GPU) keeps the
    /// last-seen values, so the series (and the XID counter) stay one per GPU.
    #[test]
    fn gpu_series_carry_uuid_and_model() {
        let reg = Registry::new();
        let m = CheckMetrics::register(&reg).unwrap();
        let uuid = "GPU-8f6c0e3a-1b2c-4d5e-8f90-0123456789ab";
        let model = "NVIDIA H100 80GB HBM3";
        let healthy = CheckResult::new("gpu", "gpu0", CheckStatus::Ok, "GpuOk", "m")
            .with("uuid", uuid)
            .with("name", model)
            .with("temperatureCelsius", 40)
            .with("xidEventsTotal", 0);
        let cuda = CheckResult::new("cuda", "cuda0", CheckStatus::Ok, "CudaOk", "m")
            .with("uuid", uuid)
            .with("name", model);
        m.record(&[healthy.clone(), cuda]);
        let labels = format!("gpu=\"0\",model=\"{model}\",uuid=\"{uuid}\"");
        let text = encode(&reg);
        for line in [
            format!("inferencecache_agent_gpu_status{{{labels}}} 0"),
            format!("inferencecache_agent_gpu_temperature_celsius{{{labels}}} 40"),
            format!("inferencecache_agent_gpu_last_xid{{{labels}}} 0"),
            format!("inferencecache_agent_gpu_xid_events_total{{{labels}}} 0"),
            format!(
                "inferencecache_agent_cuda_status{{device=\"0\",model=\"{model}\",uuid=\"{uuid}\"}} 0"
            ),
        ] {
            assert!(text.contains(&line), "{line} not in\n{text}");
        }
        // the GPU falls off the bus: no name or UUID in the result, same series
        m.record(&[
            CheckResult::new("gpu", "gpu0", CheckStatus::Critical, "GpuLost", "m")
                .with("xidEventsTotal", 1),
        ]);
        let text = encode(&reg);
        assert!(
            text.contains(&format!("inferencecache_agent_gpu_status{{{labels}}} 3")),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "inferencecache_agent_gpu_xid_events_total{{{labels}}} 1"
            )),
            "{text}"
        );
        assert_eq!(
            text.matches("inferencecache_agent_gpu_status{").count(),
            1,
            "{text}"
        );
        // another GPU under the same index (replaced): the old identity's counter goes
        let other = CheckResult::new("gpu", "gpu0", CheckStatus::Ok, "GpuOk", "m")
            .with("uuid", "GPU-other")
            .with("name", model)
            .with("xidEventsTotal", 1);
        m.record(&[other]);
        let text = encode(&reg);
        assert!(!text.contains(uuid), "{text}");
        assert!(text.contains("uuid=\"GPU-other\""), "{text}");
    }
}
