//! The packaged JSON Schema of the storage capability catalog and the controller's loader agree
//! on a table of good and bad catalogs (spec 004 "Capability catalog": "validated by a packaged
//! JSON Schema and by the loader with the same rules"), the catalog the chart ships passes both,
//! and the loader alone rejects duplicate provisioners (uniqueness by key is not expressible in
//! JSON Schema; the spec assigns it to the loader).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use ic_controller::catalog::{self, Catalog, CatalogError, FlowRequest, NoFlow};
use ic_shared::crd::Flow;
use serde_json::{json, Value};

fn schema() -> jsonschema::Validator {
    let schema: Value = serde_json::from_str(catalog::SCHEMA).expect("schema is JSON");
    jsonschema::validator_for(&schema).expect("schema compiles")
}

fn entry(name: &str, modes: &[&str], options: &[&str]) -> Value {
    json!({"name": name, "provider": "p", "accessModes": modes, "readerMountOptions": options})
}

fn doc(entries: Vec<Value>) -> Value {
    json!({ "drivers": entries })
}

/// (case, catalog, valid)
fn table() -> Vec<(&'static str, Value, bool)> {
    let rwo_rox = entry(
        "nvmesh-csi.excelero.com",
        &["ReadWriteOnce", "ReadOnlyMany"],
        &["ro", "norecovery", "nouuid"],
    );
    let mut with_rule = rwo_rox.clone();
    with_rule["volumeHandleNamespace"] = json!({"separator": "/", "segment": 2});
    let mut encrypted = rwo_rox.clone();
    encrypted["encryptionSupported"] = json!(true);
    let mut unknown_field = rwo_rox.clone();
    unknown_field["flow"] = json!("roxReadOnly");
    let mut no_provider = rwo_rox.clone();
    no_provider.as_object_mut().unwrap().remove("provider");
    let mut empty_provider = rwo_rox.clone();
    empty_provider["provider"] = json!("");
    let mut bad_rule = rwo_rox.clone();
    bad_rule["volumeHandleNamespace"] = json!({"separator": "", "segment": 0});
    let mut negative_segment = rwo_rox.clone();
    negative_segment["volumeHandleNamespace"] = json!({"separator": "/", "segment": -1});
    let mut rule_extra = rwo_rox.clone();
    rule_extra["volumeHandleNamespace"] = json!({"separator": "/", "segment": 0, "x": 1});
    let mut enc_string = rwo_rox.clone();
    enc_string["encryptionSupported"] = json!("yes");
    // Issue 17 item 5: an explicit null is not "absent" for either validator.
    let mut null_rule = rwo_rox.clone();
    null_rule["volumeHandleNamespace"] = Value::Null;
    let mut null_enc = rwo_rox.clone();
    null_enc["encryptionSupported"] = Value::Null;
    vec![
        // good
        ("empty catalog", doc(vec![]), true),
        (
            "spec example",
            doc(vec![encrypted.clone(), entry("csi.weka.io", &[], &[])]),
            true,
        ),
        (
            "rwx only",
            doc(vec![entry(
                "fss.csi.oraclecloud.com",
                &["ReadWriteMany"],
                &[],
            )]),
            true,
        ),
        (
            "rwx with rox",
            doc(vec![entry(
                "csi.weka.io",
                &["ReadWriteMany", "ReadOnlyMany"],
                &[],
            )]),
            true,
        ),
        (
            "rwo alone (off)",
            doc(vec![entry("ebs.csi.aws.com", &["ReadWriteOnce"], &[])]),
            true,
        ),
        (
            "all three with ro",
            doc(vec![entry(
                "a.b",
                &["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany"],
                &["ro"],
            )]),
            true,
        ),
        ("handle rule", doc(vec![with_rule]), true),
        (
            "63-character name",
            doc(vec![entry(&format!("a{}b", "x".repeat(61)), &[], &[])]),
            true,
        ),
        (
            "upper-case name",
            doc(vec![entry("CSI.Example.COM", &[], &[])]),
            true,
        ),
        // bad: the two spec rules
        (
            "rwo+rox without ro",
            doc(vec![entry(
                "a.b",
                &["ReadWriteOnce", "ReadOnlyMany"],
                &["nouuid"],
            )]),
            false,
        ),
        (
            "rwo+rox+rwx without ro",
            doc(vec![entry(
                "a.b",
                &["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany"],
                &[],
            )]),
            false,
        ),
        (
            "rox without a writer",
            doc(vec![entry("a.b", &["ReadOnlyMany"], &["ro"])]),
            false,
        ),
        // bad: shape
        ("no drivers", json!({}), false),
        (
            "extra top-level key",
            json!({"drivers": [], "version": 1}),
            false,
        ),
        ("drivers not a list", json!({"drivers": {}}), false),
        (
            "unknown mode",
            doc(vec![entry("a.b", &["ReadWriteOncePod"], &[])]),
            false,
        ),
        (
            "misspelt mode",
            doc(vec![entry("a.b", &["ReadWriteMany", "readOnlyMany"], &[])]),
            false,
        ),
        (
            "repeated mode",
            doc(vec![entry("a.b", &["ReadWriteMany", "ReadWriteMany"], &[])]),
            false,
        ),
        (
            "repeated option",
            doc(vec![entry("a.b", &["ReadWriteMany"], &["ro", "ro"])]),
            false,
        ),
        (
            "comma in option",
            doc(vec![entry("a.b", &["ReadWriteMany"], &["ro,nouuid"])]),
            false,
        ),
        (
            "empty option",
            doc(vec![entry("a.b", &["ReadWriteMany"], &[""])]),
            false,
        ),
        ("empty name", doc(vec![entry("", &[], &[])]), false),
        (
            "name with slash",
            doc(vec![entry("kubernetes.io/aws-ebs", &[], &[])]),
            false,
        ),
        (
            "name ending in dot",
            doc(vec![entry("a.b.", &[], &[])]),
            false,
        ),
        (
            "64-character name",
            doc(vec![entry(&format!("a{}b", "x".repeat(62)), &[], &[])]),
            false,
        ),
        ("unknown entry field", doc(vec![unknown_field]), false),
        ("missing provider", doc(vec![no_provider]), false),
        ("empty provider", doc(vec![empty_provider]), false),
        (
            "missing accessModes",
            doc(vec![
                json!({"name": "a.b", "provider": "p", "readerMountOptions": []}),
            ]),
            false,
        ),
        (
            "missing readerMountOptions",
            doc(vec![
                json!({"name": "a.b", "provider": "p", "accessModes": []}),
            ]),
            false,
        ),
        (
            "encryptionSupported not boolean",
            doc(vec![enc_string]),
            false,
        ),
        ("empty handle separator", doc(vec![bad_rule]), false),
        (
            "negative handle segment",
            doc(vec![negative_segment]),
            false,
        ),
        ("extra handle field", doc(vec![rule_extra]), false),
        ("null handle rule", doc(vec![null_rule]), false),
        ("null encryptionSupported", doc(vec![null_enc]), false),
    ]
}

#[test]
fn schema_and_loader_agree_on_every_case() {
    let validator = schema();
    let mut disagreements = Vec::new();
    for (case, catalog, valid) in table() {
        let by_schema = validator.is_valid(&catalog);
        let by_loader = Catalog::from_value(&catalog);
        if by_schema != valid {
            disagreements.push(format!("{case}: schema says {by_schema}, expected {valid}"));
        }
        if by_loader.is_ok() != valid {
            disagreements.push(format!(
                "{case}: loader says {:?}, expected valid={valid}",
                by_loader.err().map(|e| e.to_string())
            ));
        }
        // Text round trip: the loader reads YAML and JSON alike.
        let yaml = serde_yaml::to_string(&catalog).unwrap();
        assert_eq!(
            Catalog::parse(&yaml).is_ok(),
            by_loader_ok(&catalog),
            "{case} (yaml)"
        );
    }
    assert!(disagreements.is_empty(), "{disagreements:#?}");
}

fn by_loader_ok(v: &Value) -> bool {
    Catalog::from_value(v).is_ok()
}

#[test]
fn duplicates_are_a_loader_rule() {
    let dup = doc(vec![
        entry("csi.weka.io", &[], &[]),
        entry("csi.weka.io", &["ReadWriteMany"], &[]),
    ]);
    assert!(
        schema().is_valid(&dup),
        "JSON Schema cannot express uniqueness by name"
    );
    match Catalog::from_value(&dup) {
        Err(CatalogError::Invalid { problems }) => {
            assert_eq!(problems.len(), 1);
            assert_eq!(problems[0].path, "drivers[1].name");
            assert!(problems[0].message.contains("listed twice"));
        }
        other => panic!("duplicates accepted: {other:?}"),
    }
    // Identical duplicate entries: the schema's only uniqueness tool would not apply either.
    let same = doc(vec![entry("a.b", &[], &[]), entry("a.b", &[], &[])]);
    assert!(Catalog::from_value(&same).is_err());
}

fn chart_catalog() -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../chart/files/catalog.json"),
    )
    .expect("chart/files/catalog.json")
}

#[test]
fn the_shipped_catalog_passes_schema_and_loader() {
    let text = chart_catalog();
    let value: Value = serde_json::from_str(&text).unwrap();
    let errors: Vec<String> = schema()
        .iter_errors(&value)
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");
    let c = Catalog::parse(&text).unwrap();
    // The spec's NVMesh entry: roxReadOnly, `ro` first, encryption qualified; every other
    // registered provider stays empty until a full cache workflow has run on it.
    let nvmesh = c.driver("nvmesh-csi.excelero.com").unwrap();
    assert_eq!(
        nvmesh.reader_mount_options,
        vec!["ro", "norecovery", "nouuid"]
    );
    assert!(nvmesh.encryption_supported);
    // NVMesh 3.2 cross-namespace volumes: the volume handle is a 4-element, colon-separated
    // encoding whose last element is the consuming PVC's namespace (NVCA's
    // `updateSecondaryPVVolumeHandle`, pkg/storage/modelcache.go), so roxReadOnly crosses
    // namespaces there and helmModelCache is durable (spec 004 "Capability catalog").
    assert_eq!(
        nvmesh.volume_handle_namespace,
        Some(ic_shared::crd::VolumeHandleNamespace {
            separator: ":".into(),
            segment: 3
        })
    );
    let helm = FlowRequest {
        provisioner: "nvmesh-csi.excelero.com",
        cross_namespace: true,
        encryption_requested: false,
    };
    assert_eq!(c.decide(&helm).unwrap().flow, Flow::RoxReadOnly);
    let req = |p| FlowRequest {
        provisioner: p,
        cross_namespace: false,
        encryption_requested: false,
    };
    assert_eq!(
        c.decide(&req("nvmesh-csi.excelero.com")).unwrap().flow,
        Flow::RoxReadOnly
    );
    for p in [
        "csi.weka.io",
        "fss.csi.oraclecloud.com",
        "lustre.csi.oraclecloud.com",
    ] {
        assert!(
            matches!(c.decide(&req(p)), Err(NoFlow::NoQualifiedModes { .. })),
            "{p} must stay off until qualified"
        );
    }
}

#[test]
fn a_catalog_edit_changes_decisions_not_their_digest_inputs() {
    // The profile digest a binding records moves with any edit of its entry, and only of its
    // entry: what lets an operator see that a live binding was decided on an older catalog.
    let before = Catalog::parse(&chart_catalog()).unwrap();
    let mut edited: Value = serde_json::from_str(&chart_catalog()).unwrap();
    edited["drivers"][0]["readerMountOptions"] = json!(["ro", "nouuid"]);
    edited["drivers"][1]["accessModes"] = json!(["ReadWriteMany"]);
    let after = Catalog::from_value(&edited).unwrap();
    let req = FlowRequest {
        provisioner: "nvmesh-csi.excelero.com",
        cross_namespace: false,
        encryption_requested: false,
    };
    let d0 = before.decide(&req).unwrap();
    let d1 = after.decide(&req).unwrap();
    assert_ne!(d0.catalog_profile_digest, d1.catalog_profile_digest);
    assert_eq!(d1.reader_mount_options, vec!["ro", "nouuid"]);
    let weka = FlowRequest {
        provisioner: "csi.weka.io",
        ..req
    };
    assert_eq!(after.decide(&weka).unwrap().flow, Flow::RwxReadOnly);
}
