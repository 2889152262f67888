//! The long-lived NVML thread behind the `gpu` check.
//!
//! One dedicated thread per [`super::gpu::GpuCheck`] loads and initialises NVML once, keeps it
//! open, registers every GPU for `nvmlEventTypeXidCriticalError` events in one event set, and
//! waits on that set (`nvmlEventSetWait_v2`, one second at a time so that it notices when it is
//! told to stop). Each XID event is appended to the GPU's [`XidLog`] with its MIG GPU/compute
//! instance and, where the GPU is in MIG mode, the UUID of the MIG device of that GPU instance.
//! The check reads that state and shares the open NVML handle for its own state queries (NVML
//! is thread-safe). When NVML cannot be initialised the thread records why and tries again
//! every [`RETRY_INTERVAL`].

use std::collections::HashMap;
use std::ffi::{c_uint, c_ulonglong, c_void, OsStr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::{Device, EventSet, Nvml};
use parking_lot::{Condvar, Mutex};

use super::xid::{XidEvent, XidLog};

/// Time between NVML initialisation attempts after a failure.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(60);
/// One wait on the event set, in milliseconds (also the longest a stop request waits).
pub const EVENT_WAIT_MS: u32 = 1000;

/// `nvmlEventTypeXidCriticalError`.
const EVENT_TYPE_XID: c_ulonglong = 0x8;
/// The event data NVML uses for an XID of unknown value (`XidError::Unknown`).
const XID_UNKNOWN: c_ulonglong = 999;
/// NVML's "not applicable" instance id in event data.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

/// `nvmlEventData_t`, laid out as in `nvml.h`.
#[repr(C)]
struct RawEventData {
    device: *mut c_void,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// Why NVML could not be used: a stable cause label, an explanation, the error text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitFailure {
    /// `LibraryNotFound`, `NotNvml`, `DriverNotLoaded`, `NoPermission`, `InitFailed`.
    pub cause: &'static str,
    /// Sentence fragment explaining it.
    pub why: String,
    /// The NVML error.
    pub error: String,
}

/// The NVML thread's initialisation state.
#[derive(Debug, Clone)]
pub enum InitState {
    /// The first attempt has not finished.
    Pending,
    /// NVML is open.
    Ready(Arc<Nvml>),
    /// The last attempt failed.
    Failed(InitFailure),
}

/// XID monitoring of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventSupport {
    /// Registered for XID events.
    Monitored,
    /// Registration failed (`NotSupported` on some boards, or another error).
    Unavailable(String),
}

/// What the thread shares with the check.
#[derive(Debug)]
pub struct MonitorState {
    /// NVML's state.
    pub init: InitState,
    /// XID history per NVML device index.
    pub xids: HashMap<u32, XidLog>,
    /// Event registration per NVML device index.
    pub events: HashMap<u32, EventSupport>,
    /// The UUID of each NVML device index when it was registered: NVML's indexes shift when a
    /// GPU drops out of enumeration, so the check matches logs to GPUs by UUID.
    pub uuids: HashMap<u32, String>,
    /// The last error of `nvmlEventSetWait` other than a timeout.
    pub last_wait_error: Option<String>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<MonitorState>,
    changed: Condvar,
    stop: AtomicBool,
}

/// Handle to the NVML thread; stops it when dropped.
#[derive(Debug)]
pub struct NvmlMonitor {
    shared: Arc<Shared>,
}

impl Drop for NvmlMonitor {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _guard = self.shared.state.lock();
        self.shared.changed.notify_all();
    }
}

impl NvmlMonitor {
    /// Starts the thread for `library` (`None`: `libnvidia-ml.so.1` from the loader path).
    /// `classify` turns an initialisation error into an [`InitFailure`].
    pub fn start(
        library: Option<PathBuf>,
        default_library: &'static str,
        classify: fn(&NvmlError, &str) -> InitFailure,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(MonitorState {
                init: InitState::Pending,
                xids: HashMap::new(),
                events: HashMap::new(),
                uuids: HashMap::new(),
                last_wait_error: None,
            }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("ic-nvml".into())
            .spawn(move || run(thread_shared, library, default_library, classify))?;
        Ok(NvmlMonitor { shared })
    }

    /// Waits up to `timeout` for the first initialisation attempt to finish, then returns the
    /// state of NVML.
    pub fn init_state(&self, timeout: Duration) -> InitState {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state.lock();
        while matches!(st.init, InitState::Pending) {
            if self
                .shared
                .changed
                .wait_until(&mut st, deadline)
                .timed_out()
            {
                break;
            }
        }
        st.init.clone()
    }

    /// Runs `f` on the shared state (XID logs, event support).
    pub fn with_state<T>(&self, f: impl FnOnce(&MonitorState) -> T) -> T {
        f(&self.shared.state.lock())
    }
}

/// Sleeps up to `d`, returning early (true) when asked to stop.
fn sleep_or_stop(shared: &Shared, d: Duration) -> bool {
    let deadline = Instant::now() + d;
    let mut st = shared.state.lock();
    while !shared.stop.load(Ordering::SeqCst) {
        if shared.changed.wait_until(&mut st, deadline).timed_out() {
            break;
        }
    }
    shared.stop.load(Ordering::SeqCst)
}

fn run(
    shared: Arc<Shared>,
    library: Option<PathBuf>,
    default_library: &'static str,
    classify: fn(&NvmlError, &str) -> InitFailure,
) {
    let label = library
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| default_library.to_string());
    while !shared.stop.load(Ordering::SeqCst) {
        let lib = library
            .as_deref()
            .map(|p| p.as_os_str())
            .unwrap_or(OsStr::new(default_library));
        match Nvml::builder().lib_path(lib).init() {
            Err(e) => {
                {
                    let mut st = shared.state.lock();
                    st.init = InitState::Failed(classify(&e, &label));
                    shared.changed.notify_all();
                }
                if sleep_or_stop(&shared, RETRY_INTERVAL) {
                    return;
                }
            }
            Ok(nvml) => {
                let nvml = Arc::new(nvml);
                // Register before announcing Ready, so the first run already sees which GPUs
                // are watched.
                let registered = register(&shared, &nvml);
                {
                    let mut st = shared.state.lock();
                    st.init = InitState::Ready(nvml.clone());
                    shared.changed.notify_all();
                }
                watch_events(&shared, &nvml, registered);
                return;
            }
        }
    }
}

/// MIG devices of a GPU: GPU instance id → MIG device UUID.
fn mig_devices(nvml: &Nvml, device: &Device<'_>) -> HashMap<u32, String> {
    let mut out = HashMap::new();
    let enabled = device.mig_mode().map(|m| m.current == 1).unwrap_or(false);
    if !enabled {
        return out;
    }
    let count = device.mig_device_count().unwrap_or(0);
    let Ok(sym) = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref()) else {
        return out;
    };
    for i in 0..count {
        let Ok(mig) = device.mig_device_by_index(i) else {
            continue;
        };
        let mut gi: c_uint = 0;
        // SAFETY: `sym` is `nvmlDeviceGetGpuInstanceId(nvmlDevice_t, unsigned*)` from the loaded
        // NVML; the handle is a live MIG device of the same `Nvml`; `gi` is a valid local.
        let rc = unsafe { sym(mig.handle(), &mut gi) };
        if nvml_try(rc).is_ok() {
            if let Ok(uuid) = mig.uuid() {
                out.insert(gi, uuid);
            }
        }
    }
    out
}

fn watch_events<'n>(shared: &Shared, nvml: &'n Nvml, registered: Option<Registered<'n>>) {
    let Some(set) = registered else {
        // Nothing to wait on: idle until told to stop.
        while !sleep_or_stop(shared, Duration::from_secs(3600)) {}
        return;
    };
    let (set, handles, mut migs) = set;
    let Ok(wait) = nvml_sym(nvml.lib().nvmlEventSetWait_v2.as_ref()) else {
        shared.state.lock().last_wait_error = Some("nvmlEventSetWait_v2 is missing".into());
        while !sleep_or_stop(shared, Duration::from_secs(3600)) {}
        return;
    };
    while !shared.stop.load(Ordering::SeqCst) {
        let mut data = RawEventData {
            device: std::ptr::null_mut(),
            event_type: 0,
            event_data: 0,
            gpu_instance_id: NO_INSTANCE,
            compute_instance_id: NO_INSTANCE,
        };
        let started = Instant::now();
        // SAFETY: `wait` is `nvmlEventSetWait_v2(nvmlEventSet_t, nvmlEventData_t*, unsigned)`
        // from the loaded NVML; the set is live for this loop (dropped after it); `data` is a
        // local with the layout of `nvmlEventData_t` (`#[repr(C)]`, same field types), valid for
        // writes during the call.
        let rc = unsafe {
            wait(
                set.handle(),
                (&mut data as *mut RawEventData).cast(),
                EVENT_WAIT_MS,
            )
        };
        match nvml_try(rc) {
            Ok(()) => {
                if data.event_type & EVENT_TYPE_XID == 0 {
                    continue;
                }
                let key = data.device as usize;
                let Some(&(index, ref device)) = handles.get(&key) else {
                    continue;
                };
                let gi = (data.gpu_instance_id != NO_INSTANCE).then_some(data.gpu_instance_id);
                let ci =
                    (data.compute_instance_id != NO_INSTANCE).then_some(data.compute_instance_id);
                let mut mig_uuid = None;
                if let Some(gi) = gi {
                    if !migs.get(&index).is_some_and(|m| m.contains_key(&gi)) {
                        migs.insert(index, mig_devices(nvml, device));
                    }
                    mig_uuid = migs.get(&index).and_then(|m| m.get(&gi)).cloned();
                }
                let event = XidEvent {
                    // As nvml-wrapper's `XidError`: 999 is `Unknown`, anything else `Value(n)`.
                    xid: (data.event_data != XID_UNKNOWN).then_some(data.event_data),
                    at: SystemTime::now(),
                    gpu_instance: gi,
                    compute_instance: ci,
                    mig_uuid,
                };
                tracing::warn!(
                    gpu = index,
                    xid = ?event.xid,
                    gpu_instance = ?gi,
                    "NVML reported an XID event"
                );
                shared
                    .state
                    .lock()
                    .xids
                    .entry(index)
                    .or_default()
                    .push(event);
            }
            Err(NvmlError::Timeout) => {
                // A library that returns at once would spin this loop: pace it.
                if started.elapsed() < Duration::from_millis(10)
                    && sleep_or_stop(shared, Duration::from_millis(500))
                {
                    return;
                }
            }
            Err(e) => {
                shared.state.lock().last_wait_error = Some(e.to_string());
                if sleep_or_stop(shared, Duration::from_secs(1)) {
                    return;
                }
            }
        }
    }
}

type Registered<'n> = (
    EventSet<'n>,
    HashMap<usize, (u32, Device<'n>)>,
    HashMap<u32, HashMap<u32, String>>,
);

/// Creates the event set and registers every GPU; `None` when no GPU could be registered.
fn register<'n>(shared: &Shared, nvml: &'n Nvml) -> Option<Registered<'n>> {
    let count = nvml.device_count().ok()?;
    let set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => {
            let mut st = shared.state.lock();
            for i in 0..count {
                st.events
                    .insert(i, EventSupport::Unavailable(format!("event set: {e}")));
            }
            return None;
        }
    };
    let reg = nvml_sym(nvml.lib().nvmlDeviceRegisterEvents.as_ref()).ok();
    let mut handles = HashMap::new();
    let mut migs = HashMap::new();
    for i in 0..count {
        if let Ok(uuid) = nvml.device_by_index(i).and_then(|d| d.uuid()) {
            shared.state.lock().uuids.insert(i, uuid);
        }
        let support = match (nvml.device_by_index(i), reg) {
            (Err(e), _) => EventSupport::Unavailable(e.to_string()),
            (Ok(_), None) => {
                EventSupport::Unavailable("nvmlDeviceRegisterEvents is missing".into())
            }
            (Ok(device), Some(reg)) => {
                // SAFETY: `reg` is `nvmlDeviceRegisterEvents(nvmlDevice_t, unsigned long long,
                // nvmlEventSet_t)` from the loaded NVML; the device handle and the set are live
                // objects of the same `Nvml`. The raw call keeps the set on failure (the
                // wrapper's `register_events` frees it), so one unsupported GPU does not cost
                // the others their events.
                let rc = unsafe { reg(device.handle(), EVENT_TYPE_XID, set.handle()) };
                match nvml_try(rc) {
                    Ok(()) => {
                        // SAFETY: reading the handle value of a live device (no call made).
                        let key = unsafe { device.handle() } as usize;
                        migs.insert(i, mig_devices(nvml, &device));
                        handles.insert(key, (i, device));
                        EventSupport::Monitored
                    }
                    Err(e) => EventSupport::Unavailable(e.to_string()),
                }
            }
        };
        shared.state.lock().events.insert(i, support);
    }
    if handles.is_empty() {
        return None;
    }
    Some((set, handles, migs))
}
