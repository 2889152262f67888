//! One device read through NVML into a [`GpuSnapshot`]: identity, ECC counters, retired pages,
//! remapped rows, throttle reasons, the recovery-action field; a query that fails is recorded,
//! never a panic.

use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};

use super::health::{GpuSnapshot, RemappedRows, FI_GPU_RECOVERY_ACTION};

/// Reads one device into a snapshot. Unsupported queries leave `None`; `GpuLost` sets `lost`.
pub(super) fn snapshot(
    nvml: &Nvml,
    index: u32,
    driver: Option<String>,
    cuda: Option<String>,
) -> Result<GpuSnapshot, NvmlError> {
    let device = nvml.device_by_index(index)?;
    let mut s = GpuSnapshot {
        index,
        driver_version: driver,
        cuda_driver_version: cuda,
        ..GpuSnapshot::default()
    };
    let mut keep = |what: &str, r: Result<(), NvmlError>| match r {
        // an older library without the function is the same as an unsupported query
        Ok(()) | Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => {}
        Err(NvmlError::GpuLost) => s.lost = true,
        Err(NvmlError::ResetRequired) => {
            s.reset_required = true;
            s.query_errors
                .push(format!("{what}: {}", NvmlError::ResetRequired));
        }
        Err(e) => s.query_errors.push(format!("{what}: {e}")),
    };
    let mut name = None;
    keep("name", device.name().map(|v| name = Some(v)));
    let mut uuid = None;
    keep("uuid", device.uuid().map(|v| uuid = Some(v)));
    let mut mem = None;
    keep("memory", device.memory_info().map(|v| mem = Some(v)));
    let mut temp = None;
    keep(
        "temperature",
        device
            .temperature(TemperatureSensor::Gpu)
            .map(|v| temp = Some(v)),
    );
    let mut dbe = None;
    keep(
        "ecc",
        device
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .map(|v| dbe = Some(v)),
    );
    let mut pending = None;
    keep(
        "retiredPages",
        device
            .are_pages_pending_retired()
            .map(|v| pending = Some(v)),
    );
    let mut rows = None;
    keep(
        "remappedRows",
        remapped_rows(nvml, &device).map(|v| rows = Some(v)),
    );
    let mut throttle = None;
    keep(
        "throttle",
        device
            .current_throttle_reasons()
            .map(|v| throttle = Some(v.bits())),
    );
    let mut mig = None;
    keep(
        "migMode",
        device.mig_mode().map(|m| mig = Some(m.current == 1)),
    );
    let mut mig_count = None;
    if mig == Some(true) {
        let mut n = 0u32;
        let max = device.mig_device_count().unwrap_or(0);
        for i in 0..max {
            if device.mig_device_by_index(i).is_ok() {
                n += 1;
            }
        }
        mig_count = Some(n);
    }
    s.name = name;
    s.uuid = uuid;
    s.memory_total_bytes = mem.as_ref().map(|m| m.total);
    s.memory_used_bytes = mem.as_ref().map(|m| m.used);
    s.temperature_celsius = temp;
    s.ecc_dbe_volatile = dbe;
    s.retired_pages_pending = pending;
    s.remapped_rows = rows;
    s.throttle_reasons = throttle;
    s.mig_enabled = mig;
    s.mig_devices = mig_count;
    s.recovery_action = recovery_action(&device);
    Ok(s)
}

/// The GPU's recovery action through `nvmlDeviceGetFieldValues`
/// ([`FI_GPU_RECOVERY_ACTION`]); `None` when the library lacks the function or the driver
/// does not support the field (before R550) or answers with an error.
pub(super) fn recovery_action(device: &Device<'_>) -> Option<u32> {
    let values = device
        .field_values_for(&[FieldId(FI_GPU_RECOVERY_ACTION)])
        .ok()?;
    let sample = values.into_iter().next()?.ok()?;
    match sample.value.ok()? {
        SampleValue::U32(v) => Some(v),
        SampleValue::U64(v) => u32::try_from(v).ok(),
        SampleValue::I64(v) => u32::try_from(v).ok(),
        SampleValue::F64(_) => None,
    }
}

/// `nvmlDeviceGetRemappedRows`, which `nvml-wrapper` 0.13 does not wrap.
pub(super) fn remapped_rows(nvml: &Nvml, device: &Device<'_>) -> Result<RemappedRows, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetRemappedRows.as_ref())?;
    let (mut corr, mut unc, mut pending, mut failure) = (0, 0, 0, 0);
    // SAFETY: `sym` was resolved from the loaded NVML library and has the C signature
    // `nvmlReturn_t (nvmlDevice_t, unsigned*, unsigned*, unsigned*, unsigned*)`; the handle
    // comes from a live `Device` of the same `Nvml`, and the four out-pointers are valid
    // locals for the duration of the call.
    let rc = unsafe {
        sym(
            device.handle(),
            &mut corr,
            &mut unc,
            &mut pending,
            &mut failure,
        )
    };
    nvml_try(rc)?;
    Ok(RemappedRows {
        correctable: corr,
        uncorrectable: unc,
        pending: pending != 0,
        failure: failure != 0,
    })
}
