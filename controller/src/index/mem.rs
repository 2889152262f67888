//! Memory hints for the block tables: transparent huge pages for large slot arrays, and software
//! prefetches for a run of probes. Both are hints to the kernel or the CPU: they change speed,
//! never contents, and failing to apply them is not an error.
//!
//! Why: a probe into a table of a few hundred thousand blocks is a random access into megabytes.
//! With 4 KiB pages nearly every one also misses the TLB (16 MiB = 4 096 pages; a core's
//! second-level TLB holds ~1.5–2 k), and under virtualisation a TLB miss is a two-dimensional
//! page walk. With 2 MiB pages the same table is 8 TLB entries.

/// A transparent huge page (x86-64, and aarch64 with 4 KiB base pages).
pub(super) const HUGE_PAGE: usize = 2 << 20;

/// Slot arrays at least this large are advised to use huge pages (a smaller one spans at most a
/// huge page or two: few TLB entries either way, and no aligned interior worth advising).
pub(super) const HUGE_MIN_BYTES: usize = 4 << 20;

/// Asks the kernel to back the 2 MiB-aligned interior of `region` with transparent huge pages
/// (`madvise(MADV_HUGEPAGE)`, honoured when `/sys/kernel/mm/transparent_hugepage/enabled` is
/// `madvise` or `always`). Call it before the memory is first written (pass a `Vec`'s
/// `spare_capacity_mut()`): pages already faulted in stay 4 KiB until khugepaged collapses them.
/// Returns the bytes advised: 0 when the region has no aligned interior, off Linux, or when the
/// kernel refuses (EINVAL without THP support). Never fails and never changes the contents.
pub(super) fn advise_huge_pages<T>(region: &mut [T]) -> usize {
    let base = region.as_mut_ptr().cast::<u8>();
    let start = base as usize;
    let end = start.saturating_add(std::mem::size_of_val(region));
    let lo = start.next_multiple_of(HUGE_PAGE);
    let hi = end - end % HUGE_PAGE;
    if hi <= lo {
        return 0;
    }
    // Derived from `base` (not cast from the integer), so the pointer keeps the region's
    // provenance.
    let interior = base.wrapping_add(lo - start);
    #[cfg(target_os = "linux")]
    {
        use nix::sys::mman::{madvise, MmapAdvise};
        let Some(addr) = std::ptr::NonNull::new(interior.cast::<std::ffi::c_void>()) else {
            return 0;
        };
        // SAFETY: [lo, hi) is 2 MiB-aligned (so page-aligned, as madvise requires) and lies
        // inside `region`, which this function borrows mutably: mapped memory, aliased by no
        // other reference. MADV_HUGEPAGE only marks the range eligible for huge pages; unlike
        // MADV_DONTNEED or MADV_FREE it changes neither the contents nor the validity of the
        // memory, so the program's view of it is the same whatever the kernel answers.
        match unsafe { madvise(addr, hi - lo, MmapAdvise::MADV_HUGEPAGE) } {
            Ok(()) => hi - lo,
            Err(_) => 0,
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = interior;
        0
    }
}

/// Hints the CPU to fetch the cache line at `p` into all cache levels; no-op off x86-64.
#[inline(always)]
pub(super) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86-64 CPU has (it is in the x86-64 target's
    // baseline features). A prefetch is only a hint: it never faults, whatever the address, and
    // reads nothing the program can observe.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn advice_covers_only_the_aligned_interior_and_never_touches_contents() {
        // Small or empty regions have no aligned interior: nothing is advised.
        let mut v: Vec<u64> = Vec::with_capacity(1000);
        assert_eq!(advise_huge_pages(v.spare_capacity_mut()), 0);
        assert_eq!(advise_huge_pages::<u64>(&mut []), 0);

        // 5 MiB: at least one whole aligned huge page lies inside, whatever the base address
        // (advised wherever the kernel has THP at all).
        let n = (5 << 20) / 8;
        let mut v: Vec<u64> = Vec::with_capacity(n);
        let advised = advise_huge_pages(v.spare_capacity_mut());
        assert_eq!(advised % HUGE_PAGE, 0);
        assert!(advised <= 5 << 20);
        if cfg!(target_os = "linux")
            && std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists()
        {
            assert!(advised >= HUGE_PAGE, "advised {advised} bytes");
        }
        // The memory is as usable as before.
        v.extend((0..n as u64).map(|i| i * 3));
        assert!(v.iter().enumerate().all(|(i, x)| *x == i as u64 * 3));
        // Advising memory already written keeps its contents.
        let before = v.clone();
        advise_huge_pages(&mut v[..]);
        assert_eq!(v, before);
        assert_eq!(advise_huge_pages(v.spare_capacity_mut()), 0);
    }

    #[test]
    fn prefetch_accepts_any_address() {
        let x = [7u64; 4];
        prefetch(x.as_ptr());
        prefetch(std::ptr::null::<u64>());
        prefetch(std::ptr::without_provenance::<u64>(usize::MAX));
        assert_eq!(x, [7; 4]);
    }
}
