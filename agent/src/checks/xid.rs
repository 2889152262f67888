//! XID events: the policy that says which ones matter, and the per-GPU log the `gpu` check
//! judges them from.
//!
//! An XID is the driver's error report for one GPU (`NVRM: Xid (PCI:…): 79, …` in the kernel
//! log), delivered to NVML clients as a `nvmlEventTypeXidCriticalError` event. Which XIDs mean
//! a broken GPU is policy, kept as data ([`XidPolicy`]) with NVIDIA's published sets as the
//! default:
//!
//! - **application errors** — 13, 31, 43, 45, 68, 109 — are caused by the program running on
//!   the GPU (illegal address, page fault, stopped or preempted context, video engine
//!   exception, context-switch timeout); the device plugin ignores them, so do we
//!   ([`XidAction::Ignore`], counted and shown);
//! - **fatal** — DCGM's set 48, 74, 79, 94, 95, 119, 120, 140 (double-bit ECC, NVLink, fallen
//!   off the bus, contained/uncontained ECC, GSP timeout/error, unrecovered ECC) and the NVLink
//!   errors the catalog resolves with a GPU reset (144–148, 150) — make the GPU `Critical`
//!   ([`XidAction::Critical`]) **until the GPU is reset or the node reboots** (they do not
//!   expire with the quiet period; the `gpu` check keeps them in the state directory across
//!   agent restarts);
//! - **every other XID** reads `Warning` by default ([`XidPolicy::unlisted`]; the device plugin
//!   treats them as fatal — set `unlisted` to `Critical` for that behaviour);
//! - explicit configuration: `enabled` XIDs are `Critical` whatever else says, `disabled` ones
//!   (or all, with `disable_all`) are ignored; **enable beats disable**.
//!
//! A `Warning` XID is an event, not a state: a GPU whose last such XID is older than the
//! **quiet period** reads healthy again (the persistent damage, such as ECC counters or
//! pending row remaps, is judged from NVML's state queries, not from the events).

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use ic_shared::check::CheckStatus;
use thiserror::Error;

/// NVIDIA's application-error XIDs (device plugin defaults, 109 in newer releases).
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];
/// XIDs that fail a GPU: DCGM's set (48, 74, 79, 94, 95, 119, 120, 140) and the NVLink errors
/// whose immediate resolution in NVIDIA's XID catalog is a GPU reset (144–148, 150: SAW, RLW,
/// TLW, TREX, NVLPW_CTRL, MSE). XID 149 (NETIR) is fatal in some variants only: NVML's recovery
/// action tells them apart where the driver exposes it (`gpu` check, `GpuRecoveryRequired`).
pub const FATAL_XIDS: [u64; 14] = [
    48, 74, 79, 94, 95, 119, 120, 140, 144, 145, 146, 147, 148, 150,
];
/// Default quiet period after which a GPU recovers from its XIDs.
pub const DEFAULT_QUIET_PERIOD: Duration = Duration::from_secs(600);
/// Events kept per GPU (oldest dropped first); counters keep counting.
pub const LOG_CAPACITY: usize = 64;

/// What an XID does to a GPU's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum XidAction {
    /// Counted and shown, no effect on the status.
    Ignore,
    /// The GPU reads `Warning` until the quiet period passes.
    Warning,
    /// The GPU reads `Critical` until the quiet period passes.
    Critical,
}

impl XidAction {
    /// The status the action gives.
    pub fn status(self) -> CheckStatus {
        match self {
            XidAction::Ignore => CheckStatus::Ok,
            XidAction::Warning => CheckStatus::Warning,
            XidAction::Critical => CheckStatus::Critical,
        }
    }

    /// Lower-case label (`ignore`, `warning`, `critical`).
    pub fn as_str(self) -> &'static str {
        match self {
            XidAction::Ignore => "ignore",
            XidAction::Warning => "warning",
            XidAction::Critical => "critical",
        }
    }

    /// Parses `ignore`, `warning` or `critical` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ignore" => Some(XidAction::Ignore),
            "warning" => Some(XidAction::Warning),
            "critical" => Some(XidAction::Critical),
            _ => None,
        }
    }
}

/// A malformed XID list or action.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum XidPolicyError {
    /// An entry of a comma-separated XID list is not a number (or `all` where allowed).
    #[error("invalid XID {0:?}: expected a number (or \"all\" in the disable list)")]
    BadXid(String),
    /// An action name other than ignore/warning/critical.
    #[error("invalid XID action {0:?}: expected ignore, warning or critical")]
    BadAction(String),
}

/// Which XIDs matter (module docs). `Default` is NVIDIA's published policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidPolicy {
    /// XIDs caused by applications: ignored unless enabled.
    pub application: BTreeSet<u64>,
    /// XIDs that fail a GPU: `Critical` unless disabled.
    pub fatal: BTreeSet<u64>,
    /// Action for an XID in neither set.
    pub unlisted: XidAction,
    /// Explicitly enabled: always `Critical` (beats `disabled` and `disable_all`).
    pub enabled: BTreeSet<u64>,
    /// Explicitly disabled: ignored.
    pub disabled: BTreeSet<u64>,
    /// Ignore every XID that is not explicitly enabled.
    pub disable_all: bool,
    /// Time after the last XID that matters after which the GPU reads healthy again.
    pub quiet_period: Duration,
}

impl Default for XidPolicy {
    fn default() -> Self {
        XidPolicy {
            application: APPLICATION_XIDS.into_iter().collect(),
            fatal: FATAL_XIDS.into_iter().collect(),
            unlisted: XidAction::Warning,
            enabled: BTreeSet::new(),
            disabled: BTreeSet::new(),
            disable_all: false,
            quiet_period: DEFAULT_QUIET_PERIOD,
        }
    }
}

/// Where an XID's action came from (for messages and observed values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidRule {
    /// In the explicit enable list.
    Enabled,
    /// In the explicit disable list, or all disabled.
    Disabled,
    /// In the fatal set.
    Fatal,
    /// In the application-error set.
    Application,
    /// In neither set.
    Unlisted,
}

impl XidRule {
    /// Lower-case label.
    pub fn as_str(self) -> &'static str {
        match self {
            XidRule::Enabled => "enabled",
            XidRule::Disabled => "disabled",
            XidRule::Fatal => "fatal",
            XidRule::Application => "application",
            XidRule::Unlisted => "unlisted",
        }
    }
}

impl XidPolicy {
    /// The action for one XID and the rule that decided it. Precedence: enabled, disabled
    /// (or disable-all), fatal, application, unlisted.
    pub fn classify(&self, xid: u64) -> (XidAction, XidRule) {
        if self.enabled.contains(&xid) {
            (XidAction::Critical, XidRule::Enabled)
        } else if self.disable_all || self.disabled.contains(&xid) {
            (XidAction::Ignore, XidRule::Disabled)
        } else if self.fatal.contains(&xid) {
            (XidAction::Critical, XidRule::Fatal)
        } else if self.application.contains(&xid) {
            (XidAction::Ignore, XidRule::Application)
        } else {
            (self.unlisted, XidRule::Unlisted)
        }
    }

    /// The action for one XID ([`XidPolicy::classify`] without the rule).
    pub fn action(&self, xid: u64) -> XidAction {
        self.classify(xid).0
    }

    /// Parses a comma-separated XID list (`"13, 43,109"`; empty → empty). Returns the set and
    /// whether `all` appeared (only meaningful for the disable list).
    pub fn parse_list(s: &str) -> Result<(BTreeSet<u64>, bool), XidPolicyError> {
        let mut set = BTreeSet::new();
        let mut all = false;
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            if item.eq_ignore_ascii_case("all") {
                all = true;
            } else {
                set.insert(
                    item.parse::<u64>()
                        .map_err(|_| XidPolicyError::BadXid(item.to_string()))?,
                );
            }
        }
        Ok((set, all))
    }

    /// Applies the operator's settings to the default policy: `enable` and `disable` are XID
    /// lists (`disable` may say `all`), `unlisted` an action name, `quiet` the quiet period.
    /// `None` leaves the default.
    pub fn configured(
        enable: Option<&str>,
        disable: Option<&str>,
        unlisted: Option<&str>,
        quiet: Option<Duration>,
    ) -> Result<Self, XidPolicyError> {
        let mut p = XidPolicy::default();
        if let Some(e) = enable {
            let (set, all) = Self::parse_list(e)?;
            if all {
                return Err(XidPolicyError::BadXid("all".into()));
            }
            p.enabled = set;
        }
        if let Some(d) = disable {
            let (set, all) = Self::parse_list(d)?;
            p.disabled = set;
            p.disable_all = all;
        }
        if let Some(u) = unlisted {
            p.unlisted = XidAction::parse(u).ok_or_else(|| XidPolicyError::BadAction(u.into()))?;
        }
        if let Some(q) = quiet {
            p.quiet_period = q;
        }
        Ok(p)
    }
}

/// Short description of well-known XIDs (NVIDIA's XID catalog), for messages.
pub fn xid_description(xid: u64) -> &'static str {
    match xid {
        8 => "GPU stopped processing (timeout)",
        13 => "graphics engine exception (application error)",
        31 => "GPU memory page fault (application error)",
        32 => "invalid or corrupted push buffer stream",
        38 => "driver firmware error",
        43 => "GPU stopped processing (application error)",
        45 => "preemptive cleanup after an application error",
        48 => "double-bit ECC error",
        56 => "display engine error",
        61 => "internal micro-controller breakpoint",
        62 => "internal micro-controller halt",
        63 => "ECC page retirement or row remapping recorded",
        64 => "ECC page retirement or row remapping failure",
        68 => "video processor exception (application error)",
        69 => "graphics engine class error",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        109 => "context switch timeout (application error)",
        119 => "GSP RPC timeout",
        120 => "GSP error",
        121 => "C2C link error",
        140 => "unrecovered ECC error",
        143 => "GPU initialization failure",
        144 => "NVLink SAW error",
        145 => "NVLink RLW error",
        146 => "NVLink TLW error",
        147 => "NVLink TREX error",
        148 => "NVLink NVLPW_CTRL error",
        149 => "NVLink NETIR error (fatal in some variants: see the recovery action)",
        150 => "NVLink MSE error",
        154 => "GPU recovery action changed",
        _ => "see NVIDIA's XID catalog",
    }
}

/// One XID event as the NVML thread saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidEvent {
    /// The XID (`None`: NVML reported an XID event without a value, `XidError::Unknown`).
    pub xid: Option<u64>,
    /// Wall-clock time the event was received.
    pub at: SystemTime,
    /// MIG GPU instance id, when the event came from one.
    pub gpu_instance: Option<u32>,
    /// MIG compute instance id, when the event came from one.
    pub compute_instance: Option<u32>,
    /// UUID of the MIG device of that GPU instance, when known.
    pub mig_uuid: Option<String>,
}

impl XidEvent {
    /// `on MIG instance GI 1/CI 0 (MIG-…)`, or empty for a whole-GPU event.
    pub fn mig_label(&self) -> String {
        match (self.gpu_instance, self.compute_instance) {
            (None, _) => String::new(),
            (Some(gi), ci) => {
                let ci = ci.map(|c| format!("/CI {c}")).unwrap_or_default();
                let uuid = self
                    .mig_uuid
                    .as_ref()
                    .map(|u| format!(" ({u})"))
                    .unwrap_or_default();
                format!(" on MIG instance GI {gi}{ci}{uuid}")
            }
        }
    }
}

/// The XID history of one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct XidLog {
    /// The most recent events, oldest first, at most [`LOG_CAPACITY`].
    pub events: Vec<XidEvent>,
    /// Every event received since the agent started.
    pub total: u64,
    /// Events dropped from `events` (beyond [`LOG_CAPACITY`]), counted per XID value (`None`:
    /// unknown value), so that counts over the whole history stay exact.
    pub dropped: std::collections::BTreeMap<Option<u64>, u64>,
}

impl XidLog {
    /// Appends an event, dropping the oldest beyond [`LOG_CAPACITY`].
    pub fn push(&mut self, e: XidEvent) {
        self.total += 1;
        self.events.push(e);
        if self.events.len() > LOG_CAPACITY {
            let extra = self.events.len() - LOG_CAPACITY;
            for old in self.events.drain(..extra) {
                *self.dropped.entry(old.xid).or_default() += 1;
            }
        }
    }
}

/// What a GPU's XID log means now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidVerdict {
    /// The worst action among events inside the quiet period (`Ignore` when none matters).
    pub action: XidAction,
    /// The most recent event that decided `action` (`None` when `action` is `Ignore`).
    pub culprit: Option<XidEvent>,
    /// Rule of the culprit.
    pub rule: Option<XidRule>,
    /// Distinct XIDs inside the quiet period that matter, ascending.
    pub active: Vec<u64>,
    /// Events ignored by policy (application errors, disabled) since the agent started: a
    /// count over the whole history, including events dropped from the bounded log.
    pub ignored: u64,
    /// The most recent event of any kind.
    pub last: Option<XidEvent>,
    /// True when a `Warning` XID is in the log but older than the quiet period.
    pub recovered: bool,
}

/// The pure decision over a GPU's XID log at time `now` (tests pass any clock).
/// An event without a value (`XidError::Unknown`) counts as an unlisted XID. `Critical` events
/// never age out (only a GPU reset or a reboot clears them: the caller drops them from the
/// log); `Warning` events count for the policy's quiet period.
pub fn evaluate_xids(log: &XidLog, policy: &XidPolicy, now: SystemTime) -> XidVerdict {
    let mut v = XidVerdict {
        action: XidAction::Ignore,
        culprit: None,
        rule: None,
        active: Vec::new(),
        ignored: 0,
        last: log.events.last().cloned(),
        recovered: false,
    };
    let mut active = BTreeSet::new();
    for e in &log.events {
        let (action, rule) = match e.xid {
            Some(x) => policy.classify(x),
            None => (policy.unlisted, XidRule::Unlisted),
        };
        if action == XidAction::Ignore {
            v.ignored += 1;
            continue;
        }
        // an event from the future (clock stepped back) counts as just now
        let age = now.duration_since(e.at).unwrap_or(Duration::ZERO);
        if action == XidAction::Warning && age >= policy.quiet_period {
            v.recovered = true;
            continue;
        }
        if let Some(x) = e.xid {
            active.insert(x);
        }
        if action >= v.action {
            v.action = action;
            v.culprit = Some(e.clone());
            v.rule = Some(rule);
        }
    }
    if v.action != XidAction::Ignore {
        v.recovered = false;
    }
    for (xid, n) in &log.dropped {
        let action = match xid {
            Some(x) => policy.action(*x),
            None => policy.unlisted,
        };
        if action == XidAction::Ignore {
            v.ignored += n;
        }
    }
    v.active = active.into_iter().collect();
    v
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn default_policy_is_exhaustive_over_the_catalog_range() {
        let p = XidPolicy::default();
        for xid in 0..=200u64 {
            let (action, rule) = p.classify(xid);
            let want = if APPLICATION_XIDS.contains(&xid) {
                (XidAction::Ignore, XidRule::Application)
            } else if FATAL_XIDS.contains(&xid) {
                (XidAction::Critical, XidRule::Fatal)
            } else {
                (XidAction::Warning, XidRule::Unlisted)
            };
            assert_eq!((action, rule), want, "xid {xid}");
        }
    }

    #[test]
    fn explicit_enable_beats_disable() {
        let p = XidPolicy::configured(Some("13, 79"), Some("79,92"), None, None).unwrap();
        assert_eq!(p.classify(13), (XidAction::Critical, XidRule::Enabled));
        assert_eq!(p.classify(79), (XidAction::Critical, XidRule::Enabled));
        assert_eq!(p.classify(92), (XidAction::Ignore, XidRule::Disabled));
        assert_eq!(p.classify(48), (XidAction::Critical, XidRule::Fatal));
        let all = XidPolicy::configured(Some("48"), Some("all"), Some("critical"), None).unwrap();
        assert_eq!(all.classify(79), (XidAction::Ignore, XidRule::Disabled));
        assert_eq!(all.classify(1000), (XidAction::Ignore, XidRule::Disabled));
        assert_eq!(all.classify(48), (XidAction::Critical, XidRule::Enabled));
        let strict = XidPolicy::configured(None, None, Some("Critical"), None).unwrap();
        assert_eq!(strict.action(92), XidAction::Critical);
        assert_eq!(strict.action(13), XidAction::Ignore);
        assert_eq!(
            XidPolicy::configured(Some("x"), None, None, None),
            Err(XidPolicyError::BadXid("x".into()))
        );
        assert_eq!(
            XidPolicy::configured(Some("all"), None, None, None),
            Err(XidPolicyError::BadXid("all".into()))
        );
        assert!(XidPolicy::configured(None, None, Some("loud"), None).is_err());
        assert_eq!(XidPolicy::parse_list("").unwrap(), (BTreeSet::new(), false));
    }

    fn ev(xid: u64, at: SystemTime) -> XidEvent {
        XidEvent {
            xid: Some(xid),
            at,
            gpu_instance: None,
            compute_instance: None,
            mig_uuid: None,
        }
    }

    #[test]
    fn quiet_period_recovers_and_worst_wins() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let p = XidPolicy {
            quiet_period: Duration::from_secs(60),
            ..XidPolicy::default()
        };
        let mut log = XidLog::default();
        let v = evaluate_xids(&log, &p, t0);
        assert_eq!(
            (v.action, v.recovered, v.last.is_none()),
            (XidAction::Ignore, false, true)
        );

        log.push(ev(13, t0));
        let v = evaluate_xids(&log, &p, t0);
        assert_eq!((v.action, v.ignored), (XidAction::Ignore, 1));

        log.push(ev(92, t0 + Duration::from_secs(1)));
        log.push(ev(79, t0 + Duration::from_secs(2)));
        log.push(ev(92, t0 + Duration::from_secs(3)));
        let v = evaluate_xids(&log, &p, t0 + Duration::from_secs(10));
        assert_eq!(v.action, XidAction::Critical);
        assert_eq!(v.culprit.as_ref().and_then(|e| e.xid), Some(79));
        assert_eq!(v.rule, Some(XidRule::Fatal));
        assert_eq!(v.active, vec![79, 92]);
        assert_eq!(v.last.as_ref().and_then(|e| e.xid), Some(92));
        // the warnings age out; the fatal 79 does not (only a reset or a reboot clears it)
        let v = evaluate_xids(&log, &p, t0 + Duration::from_secs(3600));
        assert_eq!(v.action, XidAction::Critical);
        assert_eq!(v.active, vec![79]);
        // without the fatal one, everything quiet: recovered
        let mut warn = XidLog::default();
        warn.push(ev(92, t0 + Duration::from_secs(1)));
        warn.push(ev(92, t0 + Duration::from_secs(3)));
        let v = evaluate_xids(&warn, &p, t0 + Duration::from_secs(62));
        assert_eq!((v.action, v.active.clone()), (XidAction::Warning, vec![92]));
        let v = evaluate_xids(&warn, &p, t0 + Duration::from_secs(63));
        assert_eq!((v.action, v.recovered), (XidAction::Ignore, true));
        assert!(v.culprit.is_none());
        // an event without a value is unlisted
        let mut unknown = XidLog::default();
        unknown.push(XidEvent {
            xid: None,
            ..ev(0, t0)
        });
        assert_eq!(evaluate_xids(&unknown, &p, t0).action, XidAction::Warning);
    }

    #[test]
    fn log_is_bounded_and_mig_labels() {
        let t0 = SystemTime::UNIX_EPOCH;
        let mut log = XidLog::default();
        for i in 0..(LOG_CAPACITY as u64 + 10) {
            log.push(ev(i, t0));
        }
        assert_eq!(log.events.len(), LOG_CAPACITY);
        // xidIgnored is a count over the whole history, not over the bounded window
        let mut apps = XidLog::default();
        for _ in 0..(LOG_CAPACITY as u64 + 36) {
            apps.push(ev(13, t0));
        }
        let v = evaluate_xids(&apps, &XidPolicy::default(), t0);
        assert_eq!(v.ignored, LOG_CAPACITY as u64 + 36);
        assert_eq!(log.total, LOG_CAPACITY as u64 + 10);
        assert_eq!(log.events[0].xid, Some(10));
        let mut e = ev(43, t0);
        assert_eq!(e.mig_label(), "");
        e.gpu_instance = Some(1);
        e.compute_instance = Some(0);
        e.mig_uuid = Some("MIG-abc".into());
        assert_eq!(e.mig_label(), " on MIG instance GI 1/CI 0 (MIG-abc)");
        assert_eq!(xid_description(79), "GPU has fallen off the bus");
    }
}
