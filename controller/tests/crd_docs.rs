//! The committed `docs/crd-reference.md` equals what `ic_controller::crddoc` renders from the
//! CRDs, so the field reference never drifts from the schemas the API server serves.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use ic_controller::{crddoc, crdgen};

fn reference_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/crd-reference.md")
}

fn regenerate() -> String {
    format!(
        "run `{}` and commit docs/crd-reference.md",
        crddoc::REGENERATE
    )
}

#[test]
fn committed_reference_matches_the_crds() {
    let path = reference_path();
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("{}: {e}; {}", path.display(), regenerate());
    });
    let rendered = crddoc::render_all();
    if committed != rendered {
        let first = committed
            .lines()
            .zip(rendered.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(rendered.lines().count()));
        panic!(
            "{} is out of date with the CRDs (first difference at line {}); {}",
            path.display(),
            first + 1,
            regenerate()
        );
    }
}

#[test]
fn reference_covers_every_crd() {
    let rendered = crddoc::render_all();
    for crd in crdgen::all_crds() {
        let kind = &crd.spec.names.kind;
        assert!(
            rendered.contains(&format!("\n## {kind}\n")),
            "no section for {kind}"
        );
    }
}

#[test]
fn write_produces_the_rendered_reference() {
    let dir = std::env::temp_dir().join(format!("ic-crddoc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("nested/crd-reference.md");
    crddoc::write(&path).expect("write");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        crddoc::render_all()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
