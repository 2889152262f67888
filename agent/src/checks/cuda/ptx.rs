//! The probe kernel (`out[i] = 3·i + 7`) as PTX text, and the PTX ISA version it is written in:
//! the plan's CUDA runtime's, at least what the GPU's architecture needs, so a driver too old for
//! the engines fails the probe as it would fail them.

/// Entry point of the probe kernel.
pub const KERNEL_NAME: &str = "ic_probe";
/// Elements the probe kernel writes.
pub const PROBE_ELEMENTS: u32 = 256;
/// Threads per block of the probe launch.
pub(super) const BLOCK: u32 = 128;

/// The value the probe kernel writes at index `i`.
pub fn expected_value(i: u32) -> u32 {
    i.wrapping_mul(3).wrapping_add(7)
}

/// PTX ISA version that ships with a CUDA toolkit `major.minor` (NVIDIA's PTX ISA release
/// history); newer toolkits than the table map to its newest entry, older to PTX 6.0.
pub fn ptx_isa_for_cuda(major: u32, minor: u32) -> (u32, u32) {
    const TABLE: [((u32, u32), (u32, u32)); 22] = [
        ((9, 0), (6, 0)),
        ((9, 1), (6, 1)),
        ((9, 2), (6, 2)),
        ((10, 0), (6, 3)),
        ((10, 1), (6, 4)),
        ((10, 2), (6, 5)),
        ((11, 0), (7, 0)),
        ((11, 1), (7, 1)),
        ((11, 2), (7, 2)),
        ((11, 3), (7, 3)),
        ((11, 4), (7, 4)),
        ((11, 5), (7, 5)),
        ((11, 6), (7, 6)),
        ((11, 7), (7, 7)),
        ((11, 8), (7, 8)),
        ((12, 0), (8, 0)),
        ((12, 1), (8, 1)),
        ((12, 2), (8, 2)),
        ((12, 3), (8, 3)),
        ((12, 4), (8, 4)),
        ((12, 5), (8, 5)),
        ((12, 6), (8, 5)),
    ];
    const LATER: [((u32, u32), (u32, u32)); 4] = [
        ((12, 7), (8, 6)),
        ((12, 8), (8, 7)),
        ((12, 9), (8, 8)),
        ((13, 0), (9, 0)),
    ];
    let v = (major, minor);
    let mut best = (6, 0);
    for (cuda, ptx) in TABLE.iter().chain(LATER.iter()) {
        if *cuda <= v {
            best = *ptx;
        }
    }
    best
}

/// `(target sm, minimum PTX ISA version)` for a device of compute capability `cc` (`90` for
/// 9.0): the device's own architecture up to `sm_90`, and `sm_90` for anything newer (PTX is
/// forward compatible, so a Blackwell GPU JIT-compiles it).
pub fn ptx_target(cc: u32) -> (u32, (u32, u32)) {
    let target = cc.clamp(50, 90);
    let min = match target {
        ..=70 => (6, 0),
        71..=72 => (6, 1),
        73..=75 => (6, 3),
        76..=80 => (7, 0),
        81..=86 => (7, 1),
        87 => (7, 4),
        _ => (7, 8),
    };
    (target, min)
}

/// Parses a CUDA version `major.minor` (`12.8`, `12.8.1`); `None` otherwise.
pub fn parse_cuda_version(s: &str) -> Option<(u32, u32)> {
    let mut it = s.trim().split('.');
    let major = it.next()?.parse().ok()?;
    let minor = it.next().unwrap_or("0").parse().ok()?;
    Some((major, minor))
}

/// The probe kernel: `out[i] = 3·i + 7` for `i < n`, at PTX ISA `version`, for `sm_<target>`.
pub fn probe_ptx(version: (u32, u32), target: u32) -> String {
    format!(
        "//\n// inference-cache agent CUDA probe\n//\n\
         .version {}.{}\n.target sm_{target}\n.address_size 64\n\n\
         .visible .entry {KERNEL_NAME}(\n\
         \t.param .u64 {KERNEL_NAME}_param_0,\n\
         \t.param .u32 {KERNEL_NAME}_param_1\n)\n{{\n\
         \t.reg .pred \t%p<2>;\n\
         \t.reg .b32 \t%r<7>;\n\
         \t.reg .b64 \t%rd<5>;\n\n\
         \tld.param.u64 \t%rd1, [{KERNEL_NAME}_param_0];\n\
         \tld.param.u32 \t%r2, [{KERNEL_NAME}_param_1];\n\
         \tmov.u32 \t%r3, %ctaid.x;\n\
         \tmov.u32 \t%r4, %ntid.x;\n\
         \tmov.u32 \t%r5, %tid.x;\n\
         \tmad.lo.s32 \t%r1, %r3, %r4, %r5;\n\
         \tsetp.ge.u32 \t%p1, %r1, %r2;\n\
         \t@%p1 bra \tLBB0_2;\n\n\
         \tcvta.to.global.u64 \t%rd2, %rd1;\n\
         \tmul.wide.u32 \t%rd3, %r1, 4;\n\
         \tadd.s64 \t%rd4, %rd2, %rd3;\n\
         \tmad.lo.s32 \t%r6, %r1, 3, 7;\n\
         \tst.global.u32 \t[%rd4], %r6;\n\n\
         LBB0_2:\n\
         \tret;\n\n}}\n",
        version.0, version.1
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::verdict::format_driver_version;
    use super::*;

    #[test]
    fn ptx_versions() {
        assert_eq!(ptx_isa_for_cuda(12, 8), (8, 7));
        assert_eq!(ptx_isa_for_cuda(12, 4), (8, 4));
        assert_eq!(ptx_isa_for_cuda(12, 6), (8, 5));
        assert_eq!(ptx_isa_for_cuda(11, 8), (7, 8));
        assert_eq!(ptx_isa_for_cuda(13, 0), (9, 0));
        assert_eq!(
            ptx_isa_for_cuda(14, 2),
            (9, 0),
            "newer than the table: its newest"
        );
        assert_eq!(ptx_isa_for_cuda(8, 0), (6, 0));
        assert_eq!(ptx_target(90), (90, (7, 8)));
        assert_eq!(ptx_target(100), (90, (7, 8)));
        assert_eq!(ptx_target(80), (80, (7, 0)));
        assert_eq!(ptx_target(86), (86, (7, 1)));
        assert_eq!(ptx_target(70), (70, (6, 0)));
        assert_eq!(ptx_target(35), (50, (6, 0)));
        assert_eq!(parse_cuda_version("12.8"), Some((12, 8)));
        assert_eq!(parse_cuda_version("12.8.1"), Some((12, 8)));
        assert_eq!(parse_cuda_version("13"), Some((13, 0)));
        assert_eq!(parse_cuda_version("x"), None);
        assert_eq!(format_driver_version(12080), "12.8");
        assert_eq!(format_driver_version(13000), "13.0");
    }

    #[test]
    fn ptx_text() {
        let p = probe_ptx((8, 7), 90);
        assert!(
            p.contains(".version 8.7\n.target sm_90\n.address_size 64\n"),
            "{p}"
        );
        assert!(p.contains(".visible .entry ic_probe("));
        assert!(p.contains("mad.lo.s32 \t%r6, %r1, 3, 7;"));
        assert_eq!(expected_value(0), 7);
        assert_eq!(expected_value(255), 772);
    }
}
